"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama 3) in Flax NNX.

Two call paths share every layer:
* full sequence (`Decoder.__call__` without a cache): training and log-probs;
* incremental over a `KVCache`: the sampler's prefill and decode steps.

Cache layout: row b holds its tokens at cache indices 0 .. lengths[b]-1, RoPE position = cache index
offset by `positions` given by the caller. New tokens are written at `lengths[b]` onwards; a query
at cache index i attends to keys j <= i. Padding written past a row's valid tokens is never attended
to and is overwritten by the next write, so prompts can be right-padded in a prefill.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.activations import swiglu
from rpegjax.models.attention import attend, segment_starts
from rpegjax.models.attention import causal_attention  # noqa: F401  (re-exported)
from rpegjax.models.config import ModelConfig
from rpegjax.models.context_attention import context_attention, from_balanced, to_balanced
from rpegjax.models.gathered_matmul import gathered_matmul
from rpegjax.models.layer_scan import remat_scan
from rpegjax.models.lora import (
    ATTENTION_TARGETS,
    MLP_TARGETS,
    Adapter,
    LoRAConfig,
    LoRAParam,
    LoRATarget,
    adapter_name,
    split_adapters,
    target_key,
)
from rpegjax.models.moe import Routing, SparseMoE
from rpegjax.options import MODEL_EXECUTION_FIELDS, RematPolicy, remat_runs
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain

_NEG_INF = -1e30

