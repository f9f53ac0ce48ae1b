"""Rotary position embeddings: a setting per layer kind (base, rotary dims, scaling), tables once per setting.

A `Rope` names one setting; layers of kinds that share it share its cos/sin tables, which `Decoder` computes once
per forward for each distinct setting of its stack (Gemma 3's sliding and global layers: two). Inverse frequencies
are computed at trace time from the setting (a constant, not a parameter):

    inv_freq_j = theta^(-2j / dim),  j < dim / 2,   then rescaled by the setting's scaling, if any.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE rescaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type == "linear"`): every frequency divided by `factor`."""

    factor: float

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, int | float) or self.factor <= 0:
            raise ValueError(f"LinearRopeScaling.factor must be a positive number, got {self.factor!r}")


RopeScaling = Llama3RopeScaling | LinearRopeScaling


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rope:
    """One RoPE setting: base `theta`, the first `dim` dims of each head rotated (the rest pass through), `scaling`."""

    theta: float
    dim: int
    scaling: RopeScaling | None = None


def inverse_frequencies(rope: Rope) -> np.ndarray:
    """[dim / 2] float32 inverse frequencies of `rope`, rescaled as its scaling says."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, rope.dim, 2, dtype=np.float64) / rope.dim))
    scaling = rope.scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / scaling.factor).astype(np.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: Int[Array, "b t"], inv_freq: np.ndarray) -> tuple[Array, Array]:
    """cos and sin of RoPE's angles, each [b, t, 1, dim/2] float32: computed once per forward and setting, shared by
    the layers of that setting."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # b t dim/2
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: Float[Array, "b t h e"], tables: tuple[Array, Array]) -> Float[Array, "b t h e"]:
    """Rotate-half RoPE, as in the Hugging Face Llama/Qwen/Gemma implementations: with x = [x1, x2] (halves of the
    rotated dims), x cos + rotate_half(x) sin = [x1 cos - x2 sin, x2 cos + x1 sin] (one concatenate, forward and
    backward); dims past the tables' (a partial rotary setting) pass through unchanged."""
    cos, sin = tables
    half = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:2 * half]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:
        rotated.append(x32[..., 2 * half:])
    return jnp.concatenate(rotated, axis=-1).astype(x.dtype)
