import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rpegjax.runtime.compilation_cache import default_compilation_cache_dir, enable_compilation_cache


def test_enabled_cache_receives_compiled_programs(tmp_path):
    """In a fresh process (the cache is process-wide state): a compiled program lands in the directory."""
    directory = tmp_path / "jax-cache"
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from rpegjax.runtime.compilation_cache import enable_compilation_cache
        print(enable_compilation_cache({str(directory)!r}, min_compile_seconds=0))
        jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(directory)
    assert any(path.is_file() for path in directory.rglob("*"))


def test_default_directory_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compilation_cache_dir() == Path(tmp_path) / "rpegjax" / "jax"
    with pytest.raises(ValueError, match="min_compile_seconds must be >= 0, got -1"):
        enable_compilation_cache(tmp_path, min_compile_seconds=-1)