# Logical layouts of [b, t, d] activations: the residual stream between blocks (split on its sequence over `tensor`
# too under sequence parallelism), and a block's normed input to its column-parallel projections (gathered there).
RESIDUAL = (axes.BATCH, axes.RESIDUAL_SEQ, axes.EMBED)
GATHERED = (axes.BATCH, axes.SEQ, axes.EMBED)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for a fixed number of slots (rows) and capacity.

    `k` holds one [b, k, e, t] array per layer (slot, KV head, head dim, cache index), `v` one [b, k, t, e]
    array: a decode step reads and writes each layer's arrays in place, where slicing one layer out of a
    stacked [l, ...] array would copy it at every step. Keys are stored position-innermost so that one
    token's scores, a sum over the head dim, add whole rows of positions instead of reducing along the
    innermost axis (XLA:CPU's decode attention 2.9x faster at 128 positions: docs/benchmarks.md, "W-gen"); values stay
    head-dim-innermost, which is what the probability-weighted sum over positions wants.
    """

    k: tuple[Float[Array, "b k e t"], ...]
    v: tuple[Float[Array, "b k t e"], ...]
    lengths: Int[Array, " b"]  # valid tokens per row

    # the axis of cache positions in each layer's key and value array (class constants, not fields)
    KEY_POSITIONS = 3
    VALUE_POSITIONS = 2

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> KVCache:
        key_shape = (batch, cfg.num_kv_heads, cfg.head_dim, capacity)
        value_shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        dtype = cfg.jnp_dtype if dtype is None else dtype
        layers = range(cfg.num_layers)
        return cls(k=tuple(jnp.zeros(key_shape, dtype) for _ in layers),
                   v=tuple(jnp.zeros(value_shape, dtype) for _ in layers), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.v[0].shape[KVCache.VALUE_POSITIONS]

    @staticmethod
    def key_logical_axes() -> tuple[str | None, ...]:
        """Logical axes of each layer's k array."""
        return (axes.BATCH, axes.KV_HEADS, axes.HEAD_DIM, axes.CACHE_SEQ)

    @staticmethod
    def value_logical_axes() -> tuple[str | None, ...]:
        """Logical axes of each layer's v array."""
        return (axes.BATCH, axes.KV_HEADS, axes.CACHE_SEQ, axes.HEAD_DIM)

    def layer(self, index: int) -> tuple[Array, Array]:
        """What `Attention` receives for layer `index`. Another cache type (the sampler's paged cache)
        offers the same `layer` / `with_layers` pair and hands out a layer object with `write_and_attend`."""
        return self.k[index], self.v[index]

    def with_layers(self, written: list[tuple[Array, Array]], added: Int[Array, " b"]) -> KVCache:
        return KVCache(k=tuple(k for k, _ in written), v=tuple(v for _, v in written), lengths=self.lengths + added)


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


def rope_tables(positions: Int[Array, "b t"], inv_freq: np.ndarray) -> tuple[Array, Array]:
    """cos and sin of RoPE's angles, each [b, t, 1, e/2] float32: computed once per forward, shared by all layers."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # b t e/2
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: Float[Array, "b t h e"], rope: tuple[Array, Array]) -> Float[Array, "b t h e"]:
    """Rotate-half RoPE, as in the Hugging Face Llama/Qwen implementations: with x = [x1, x2] (halves of e),
    x cos + rotate_half(x) sin = [x1 cos - x2 sin, x2 cos + x1 sin] (one concatenate, forward and backward)."""
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _add_adapters(module: nnx.Module, targets: tuple[LoRATarget, ...], lora: LoRAConfig | None, in_dims: dict,
                  rngs: nnx.Rngs) -> None:
    """Puts an `Adapter` beside each targeted kernel of `module` (`q_proj` -> `q_proj_lora`); `in_dims[target]`
    is how many leading dims of that kernel are its input."""
    if lora is None:
        return
    for target in targets:
        if target not in lora.targets:
            continue
        kernel = getattr(module, f"{target.value}_proj")
        shape, logical = kernel.get_value().shape, kernel.get_metadata()["logical_axes"]
        n = in_dims[target]
        setattr(module, adapter_name(target), Adapter(shape[:n], shape[n:], logical[:n], logical[n:], lora,
                                                      kernel.get_value().dtype, rngs=rngs))


def _regathers(cfg: ModelConfig) -> bool:
    """Whether the dense projections gather their kernels again in the backward (`_adapted_matmul`): in the layer scan
    without remat. Under remat the recomputation gathers them already, and the DOTS policy sees no dot inside a
    custom VJP: it would recompute the projections it exists to keep (W-plan 7B update: 21% more matmul FLOPs)."""
    return cfg.scan_layers and cfg.remat is RematPolicy.NONE


def _adapted_matmul(module: nnx.Module, name: str, x: Float[Array, "n i"], dtype, sharding: ActivationSharding | None,
                    dropout_key: Array | None = None) -> Array:
    """x W for x [n, i] and `module.name`'s kernel W (its leading dims hold the i inputs) cast to the compute `dtype`,
    plus s (x A) B when `name` is adapted (its input under LoRA dropout when the layer's `dropout_key` is given).

    Under an activation sharding W is gathered whole over its embedding dim's data-like axes
    (`ActivationSharding.gathered_weight`). In the layer scan without remat (`module.regather`, `_regathers`) the
    backward gathers it again from the shard (`gathered_matmul`) rather than keeping the gathered copy as a stacked
    residual. Unrolled layers keep the autodiff of one gather: there XLA:CPU's scheduler hoists every gather to the
    program's start, so a second gather in the backward doubles what stays live (tried: the per-layer growth of the
    temporaries went from one layer's weights to two)."""
    variable = getattr(module, name)
    w, logical = variable.get_value(), tuple(variable.get_metadata()["logical_axes"])
    if sharding is not None and module.regather:
        y = gathered_matmul(x, w, dtype, sharding, logical, name)
    else:
        kernel = w.astype(dtype) if sharding is None else sharding.gathered_weight(w.astype(dtype), logical, name=name)
        y = x @ kernel.reshape(x.shape[-1], -1)
    adapter = getattr(module, f"{name}_lora", None)
    if adapter is None:
        return y
    key = None if dropout_key is None else target_key(dropout_key, LoRATarget(name.removesuffix("_proj")))
    return y + adapter(x, dtype, key)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        d, h, k, e, pdt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_param_dtype
        self.q_proj = _param(rngs, (d, h, e), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pdt, d)
        self.k_proj = _param(rngs, (d, k, e), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pdt, d)
        self.v_proj = _param(rngs, (d, k, e), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pdt, d)
        self.o_proj = _param(rngs, (h, e, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pdt, h * e)
        self.regather = _regathers(cfg)
        in_dims = {LoRATarget.Q: 1, LoRATarget.K: 1, LoRATarget.V: 1, LoRATarget.O: 2}
        _add_adapters(self, ATTENTION_TARGETS, lora, in_dims, rngs)
        if cfg.attention_bias:
            self.q_bias = _zeros((h, e), (axes.HEADS, axes.HEAD_DIM), pdt)
            self.k_bias = _zeros((k, e), (axes.KV_HEADS, axes.HEAD_DIM), pdt)
            self.v_bias = _zeros((k, e), (axes.KV_HEADS, axes.HEAD_DIM), pdt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(e, cfg.rms_norm_eps, pdt, axes.HEAD_DIM)
            self.k_norm = RMSNorm(e, cfg.rms_norm_eps, pdt, axes.HEAD_DIM)
        self.cfg = cfg

    def _project(self, x, name: str, bias_name: str, norm_name: str | None, rope, dropout_key: Array | None,
                 sharding: ActivationSharding | None):
        dt = self.cfg.jnp_dtype
        # 2-D matmuls: XLA's CPU backend runs [b*t, d] @ [d, h*e] several times faster than a batched einsum
        b, t, d = x.shape
        out_shape = getattr(self, name).get_value().shape[1:]
        y = _adapted_matmul(self, name, x.reshape(b * t, d), dt, sharding, dropout_key).reshape(b, t, *out_shape)
        if self.cfg.attention_bias:
            y = y + getattr(self, bias_name).get_value().astype(dt)
        if self.cfg.qk_norm and norm_name is not None:
            y = getattr(self, norm_name)(y)
        return y if rope is None else apply_rope(y, rope)

    def __call__(
        self,
        x: Float[Array, "b t d"],
        rope: tuple[Array, Array],  # rope_tables(positions, ...)
        key_mask: Bool[Array, "b t"] | None,
        layer_cache: tuple[Array, Array] | None,  # this layer's cache k [b k e T], v [b k T e]
        cache_offsets: Int[Array, " b"] | None,
        sharding: ActivationSharding | None,
        dropout_key: Array | None = None,  # this layer's LoRA dropout key (training forward only)
        segment_ids: Int[Array, "b t"] | None = None,  # packed rows' sequences (full-sequence forward only)
    ) -> tuple[Float[Array, "b t d"], tuple[Array, Array] | None]:
        cfg = self.cfg
        q = self._project(x, "q_proj", "q_bias", "q_norm", rope, dropout_key, sharding)
        k = self._project(x, "k_proj", "k_bias", "k_norm", rope, dropout_key, sharding)
        v = self._project(x, "v_proj", "v_bias", None, None, dropout_key, sharding)
        q = constrain(q, sharding, (axes.BATCH, axes.SEQ, axes.HEADS, None))
        if layer_cache is None:
            k = constrain(k, sharding, (axes.BATCH, axes.SEQ, axes.KV_HEADS, None))
            v = constrain(v, sharding, (axes.BATCH, axes.SEQ, axes.KV_HEADS, None))
            if sharding is not None and sharding.shards(axes.SEQ) > 1:  # context parallelism: rows in balanced order
                out = context_attention(q, k, v, key_mask, sharding, block_size=cfg.attention_block_size,
                                        segment_ids=segment_ids)
            else:
                out = attend(cfg.attention, cfg.attention_block_size, q, k, v, key_mask, segment_ids)
            return self._output(out, sharding, dropout_key), None
        if not isinstance(layer_cache, tuple):  # a cache with its own layout (paged) writes and attends itself
            out, layer_cache = layer_cache.write_and_attend(q, k, v, cache_offsets, key_mask, sharding)
            return self._output(out, sharding), layer_cache
        # writing only the new tokens into this layer's arrays (a scatter XLA does in place; XLA:CPU excepted
        # for a bf16 cache, which it scatters through a float32 copy: docs/benchmarks.md) avoids copying the
        # cache at every decode step. Advanced indices (rows, columns) split by slices put their [b t] dims
        # first: both writes address a [b t k e] block, the layout of the new k and v.
        cache_k, cache_v = layer_cache
        b, t = x.shape[:2]
        rows = jnp.arange(b)[:, None]
        columns = cache_offsets[:, None] + jnp.arange(t)[None, :]  # b t: cache index of each new token
        cache_k = cache_k.at[rows, :, :, columns].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[rows, :, columns].set(v.astype(cache_v.dtype), mode="drop")
        out = _cached_attention(q, cache_k, cache_v, columns)
        return self._output(out, sharding), (cache_k, cache_v)

    def _output(self, out: Float[Array, "b t h e"], sharding: ActivationSharding | None,
                dropout_key: Array | None = None) -> Float[Array, "b t d"]:
        b, t = out.shape[:2]
        flat = out.reshape(b * t, -1)
        return _adapted_matmul(self, "o_proj", flat, self.cfg.jnp_dtype, sharding, dropout_key).reshape(b, t, -1)


def _cached_attention(
    q: Float[Array, "b t h e"],
    keys: Float[Array, "b k e s"],
    values: Float[Array, "b k s e"],
    query_index: Int[Array, "b t"],
) -> Float[Array, "b t h e"]:
    """softmax(q k^T / sqrt(e)) v over cache slots s <= each query's own cache index, in float32.

    One new token per row (decode) is a multiply-and-sum XLA fuses into one pass over the cache, with no
    transposed copy of it: over the position-innermost keys it adds rows of positions, over the values it
    adds rows of head dims; longer blocks (prefill) use batched matmuls.
    """
    b, t, h, e = q.shape
    kv, s = keys.shape[1], keys.shape[3]
    g = h // kv
    valid = jnp.arange(s)[None, None, :] <= query_index[:, :, None]  # b t s
    if t == 1:
        qg = q.reshape(b, kv, g, e, 1).astype(jnp.float32)
        scores = jnp.sum(qg * keys[:, :, None].astype(jnp.float32), axis=3) / math.sqrt(e)  # b k g s
        scores = jnp.where(valid[:, :, None, :], scores, _NEG_INF)  # valid b 1 s -> b 1 1 s
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.sum(probs[..., None] * values[:, :, None].astype(jnp.float32), axis=3)  # b k g e
        return out.reshape(b, 1, h, e).astype(q.dtype)
    qg = q.reshape(b, t, kv, g, e)
    scores = jnp.einsum("btkge,bkes->bkgts", qg, keys.astype(q.dtype)).astype(jnp.float32) / math.sqrt(e)
    scores = jnp.where(valid[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bkse->btkge", probs, values.astype(q.dtype)).reshape(q.shape)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        d, f, pdt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
        self.gate_proj = _param(rngs, (d, f), (axes.EMBED, axes.MLP), pdt, d)
        self.up_proj = _param(rngs, (d, f), (axes.EMBED, axes.MLP), pdt, d)
        self.down_proj = _param(rngs, (f, d), (axes.MLP, axes.EMBED), pdt, f)
        self.dtype = cfg.jnp_dtype
        self.regather = _regathers(cfg)
        _add_adapters(self, MLP_TARGETS, lora, dict.fromkeys(MLP_TARGETS, 1), rngs)

    def __call__(self, x: Float[Array, "b t d"], sharding: ActivationSharding | None,
                 dropout_key: Array | None = None) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        dt, key = self.dtype, dropout_key
        flat = x.reshape(b * t, d)  # 2-D matmuls are much faster than batched ones on XLA's CPU backend
        gate = _adapted_matmul(self, "gate_proj", flat, dt, sharding, key)
        up = _adapted_matmul(self, "up_proj", flat, dt, sharding, key)
        hidden = constrain(swiglu(gate, up).reshape(b, t, -1), sharding, (axes.BATCH, axes.SEQ, axes.MLP))
        return _adapted_matmul(self, "down_proj", hidden.reshape(b * t, -1), dt, sharding, key).reshape(b, t, d)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None, sparse: bool = False):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.attention = Attention(cfg, rngs=rngs, lora=lora)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        if sparse:
            shared = cfg.shared_expert_intermediate_size
            shared_expert = MLP(cfg.replace(intermediate_size=shared), rngs=rngs, lora=lora) if shared else None
            self.mlp = SparseMoE(cfg, rngs=rngs, shared_expert=shared_expert)
        else:
            self.mlp = MLP(cfg, rngs=rngs, lora=lora)

    def __call__(self, x, rope, key_mask, layer_cache, cache_offsets, sharding, dropout_key=None, expert_ids=None,
                 segment_ids=None):
        """(output, written cache layer, `Routing` of a sparse layer or None); `expert_ids` [b t k]: replay;
        `segment_ids` [b t]: packed rows."""
        # under sequence parallelism: all-gather before the projections, reduce-scatter after them (GSPMD inserts both)
        normed = constrain(self.input_norm(x), sharding, GATHERED)
        attended, new_cache = self.attention(normed, rope, key_mask, layer_cache, cache_offsets, sharding,
                                             dropout_key, segment_ids)
        x = x + constrain(attended, sharding, RESIDUAL)
        normed = constrain(self.post_attention_norm(x), sharding, GATHERED)
        routing = None
        if isinstance(self.mlp, SparseMoE):
            mixed, routing = self.mlp(normed, sharding, expert_ids, key_mask)
        else:
            mixed = self.mlp(normed, sharding, dropout_key)
        x = x + constrain(mixed, sharding, RESIDUAL)
        return constrain(x, sharding, RESIDUAL), new_cache, routing


class Decoder(nnx.Module):
    """The language model; with `cfg.value_head` it also carries a scalar value head on the final hidden state,
    with `lora` low-rank adapters on the projections (`rpegjax.models.lora`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        pdt = cfg.jnp_param_dtype
        self.cfg = cfg
        self.lora = lora
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * 0.02).astype(pdt),
            logical_axes=(axes.VOCAB, axes.EMBED),
        )
        if lora is not None and cfg.num_experts and set(lora.targets) & set(MLP_TARGETS):
            raise ValueError(f"LoRA targets {[t.value for t in lora.targets if t in MLP_TARGETS]} are MLP projections; "
                             "a mixture-of-experts model takes adapters on attention only (targets q, k, v, o)")
        self.layers = nnx.List([Block(cfg, rngs=rngs, lora=lora, sparse=cfg.is_sparse_layer(i))
                                for i in range(cfg.num_layers)])
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
        dropout_key: Array | None = None,
        segment_ids: Int[Array, "b t"] | None = None,
    ) -> tuple[Float[Array, "b t d"], KVCache | None]:
        """Final-norm hidden states.

        Without a cache, `mask` marks real (non-padding) tokens: keys at padding are never attended to.
        With a cache, the t tokens are written at each row's `cache.lengths` and the returned cache
        has `lengths + mask.sum(-1)` (all t when `mask` is None).

        `dropout_key`: the training forward's key for LoRA dropout (`rpegjax.models.lora`); layer l draws its
        masks from fold_in(dropout_key, l), scanned or not. Ignored by a model without adapter dropout.

        `segment_ids`: packed rows (full sequence only): a token attends only to earlier tokens of its own segment
        (`rpegjax.models.attention`); the caller gives positions restarting per segment (`packed_positions`).

        With `sharding` that splits `axes.SEQ` (a context axis), the layers run on the rows permuted into the
        load-balanced order (`rpegjax.models.context_attention`); the hidden states come back in row order, split
        on the sequence.
        """
        hidden, new_cache, _ = self.routed_hidden_states(tokens, positions, mask=mask, cache=cache, sharding=sharding,
                                                         dropout_key=dropout_key, segment_ids=segment_ids)
        return hidden, new_cache

    def routed_hidden_states(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        *,
        mask: Bool[Array, "b t"] | None = None,
        cache: KVCache | None = None,
        sharding: ActivationSharding | None = None,
        dropout_key: Array | None = None,
        expert_ids: Int[Array, "b t s k"] | None = None,
        segment_ids: Int[Array, "b t"] | None = None,
    ) -> tuple[Float[Array, "b t d"], KVCache | None, Routing | None]:
        """`hidden_states` and the routing of the s sparse layers (in layer order) stacked on axis 2: `Routing`
        with expert_ids [b t s k] and router_logits [b t s x]; None for a dense model. Given `expert_ids`
        [b t s k] (a recorded routing), every token uses those experts instead of its router's top k (replay)."""
        if dropout_key is not None and cache is not None:
            raise ValueError("Decoder.hidden_states: LoRA dropout (dropout_key) is for the training forward, "
                             "not a cached (generation) forward")
        if segment_ids is not None and cache is not None:
            raise ValueError("Decoder.hidden_states: packed rows (segment_ids) are for the full-sequence forward, "
                             "not a cached (generation) forward")
        if self.lora is None or self.lora.dropout == 0:
            dropout_key = None
        sparse = self.cfg.sparse_layers
        if expert_ids is not None and expert_ids.shape[2:] != (len(sparse), self.cfg.num_experts_per_token):
            raise ValueError(f"Decoder.routed_hidden_states: expert_ids {expert_ids.shape} needs [b, t, "
                             f"{len(sparse)} sparse layers, {self.cfg.num_experts_per_token} experts per token]")
        context = 1 if sharding is None or cache is not None else sharding.shards(axes.SEQ)
        if context > 1:  # context parallelism: the layers run on the rows in the load-balanced order
            if dropout_key is not None:
                raise ValueError("Decoder.hidden_states: LoRA dropout draws its masks in row order, which context "
                                 "parallelism does not keep; train with lora dropout 0 or without a context axis")
            if sparse:
                raise ValueError("Decoder.hidden_states: a mixture-of-experts model does not run with a context axis yet "
                                 "(its routing would come back in the load-balanced order)")
            tokens, positions = to_balanced(tokens, context), to_balanced(positions, context)
            mask = None if mask is None else to_balanced(mask, context)
            segment_ids = None if segment_ids is None else to_balanced(segment_ids, context)
        x = self.embed.get_value()[tokens].astype(self.cfg.jnp_dtype)
        x = constrain(x, sharding, RESIDUAL)
        # computed at trace time from the config: a constant, not a parameter
        rope = rope_tables(positions, rope_inverse_frequencies(self.cfg))
        if cache is None and self.cfg.scan_layers:
            hidden, routing = _scan_layers(self.layers, x, rope, mask, self.cfg.remat, sharding, dropout_key,
                                           expert_ids, segment_ids, compute_dtype=self.cfg.jnp_dtype)
            return _row_order(self.final_norm(hidden), context, sharding), None, routing
        full_sequence = _remat_layer(self.cfg.remat, sharding) if cache is None else None
        written, routings = [], []
        for index, layer in enumerate(self.layers):
            ids = None if expert_ids is None or index not in sparse else expert_ids[:, :, sparse.index(index)]
            if full_sequence is not None:
                layer_key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
                x, routing = full_sequence(layer, x, rope, mask, layer_key, ids, segment_ids)
            else:
                x, new_layer, routing = layer(x, rope, mask, cache.layer(index), cache.lengths, sharding, None, ids)
                written.append(new_layer)
            routings.append(routing)
        new_cache = None
        if cache is not None:
            added = tokens.shape[1] if mask is None else mask.sum(axis=-1).astype(jnp.int32)
            new_cache = cache.with_layers(written, added)
        routed = [routing for routing in routings if routing is not None]
        stacked = jax.tree.map(lambda *r: jnp.stack(r, axis=2), *routed) if routed else None
        return _row_order(self.final_norm(x), context, sharding), new_cache, stacked

    def with_execution(self, **changes: Any) -> Decoder:
        """This model's parameters under a config whose execution fields (`MODEL_EXECUTION_FIELDS`: attention kernel,
        remat, layer scan) or MoE capacity factor are changed (none changes the parameters); e.g. for a checkpoint
        loaded with the defaults."""
        allowed = (*MODEL_EXECUTION_FIELDS, "moe_capacity_factor")
        unknown = sorted(set(changes) - set(allowed))
        if unknown:
            raise ValueError(f"Decoder.with_execution changes only {list(allowed)}, got {unknown}")
        cfg = self.cfg.replace(**changes)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), lora=self.lora)))
        return nnx.merge(graphdef, nnx.state(self))

    def with_lora(self, lora: LoRAConfig, *, seed: int) -> Decoder:
        """This model's (base) parameters, shared not copied, plus fresh adapters of `lora` drawn from `seed`
        (B = 0: the same function as before)."""
        if self.lora is not None:
            raise ValueError(f"Decoder.with_lora: this model already carries adapters ({self.lora})")
        cfg = self.cfg
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), lora=lora)))
        # only the adapters leave the jitted build: XLA drops the unused initialisation of the base weights
        adapters = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed), lora=lora), LoRAParam))()
        return nnx.merge(graphdef, nnx.state(self), adapters)

    def without_lora(self) -> Decoder:
        """The base model: these parameters with the adapters dropped (shares the base weights' buffers)."""
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(self.cfg, rngs=nnx.Rngs(0))))
        return nnx.merge(graphdef, split_adapters(nnx.state(self))[1])

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


