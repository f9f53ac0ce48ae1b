"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama 3) in Flax NNX.

Two call paths share every layer:
* full sequence (`Decoder.__call__` without a cache): training and log-probs;
* incremental over a `KVCache`: the sampler's prefill and decode steps.

Cache layout: row b holds its tokens at cache indices 0 .. lengths[b]-1, RoPE position = cache index
offset by `positions` given by the caller. New tokens are written at `lengths[b]` onwards; a query
at cache index i attends to keys j <= i. Padding written past a row's valid tokens is never attended
to and is overwritten by the next write, so prompts can be right-padded in a prefill.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.config import ModelConfig
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain

_NEG_INF = -1e30


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for a fixed number of slots (rows) and capacity."""

    k: Float[Array, "l b t k e"]
    v: Float[Array, "l b t k e"]
    lengths: Int[Array, " b"]  # valid tokens per row

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> KVCache:
        shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        dtype = cfg.jnp_dtype if dtype is None else dtype
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def logical_axes() -> tuple[str | None, ...]:
        return (None, axes.BATCH, axes.CACHE_SEQ, axes.KV_HEADS, axes.HEAD_DIM)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, fan_in: int) -> nnx.Param:
    value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(value.astype(dtype), logical_axes=logical)


def _zeros(shape, logical, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=logical)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype, logical: str = axes.EMBED):
        self.scale = nnx.Param(jnp.ones((size,), dtype), logical_axes=(logical,))
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale.get_value().astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of RoPE, with Llama 3's rescaling when configured."""
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
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


