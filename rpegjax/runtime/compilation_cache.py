"""JAX's persistent compilation cache for a job: compiled programs (the sampler's admit, prefill and decode
programs, the learner's step) are written to disk and reused by the next run with the same shapes."""

from __future__ import annotations

import os
from pathlib import Path

import jax


def default_compilation_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/rpegjax/jax` (`~/.cache/rpegjax/jax` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rpegjax" / "jax"


def enable_compilation_cache(directory: str | os.PathLike | None = None, *, min_compile_seconds: float = 1.0) -> Path:
    """Turns on JAX's persistent compilation cache in `directory` (default `default_compilation_cache_dir()`),
    creating it. Programs that took at least `min_compile_seconds` to compile are cached (small ones
    recompile faster than they load). Call once at job start, before the first compilation.
    Returns the directory used."""
    if min_compile_seconds < 0:
        raise ValueError(f"enable_compilation_cache: min_compile_seconds must be >= 0, got {min_compile_seconds!r}")
    path = Path(directory) if directory is not None else default_compilation_cache_dir()
    path = path.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