def _row_order(hidden: Float[Array, "b t d"], context: int, sharding: ActivationSharding | None) -> Float[Array, "b t d"]:
    """The final hidden states back in row order after context parallelism (`context` > 1), still split on the
    sequence; unchanged otherwise."""
    if context == 1:
        return hidden
    return constrain(from_balanced(hidden, context), sharding, GATHERED)


# What a rematerialised layer saves: DOTS keeps the 2-D projection and MLP matmuls' outputs (not attention's
# batched [t, t] products, which would undo the point of blockwise attention); FULL keeps only the layer input.
_REMAT_POLICIES = {
    RematPolicy.DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    RematPolicy.FULL: jax.checkpoint_policies.nothing_saveable,
}


def _remat_layer(policy: RematPolicy, sharding: ActivationSharding | None):
    """`apply(layer, x, rope, mask, dropout_key, expert_ids, segment_ids) -> (x, routing)` of one full-sequence layer,
    rematerialised unless policy is NONE (the recomputation redraws the same dropout masks: the key is an input).

    `jax.checkpoint` of a pure function of the layer's state, not `nnx.remat`: the latter writes the state back into
    the layer's variables, which fails when they come from different traces (a LoRA model's adapters traced by the
    gradient, its frozen base by the enclosing jit)."""

    def apply(layer: Block, x, rope, mask, dropout_key, expert_ids=None, segment_ids=None):
        out, _, routing = layer(x, rope, mask, None, None, sharding, dropout_key, expert_ids, segment_ids)
        return out, routing

    if policy is RematPolicy.NONE:
        return apply

    def rematerialised(layer: Block, x, rope, mask, dropout_key, expert_ids=None, segment_ids=None):
        graphdef, state = nnx.split(layer)

        def pure(state, x, rope, mask, dropout_key, expert_ids, segment_ids):
            return apply(nnx.merge(graphdef, state), x, rope, mask, dropout_key, expert_ids, segment_ids)

        return jax.checkpoint(pure, policy=_REMAT_POLICIES[policy])(state, x, rope, mask, dropout_key, expert_ids,
                                                                    segment_ids)

    return rematerialised


