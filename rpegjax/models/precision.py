"""The mixed-precision policy: which dtypes a run stores, computes and generates in, when the user does not say.

    backend     model                        parameters (master)   compute       generation copy
    gpu         Hugging Face checkpoint      float32               checkpoint's  compute dtype
    gpu         built-in (small)             float32               float32       float32
    cpu / tpu   any                          float32               float32       float32

A checkpoint stored in bfloat16 (or float16) computes in that dtype on a GPU, with float32 master weights
(so optimiser moments, which take the parameters' dtype, are float32 too); one stored in float32 stays
float32. What the user sets explicitly always wins. The generation copy of the weights defaults to the
compute dtype: generation's matmuls run in it anyway, and the copy (cast during weight sync) is then half
the size. Norms, softmax and log-probs run in float32 whatever the policy (`rpegjax.models.config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rpegjax.options import DType, parse_choice


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    param_dtype: DType  # how parameters (and so optimiser moments) are stored
    dtype: DType  # how matmuls compute
    generation_dtype: DType  # the generation copy of the weights

    def __post_init__(self) -> None:
        for name in ("param_dtype", "dtype", "generation_dtype"):
            object.__setattr__(self, name, parse_choice(DType, getattr(self, name), f"Precision.{name}"))


def resolve_precision(*, backend: str, checkpoint_dtype: DType | str | None, param_dtype: DType | str | None = None,
                      dtype: DType | str | None = None, generation_dtype: DType | str | None = None) -> Precision:
    """The policy of the module docstring for `backend` (`jax.default_backend()`) and a checkpoint stored in
    `checkpoint_dtype` (None: no checkpoint); `param_dtype`, `dtype`, `generation_dtype` given override it."""
    for name, value in (("checkpoint_dtype", checkpoint_dtype), ("param_dtype", param_dtype), ("dtype", dtype),
                        ("generation_dtype", generation_dtype)):
        if value is not None:
            parse_choice(DType, value, f"resolve_precision: {name}")
    default_compute = checkpoint_dtype if backend == "gpu" and checkpoint_dtype is not None else DType.FLOAT32
    compute = dtype or default_compute
    return Precision(param_dtype=param_dtype or DType.FLOAT32, dtype=compute, generation_dtype=generation_dtype or compute)


def cast_floating(tree: Any, dtype: str) -> Any:
    """Every floating-point array of `tree` in `dtype`, the others unchanged; always new arrays (under jit an
    unchanged input would be forwarded as the output, and the next update donates the training buffers)."""
    target = jnp.dtype(dtype)

    def cast(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != target:
            return x.astype(target)
        return jnp.copy(x)

    return jax.tree.map(cast, tree)


def generation_cast(param_dtype: str, dtype: str, generation_dtype: str | None = None) -> str | None:
    """The dtype weight sync casts the generation copy to (None: none, the copy keeps `param_dtype`): the one
    given, else the compute dtype `dtype`, as the policy says."""
    target = generation_dtype or dtype
    return None if target == param_dtype else target
