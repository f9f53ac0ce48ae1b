"""Test set-up: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


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


def randomize_weights(model, seed: int):
    """Gives every parameter random values of a spread that makes logits N(0, ~1): biases and norm
    scales included, so that nothing equivalence tests compare is trivially zero or one."""
    import jax.numpy as jnp  # JAX is imported only after the device count above is set
    import numpy as np
    from flax import nnx

    rng = np.random.default_rng(seed)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(variable.get_value())
        name = path[-1] if isinstance(path[-1], str) else str(path[-1])
        if name == "scale":
            new = 1.0 + 0.2 * rng.standard_normal(value.shape)
        elif "bias" in name:
            new = 0.3 * rng.standard_normal(value.shape)
        elif name == "embed":
            new = rng.standard_normal(value.shape)
        else:
            fan_in = value.shape[0] if name != "o_proj" else value.shape[0] * value.shape[1]
            new = rng.standard_normal(value.shape) / np.sqrt(fan_in)
        variable.set_value(jnp.asarray(new, value.dtype))
    return model


@pytest.fixture(scope="session")
def randomize():
    """`randomize_weights` for tests that build their own models."""
    return randomize_weights
