"""Test set-up: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """A test marked `gpu` runs only where JAX's default backend is a GPU (`pytest -m gpu` on a CUDA machine,
    with JAX_PLATFORMS=cuda,cpu); elsewhere it is skipped, never run on the CPU."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    import jax
    import pytest

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU; JAX's default backend here is {jax.default_backend()!r}")
    for item in marked:
        item.add_marker(skip)