def apply_rope(x: Float[Array, "b t h e"], positions: Int[Array, "b t"], inv_freq: np.ndarray) -> Float[Array, "b t h e"]:
    """Rotate-half RoPE, as in the Hugging Face Llama/Qwen implementations."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # b t e/2
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, e, pdt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_param_dtype
        self.q_proj = _param(rngs, (d, h, e), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pdt, d)
        self.k_proj = _param(rngs, (d, k, e), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pdt, d)
        self.v_proj = _param(rngs, (d, k, e), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pdt, d)
        self.o_proj = _param(rngs, (h, e, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pdt, h * e)
        if cfg.attention_bias:
            self.q_bias = _zeros((h, e), (axes.HEADS, axes.HEAD_DIM), pdt)
            self.k_bias = _zeros((k, e), (axes.KV_HEADS, axes.HEAD_DIM), pdt)
            self.v_bias = _zeros((k, e), (axes.KV_HEADS, axes.HEAD_DIM), pdt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(e, cfg.rms_norm_eps, pdt, axes.HEAD_DIM)
            self.k_norm = RMSNorm(e, cfg.rms_norm_eps, pdt, axes.HEAD_DIM)
        self.cfg = cfg

    def _project(self, x, kernel: nnx.Param, bias_name: str, norm_name: str | None, positions):
        dt = self.cfg.jnp_dtype
        # 2-D matmuls: XLA's CPU backend runs [b*t, d] @ [d, h*e] several times faster than a batched einsum
        w = kernel.get_value().astype(dt)
        b, t, d = x.shape
        y = (x.reshape(b * t, d) @ w.reshape(d, -1)).reshape(b, t, *w.shape[1:])
        if self.cfg.attention_bias:
            y = y + getattr(self, bias_name).get_value().astype(dt)
        if self.cfg.qk_norm and norm_name is not None:
            y = getattr(self, norm_name)(y)
        # computed at trace time from the config: a constant, not a parameter
        return y if positions is None else apply_rope(y, positions, rope_inverse_frequencies(self.cfg))

    def __call__(
        self,
        x: Float[Array, "b t d"],
        positions: Int[Array, "b t"],
        key_mask: Bool[Array, "b t"] | None,
        layer_cache: tuple[Array, Array, int] | None,  # all layers' cache k, v and this layer's index
        cache_offsets: Int[Array, " b"] | None,
        sharding: ActivationSharding | None,
    ) -> tuple[Float[Array, "b t d"], tuple[Array, Array] | None]:
        cfg = self.cfg
        q = self._project(x, self.q_proj, "q_bias", "q_norm", positions)
        k = self._project(x, self.k_proj, "k_bias", "k_norm", positions)
        v = self._project(x, self.v_proj, "v_bias", None, None)
        q = constrain(q, sharding, (axes.BATCH, None, axes.HEADS, None))
        t = x.shape[1]
        if layer_cache is None:
            keys, values = k, v
            query_index = jnp.arange(t)[None, :]  # b t
            key_index = jnp.arange(t)[None, :]
            valid = (key_index[:, None, :] <= query_index[:, :, None])  # b t s
            if key_mask is not None:
                valid = valid & key_mask[:, None, :]
            new_cache = None
        else:
            # layer_cache holds every layer's [l b T k e] arrays: writing only the new tokens into them
            # (a scatter XLA does in place) avoids copying the whole cache at every decode step
            cache_k, cache_v, layer = layer_cache
            rows = jnp.arange(x.shape[0])[:, None]
            columns = cache_offsets[:, None] + jnp.arange(t)[None, :]
            cache_k = cache_k.at[layer, rows, columns].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[layer, rows, columns].set(v.astype(cache_v.dtype), mode="drop")
            keys, values = cache_k[layer], cache_v[layer]
            new_cache = (cache_k, cache_v)
            query_index = cache_offsets[:, None] + jnp.arange(t)[None, :]  # b t
            key_index = jnp.arange(keys.shape[1])[None, None, :]
            valid = key_index <= query_index[:, :, None]  # b t s
        groups = cfg.num_heads // cfg.num_kv_heads
        qg = q.reshape(q.shape[0], t, cfg.num_kv_heads, groups, cfg.head_dim)
        scores = jnp.einsum("btkge,bske->bkgts", qg, keys.astype(q.dtype)).astype(jnp.float32)
        scores = scores / math.sqrt(cfg.head_dim)
        scores = jnp.where(valid[:, None, None, :, :], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgts,bske->btkge", probs, values.astype(q.dtype)).reshape(q.shape)
        o_proj = self.o_proj.get_value().astype(cfg.jnp_dtype)
        b = out.shape[0]
        out = (out.reshape(b * t, -1) @ o_proj.reshape(-1, o_proj.shape[-1])).reshape(b, t, -1)
        return out, new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, pdt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
        self.gate_proj = _param(rngs, (d, f), (axes.EMBED, axes.MLP), pdt, d)
        self.up_proj = _param(rngs, (d, f), (axes.EMBED, axes.MLP), pdt, d)
        self.down_proj = _param(rngs, (f, d), (axes.MLP, axes.EMBED), pdt, f)
        self.dtype = cfg.jnp_dtype

    def __call__(self, x: Float[Array, "b t d"], sharding: ActivationSharding | None) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)  # 2-D matmuls are much faster than batched ones on XLA's CPU backend
        gate = flat @ self.gate_proj.get_value().astype(self.dtype)
        up = flat @ self.up_proj.get_value().astype(self.dtype)
        hidden = constrain((jax.nn.silu(gate) * up).reshape(b, t, -1), sharding, (axes.BATCH, None, axes.MLP))
        return (hidden.reshape(b * t, -1) @ self.down_proj.get_value().astype(self.dtype)).reshape(b, t, d)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.attention = Attention(cfg, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, key_mask, layer_cache, cache_offsets, sharding):
        attended, new_cache = self.attention(self.input_norm(x), positions, key_mask, layer_cache, cache_offsets, sharding)
        x = x + attended
        x = x + self.mlp(self.post_attention_norm(x), sharding)
        return constrain(x, sharding, (axes.BATCH, None, axes.EMBED)), new_cache


class Decoder(nnx.Module):
    """The language model; with `cfg.value_head` it also carries a scalar value head on the final hidden state."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = cfg.jnp_param_dtype
        self.cfg = cfg
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * 0.02).astype(pdt),
            logical_axes=(axes.VOCAB, axes.EMBED),
        )
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), (axes.EMBED, axes.VOCAB), pdt, cfg.hidden_size)
        if cfg.value_head:
            self.value_kernel = nnx.Param(jnp.zeros((cfg.hidden_size,), pdt), logical_axes=(axes.EMBED,))
            self.value_bias = nnx.Param(jnp.zeros((), pdt), logical_axes=())

    def hidden_states(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        *,
        mask: Bool[Array, "b t"] | None = None,
        cache: KVCache | None = None,
        sharding: ActivationSharding | None = None,
    ) -> tuple[Float[Array, "b t d"], KVCache | None]:
        """Final-norm hidden states.

        Without a cache, `mask` marks real (non-padding) tokens: keys at padding are never attended to.
        With a cache, the t tokens are written at each row's `cache.lengths` and the returned cache
        has `lengths + mask.sum(-1)` (all t when `mask` is None).
        """
        x = self.embed.get_value()[tokens].astype(self.cfg.jnp_dtype)
        x = constrain(x, sharding, (axes.BATCH, None, axes.EMBED))
        all_k, all_v = (None, None) if cache is None else (cache.k, cache.v)
        for index, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (all_k, all_v, index)
            offsets = None if cache is None else cache.lengths
            x, written = layer(x, positions, mask, layer_cache, offsets, sharding)
            if written is not None:
                all_k, all_v = written
        new_cache = None
        if cache is not None:
            added = tokens.shape[1] if mask is None else mask.sum(axis=-1).astype(jnp.int32)
            new_cache = KVCache(k=all_k, v=all_v, lengths=cache.lengths + added)
        return self.final_norm(x), new_cache

    def output_kernel(self) -> Float[Array, "d v"]:
        if self.cfg.tie_word_embeddings:
            return self.embed.get_value().T
        return self.lm_head.get_value()

    def logits(self, hidden: Float[Array, "b t d"]) -> Float[Array, "b t v"]:
        """Float32 logits; for long sequences prefer `rpegjax.models.logprobs.token_logprobs`."""
        dt = self.cfg.jnp_dtype
        return (hidden.astype(dt) @ self.output_kernel().astype(dt)).astype(jnp.float32)

    def values(self, hidden: Float[Array, "b t d"]) -> Float[Array, "b t"]:
        """Scalar value per position from the value head."""
        if not self.cfg.value_head:
            raise ValueError("this model has no value head; build it with ModelConfig(value_head=True)")
        kernel = self.value_kernel.get_value().astype(jnp.float32)
        return hidden.astype(jnp.float32) @ kernel + self.value_bias.get_value().astype(jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        *,
        mask: Bool[Array, "b t"] | None = None,
        sharding: ActivationSharding | None = None,
    ) -> Float[Array, "b t v"]:
        """Full-sequence logits. Positions default to the count of real tokens before each one (left padding safe)."""
        if positions is None:
            positions = default_positions(tokens, mask)
        hidden, _ = self.hidden_states(tokens, positions, mask=mask, sharding=sharding)
        return self.logits(hidden)


def default_positions(tokens: Int[Array, "b t"], mask: Bool[Array, "b t"] | None) -> Int[Array, "b t"]:
    """RoPE positions: 0, 1, ... over real tokens (padding gets the position of the next real token)."""
    if mask is None:
        return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