def _scan_layers(layers: nnx.List, x, rope, mask, policy: RematPolicy, sharding: ActivationSharding | None,
                 dropout_key: Array | None = None, expert_ids: Array | None = None,
                 segment_ids: Array | None = None, *, compute_dtype=None) -> tuple[Array, Routing | None]:
    """The full-sequence layer stack as one `lax.scan` over the layers' parameters stacked at trace time.

    One compiled layer body, whatever the depth; and under remat the recomputation lives inside the backward
    loop's iterations, where no scheduler can hoist it next to the forward (with unrolled layers XLA's CPU
    scheduler does, keeping every layer's activations alive). Parameters stay per layer in the model, so
    checkpoints and the Hugging Face layout are unchanged; the stacking costs one copy of the layer weights, made
    of the dense projections' kernels in `compute_dtype` (`_compute_kernels`). Under full remat a dense stack without
    adapters runs through `remat_scan` instead: its forward loop reads each layer's own parameters (no copy) and
    only its backward loop stacks them, in a buffer that also takes their gradients.
    With `dropout_key`, layer l's LoRA dropout key is fold_in(dropout_key, l), as in the unrolled stack.
    Returns the output and (for sparse layers) their routing stacked as `Decoder.routed_hidden_states` gives it;
    `expert_ids` [b t l k] replays one routing per layer.
    """
    graphdef = nnx.graphdef(layers[0])
    if policy is RematPolicy.FULL and _dense_without_adapters(layers):
        cast = functools.partial(_compute_kernels, dtype=compute_dtype, dense_mlp=True)
        states = [nnx.state(layer) for layer in layers]
        return _remat_scan_layers(graphdef, cast, states, x, rope, mask, sharding, segment_ids), None
    stacked = jax.tree.map(lambda *values: jnp.stack(values),
                           *(_compute_kernels(nnx.state(layer), compute_dtype, isinstance(layer.mlp, MLP))
                             for layer in layers))

    def body(x, layer):
        state, index, ids = layer
        layer_key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        out, _, routing = nnx.merge(graphdef, state)(x, rope, mask, None, None, sharding, layer_key, ids, segment_ids)
        return out, routing

    if policy is not RematPolicy.NONE:
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[policy])
    indices = None if dropout_key is None else jnp.arange(len(layers), dtype=jnp.uint32)
    per_layer_ids = None if expert_ids is None else jnp.moveaxis(expert_ids, 2, 0)
    out, routing = jax.lax.scan(body, x, (stacked, indices, per_layer_ids))
    return out, jax.tree.map(lambda r: jnp.moveaxis(r, 0, 2), routing)


