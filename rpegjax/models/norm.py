"""RMSNorm, in float32 whatever the compute dtype:

    y = x / sqrt(mean(x^2) + eps) * w         (Llama, Qwen: the scale starts at 1)
    y = x / sqrt(mean(x^2) + eps) * (1 + w)   (Gemma, `unit_offset`: the stored weight starts at 0)

Gemma's form keeps its checkpoints' weights as they are (a bfloat16 1 + w would lose the small w's low bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from rpegjax.sharding import axes


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype, logical: str = axes.EMBED, *, unit_offset: bool = False):
        self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((size,), dtype), logical_axes=(logical,))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale.get_value().astype(jnp.float32)
        return (normed * (1.0 + scale if self.unit_offset else scale)).astype(x.dtype)
