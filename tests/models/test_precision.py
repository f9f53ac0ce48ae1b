"""The mixed-precision policy: defaults per backend and checkpoint, explicit settings win, the generation cast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.models.precision import Precision, cast_floating, generation_cast, resolve_precision


@pytest.mark.parametrize("backend, checkpoint, expected", [
    ("cpu", None, ("float32", "float32", "float32")),
    ("cpu", "bfloat16", ("float32", "float32", "float32")),  # CPU: float32 everywhere
    ("tpu", "bfloat16", ("float32", "float32", "float32")),
    ("gpu", None, ("float32", "float32", "float32")),  # the built-in small model
    ("gpu", "bfloat16", ("float32", "bfloat16", "bfloat16")),  # master float32, the checkpoint's compute dtype
    ("gpu", "float16", ("float32", "float16", "float16")),
    ("gpu", "float32", ("float32", "float32", "float32")),  # a float32 checkpoint stays float32
])
def test_the_default_policy(backend, checkpoint, expected):
    got = resolve_precision(backend=backend, checkpoint_dtype=checkpoint)
    assert (got.param_dtype, got.dtype, got.generation_dtype) == expected


def test_explicit_dtypes_override_the_policy():
    got = resolve_precision(backend="gpu", checkpoint_dtype="bfloat16", param_dtype="bfloat16")
    assert got == Precision(param_dtype="bfloat16", dtype="bfloat16", generation_dtype="bfloat16")
    got = resolve_precision(backend="gpu", checkpoint_dtype="bfloat16", dtype="float32", generation_dtype="bfloat16")
    assert got == Precision(param_dtype="float32", dtype="float32", generation_dtype="bfloat16")
    got = resolve_precision(backend="cpu", checkpoint_dtype=None, dtype="bfloat16")
    assert got == Precision(param_dtype="float32", dtype="bfloat16", generation_dtype="bfloat16")
    with pytest.raises(ValueError, match="resolve_precision: dtype must be one of"):
        resolve_precision(backend="gpu", checkpoint_dtype=None, dtype="float64")


def test_generation_cast_only_when_the_copy_differs():
    assert generation_cast("float32", "bfloat16") == "bfloat16"
    assert generation_cast("float32", "float32") is None
    assert generation_cast("float32", "float32", "bfloat16") == "bfloat16"
    assert generation_cast("bfloat16", "bfloat16") is None


def test_cast_floating_casts_floats_only_into_new_buffers():
    tree = {"w": jnp.linspace(-1, 1, 7, dtype=jnp.float32), "ids": jnp.arange(3), "flag": jnp.array([True])}
    cast = jax.jit(lambda t: cast_floating(t, "bfloat16"))(tree)
    assert cast["w"].dtype == jnp.bfloat16 and cast["ids"].dtype == tree["ids"].dtype and cast["flag"].dtype == bool
    np.testing.assert_array_equal(np.asarray(cast["w"], np.float32), np.asarray(tree["w"].astype(jnp.bfloat16), np.float32))
    same = jax.jit(lambda t: cast_floating(t, "float32"))(tree)
    assert same["w"].unsafe_buffer_pointer() != tree["w"].unsafe_buffer_pointer()  # the update may donate the source


def test_the_model_section_resolves_through_the_policy():
    from rpegjax.train.config import ModelSection

    assert ModelSection().precision(backend="cpu", checkpoint_dtype="bfloat16").dtype == "float32"
    assert ModelSection().precision(backend="gpu", checkpoint_dtype="bfloat16") == Precision(
        param_dtype="float32", dtype="bfloat16", generation_dtype="bfloat16")
    assert ModelSection(dtype="float32").precision(backend="gpu", checkpoint_dtype="bfloat16").dtype == "float32"
    with pytest.raises(ValueError, match="ModelSection.generation_dtype must be one of"):
        ModelSection(generation_dtype="int8")