def _dense_without_adapters(layers: nnx.List) -> bool:
    """Whether no layer routes to experts or carries LoRA adapters: `remat_scan`'s backward computes every stacked
    parameter's gradient (a LoRA model's frozen base needs none) and returns no routing."""
    return not any(isinstance(layer.mlp, SparseMoE) or any(isinstance(v, LoRAParam) for _, v in
                                                          nnx.to_flat_state(nnx.state(layer))) for layer in layers)


def _remat_scan_layers(graphdef: nnx.GraphDef, cast: Callable[[nnx.State], nnx.State], states: list[nnx.State],
                       x, rope, mask, sharding: ActivationSharding | None, segment_ids: Array | None) -> Array:
    """The dense stack under full remat through `rpegjax.models.layer_scan.remat_scan` (`cast(states[l])`: layer l's
    parameters as the scan reads them; only its backward stacks them, in a buffer that also takes their
    gradients). No dropout key: only LoRA adapters draw one."""

    def layer(x, state, _, shared):
        rope, mask, segment_ids = shared
        out, _, _ = nnx.merge(graphdef, state)(x, rope, mask, None, None, sharding, None, None, segment_ids)
        return out

    return remat_scan(layer, cast, x, states, None, (rope, mask, segment_ids), runs=remat_runs(len(states)))


# The dense layers' projection kernels, which every use casts to the compute dtype first (`_kernel`)
_PROJECTIONS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _compute_kernels(state: nnx.State, dtype, dense_mlp: bool) -> nnx.State:
    """A layer's `state` with its dense projection kernels (the MLP's if `dense_mlp`, not experts) cast to the compute
    `dtype` (None: unchanged), before the scan stacks them: the layer body casts them to that dtype anyway, so the
    values and the gradients (the body's cotangents are in that dtype, cast back to the parameters' once, after the
    scan) are the same, and the stacked copy and its stacked gradient take half the bytes of float32 masters (7B:
    1.6 GiB each per device at fsdp8; docs/benchmarks.md, "W-long"). Norm scales, biases, adapters and
    experts stay as they are."""
    if dtype is None:
        return state
    cast = {(module, name) for module, names in _PROJECTIONS.items() for name in names
            if module != "mlp" or dense_mlp}

    def convert(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        return leaf.astype(dtype) if keys[:2] in cast and jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree_util.tree_map_with_path(convert, state)


def default_positions(tokens: Int[Array, "b t"], mask: Bool[Array, "b t"] | None) -> Int[Array, "b t"]:
    """RoPE positions: 0, 1, ... over real tokens (padding gets the position of the next real token)."""
    if mask is None:
        return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def packed_positions(segment_ids: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """RoPE positions of packed rows: 0, 1, ... restarting at each segment (as each sequence alone would have them)."""
    return jnp.arange(segment_ids.shape[1])[None, :] - segment_starts(segment_ids)
