"""The full-attention layer kind: causal attention over every earlier token (Qwen2/2.5, Qwen3, Llama 3, Gemma 3's
global layers). Everything about the kind is here (docs/architecture.md, "Layer kinds"):

* parameters and Hugging Face names: q/k/v/o projections, optional q/k/v biases and q/k norms (`Attention`,
  `Attention.hf_tensors`);
* the training forward over whole (or packed) rows: `Attention.__call__` without a cache, through the kernels of
  `rpegjax.models.attention` (context parallelism: `rpegjax.models.context_attention`);
* the contiguous sampler's state and decode step: `AttentionCache`, keys [b k e t] and values [b k t e] of every
  position, written in place, attended by `cached_attention`;
* the paged sampler's state and decode step: `PagedAttention`, pools [r k p n e] of the "every position" page
  group, attended over gathered pages (`attend_pages`) or with the Pallas kernel (`rpegjax.models.paged_attention`).

Cache layout: row b holds its tokens at cache indices 0 .. lengths[b]-1, RoPE position = cache index. New tokens are
written at `lengths[b]` onwards; a query at cache index i attends to keys j <= i. Padding written past a row's valid
tokens is never attended to and is overwritten by the next write, so prompts can be right-padded in a prefill.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.attention import attend
from rpegjax.models.config import ModelConfig
from rpegjax.models.context_attention import context_attention
from rpegjax.models.kinds import PageGroup, StateArray
from rpegjax.models.lora import ATTENTION_TARGETS, LoRAConfig, LoRATarget
from rpegjax.models.norm import RMSNorm
from rpegjax.models.pages import PageView, per_replica
from rpegjax.models.paged_attention import paged_decode_attention
from rpegjax.models.projections import adapted_matmul, add_adapters, param, regathers, zeros
from rpegjax.models.rope import Rope, apply_rope
from rpegjax.models.hf_maps import TensorLayout, bias, in_projection, out_projection, tensor_layout
from rpegjax.options import DecodeAttention
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain

NEG_INF = -1e30

# A pool's replicas split like the slots (the batch axes), its KV heads over tensor.
POOL_AXES = (axes.BATCH, axes.KV_HEADS, None, None, axes.HEAD_DIM)


class Attention(nnx.Module):
    """q/k/v/o projections with grouped-query heads; the kind's class methods declare what it keeps for generation,
    its RoPE setting and its Hugging Face tensors."""

    def __init__(self, cfg: ModelConfig, index: int = 0, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        d, h, k, e, pdt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_param_dtype
        self.q_proj = param(rngs, (d, h, e), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pdt, d)
        self.k_proj = param(rngs, (d, k, e), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pdt, d)
        self.v_proj = param(rngs, (d, k, e), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pdt, d)
        self.o_proj = param(rngs, (h, e, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pdt, h * e)
        self.regather = regathers(cfg)
        in_dims = {LoRATarget.Q: 1, LoRATarget.K: 1, LoRATarget.V: 1, LoRATarget.O: 2}
        add_adapters(self, ATTENTION_TARGETS, lora, in_dims, rngs)
        if cfg.attention_bias:
            self.q_bias = zeros((h, e), (axes.HEADS, axes.HEAD_DIM), pdt)
            self.k_bias = zeros((k, e), (axes.KV_HEADS, axes.HEAD_DIM), pdt)
            self.v_bias = zeros((k, e), (axes.KV_HEADS, axes.HEAD_DIM), pdt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(e, cfg.rms_norm_eps, pdt, axes.HEAD_DIM)
            self.k_norm = RMSNorm(e, cfg.rms_norm_eps, pdt, axes.HEAD_DIM)
        self.cfg = cfg

    # ---- what the kind declares ------------------------------------------------------------------------------
    @classmethod
    def rope(cls, cfg: ModelConfig, index: int) -> Rope | None:
        """The RoPE setting of layer `index` (layers that share one share its tables)."""
        return cfg.rope()

    @classmethod
    def contiguous_state(cls, cfg: ModelConfig, index: int, *, batch: int, capacity: int, dtype) -> AttentionCache:
        """Layer `index`'s empty state in the contiguous cache: `capacity` positions per row."""
        kv, e = cfg.num_kv_heads, cfg.head_dim
        return AttentionCache(k=jnp.zeros((batch, kv, e, capacity), dtype),
                              v=jnp.zeros((batch, kv, capacity, e), dtype))

    @classmethod
    def page_group(cls, cfg: ModelConfig, index: int) -> PageGroup | None:
        """The positions the layer keeps pages for (None: no pages, only per-row state)."""
        return PageGroup()

    @classmethod
    def paged_state(cls, cfg: ModelConfig, index: int, *, num_slots: int, replicas: int, pages: int,
                    page_size: int) -> PagedAttention:
        """Layer `index`'s empty state in the paged cache: pools of `pages` pages per replica (its page group's)."""
        shape = (replicas, cfg.num_kv_heads, pages, page_size, cfg.head_dim)
        return PagedAttention(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype))

    @classmethod
    def hf_tensors(cls, cfg: ModelConfig, index: int) -> list[TensorLayout]:
        """The layer's HF tensors (`model.layers.N.self_attn.*`) and how each maps onto ours:

            q_proj.weight [h*e, d] -> q_proj [d, h, e];  {k,v}_proj.weight [k*e, d] -> {k,v}_proj [d, k, e]
            o_proj.weight [d, h*e] -> o_proj [h, e, d];  {q,k,v}_proj.bias [n*e] -> {q,k,v}_bias [n, e]
            {q,k}_norm.weight [e] -> {q,k}_norm.scale [e]
        """
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hf, ours = f"model.layers.{index}.self_attn.", ("layers", index, "attention")
        out = []
        for proj, heads in (("q", h), ("k", k), ("v", k)):
            out.append(tensor_layout(f"{hf}{proj}_proj.weight", (*ours, f"{proj}_proj"), (heads * e, d),
                              in_projection(d, heads, e)))
            if cfg.attention_bias:
                out.append(tensor_layout(f"{hf}{proj}_proj.bias", (*ours, f"{proj}_bias"), (heads * e,),
                                         bias(heads, e)))
        out.append(tensor_layout(f"{hf}o_proj.weight", (*ours, "o_proj"), (d, h * e), out_projection(h, e, d)))
        if cfg.qk_norm:
            out.append(tensor_layout(f"{hf}q_norm.weight", (*ours, "q_norm", "scale"), (e,)))
            out.append(tensor_layout(f"{hf}k_norm.weight", (*ours, "k_norm", "scale"), (e,)))
        return out

    # ---- the forward -----------------------------------------------------------------------------------------
    def _project(self, x, name: str, bias_name: str, norm_name: str | None, rope, dropout_key: Array | None,
                 sharding: ActivationSharding | None):
        dt = self.cfg.jnp_dtype
        # 2-D matmuls: XLA's CPU backend runs [b*t, d] @ [d, h*e] several times faster than a batched einsum
        b, t, d = x.shape
        out_shape = getattr(self, name).get_value().shape[1:]
        y = adapted_matmul(self, name, x.reshape(b * t, d), dt, sharding, dropout_key).reshape(b, t, *out_shape)
        if self.cfg.attention_bias:
            y = y + getattr(self, bias_name).get_value().astype(dt)
        if self.cfg.qk_norm and norm_name is not None:
            y = getattr(self, norm_name)(y)
        return y if rope is None else apply_rope(y, rope)

    def _attend_sequence(self, q, k, v, key_mask, sharding: ActivationSharding | None, segment_ids):
        """The training forward's attention over whole rows (packed rows: `segment_ids`)."""
        cfg = self.cfg
        if sharding is not None and sharding.shards(axes.SEQ) > 1:  # context parallelism: rows in balanced order
            return context_attention(q, k, v, key_mask, sharding, block_size=cfg.attention_block_size,
                                     segment_ids=segment_ids)
        return attend(cfg.attention, cfg.attention_block_size, q, k, v, key_mask, segment_ids)

    def __call__(
        self,
        x: Float[Array, "b t d"],
        rope: tuple[Array, Array],  # the tables of this layer's RoPE setting
        key_mask: Bool[Array, "b t"] | None,
        layer_cache,  # None (training forward), or this layer's state: an `AttentionCache` or a bound `PagedAttention`
        cache_offsets: Int[Array, " b"] | None,
        sharding: ActivationSharding | None,
        dropout_key: Array | None = None,  # this layer's LoRA dropout key (training forward only)
        segment_ids: Int[Array, "b t"] | None = None,  # packed rows' sequences (full-sequence forward only)
    ):
        """(output [b t d], the layer's state after writing the t new tokens; None without a cache)."""
        q = self._project(x, "q_proj", "q_bias", "q_norm", rope, dropout_key, sharding)
        k = self._project(x, "k_proj", "k_bias", "k_norm", rope, dropout_key, sharding)
        v = self._project(x, "v_proj", "v_bias", None, None, dropout_key, sharding)
        q = constrain(q, sharding, (axes.BATCH, axes.SEQ, axes.HEADS, None))
        if layer_cache is None:
            k = constrain(k, sharding, (axes.BATCH, axes.SEQ, axes.KV_HEADS, None))
            v = constrain(v, sharding, (axes.BATCH, axes.SEQ, axes.KV_HEADS, None))
            out = self._attend_sequence(q, k, v, key_mask, sharding, segment_ids)
            return self._output(out, sharding, dropout_key), None
        out, layer_cache = layer_cache.write_and_attend(q, k, v, cache_offsets, key_mask, sharding)
        return self._output(out, sharding), layer_cache

    def _output(self, out: Float[Array, "b t h e"], sharding: ActivationSharding | None,
                dropout_key: Array | None = None) -> Float[Array, "b t d"]:
        b, t = out.shape[:2]
        flat = out.reshape(b * t, -1)
        return adapted_matmul(self, "o_proj", flat, self.cfg.jnp_dtype, sharding, dropout_key).reshape(b, t, -1)


# ---- the contiguous sampler ---------------------------------------------------------------------------------
@flax.struct.dataclass
class AttentionCache:
    """Keys and values of one layer for b rows of t positions.

    Keys are [b, k, e, t] (row, KV head, head dim, cache index), values [b, k, t, e]: keys are stored
    position-innermost so that one token's scores, a sum over the head dim, add whole rows of positions instead of
    reducing along the innermost axis (XLA:CPU's decode attention 2.9x faster at 128 positions: docs/benchmarks.md,
    "W-gen"); values stay head-dim-innermost, which is what the probability-weighted sum over positions wants. Each
    layer has arrays of its own, which a decode step reads and writes in place (slicing one layer out of a stacked
    [l, ...] array would copy it at every step).
    """

    k: Float[Array, "b k e t"]
    v: Float[Array, "b k t e"]

    ARRAYS = {"k": StateArray((axes.BATCH, axes.KV_HEADS, axes.HEAD_DIM, axes.CACHE_SEQ), positions=3),
              "v": StateArray((axes.BATCH, axes.KV_HEADS, axes.CACHE_SEQ, axes.HEAD_DIM), positions=2)}

    def write_and_attend(self, q: Float[Array, "b t h e"], k: Float[Array, "b t k e"], v: Float[Array, "b t k e"],
                         offsets: Int[Array, " b"], key_mask: Bool[Array, "b t"] | None,
                         sharding: ActivationSharding | None) -> tuple[Float[Array, "b t h e"], AttentionCache]:
        """Writes the t new tokens of each row at cache indices offsets .. offsets+t-1, then attends over the cache.

        Writing only the new tokens into this layer's arrays (a scatter XLA does in place; XLA:CPU excepted for a
        bf16 cache, which it scatters through a float32 copy: docs/benchmarks.md) avoids copying the cache at every
        decode step. Advanced indices (rows, columns) split by slices put their [b t] dims first: both writes
        address a [b t k e] block, the layout of the new k and v."""
        b, t = q.shape[:2]
        rows = jnp.arange(b)[:, None]
        columns = offsets[:, None] + jnp.arange(t)[None, :]  # b t: cache index of each new token
        cache_k = self.k.at[rows, :, :, columns].set(k.astype(self.k.dtype), mode="drop")
        cache_v = self.v.at[rows, :, columns].set(v.astype(self.v.dtype), mode="drop")
        out = cached_attention(q, cache_k, cache_v, columns)
        return out, AttentionCache(k=cache_k, v=cache_v)


def cached_attention(
    q: Float[Array, "b t h e"],
    keys: Float[Array, "b k e s"],
    values: Float[Array, "b k s e"],
    query_index: Int[Array, "b t"],
    valid: Bool[Array, "b t s"] | None = None,
) -> Float[Array, "b t h e"]:
    """softmax(q k^T / sqrt(e)) v over cache slots s <= each query's own cache index (or, given, where `valid`), in
    float32.

    One new token per row (decode) is a multiply-and-sum XLA fuses into one pass over the cache, with no
    transposed copy of it: over the position-innermost keys it adds rows of positions, over the values it
    adds rows of head dims; longer blocks (prefill) use batched matmuls.
    """
    b, t, h, e = q.shape
    kv, s = keys.shape[1], keys.shape[3]
    g = h // kv
    if valid is None:
        valid = jnp.arange(s)[None, None, :] <= query_index[:, :, None]  # b t s
    if t == 1:
        qg = q.reshape(b, kv, g, e, 1).astype(jnp.float32)
        scores = jnp.sum(qg * keys[:, :, None].astype(jnp.float32), axis=3) / math.sqrt(e)  # b k g s
        scores = jnp.where(valid[:, :, None, :], scores, NEG_INF)  # valid b 1 s -> b 1 1 s
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.sum(probs[..., None] * values[:, :, None].astype(jnp.float32), axis=3)  # b k g e
        return out.reshape(b, 1, h, e).astype(q.dtype)
    qg = q.reshape(b, t, kv, g, e)
    scores = jnp.einsum("btkge,bkes->bkgts", qg, keys.astype(q.dtype)).astype(jnp.float32) / math.sqrt(e)
    scores = jnp.where(valid[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bkse->btkge", probs, values.astype(q.dtype)).reshape(q.shape)


# ---- the paged sampler --------------------------------------------------------------------------------------
@flax.struct.dataclass
class PagedAttention:
    """One layer's key and value pools [r k p n e] (replica, KV head, page, offset in the page, head dim): a
    replica's pool [k p n e] is the layout the Pallas paged-attention kernel reads, so no step transposes it.
    `pages`: the page table and settings of the call, bound by the paged cache before the mixer runs (None while
    stored).

    Reading a row gathers the first `window_pages` columns of its page table (the cache index of a key = its table
    column * n + offset), then attends like the contiguous cache (a prefill on the pages transposed to that cache's
    layout, `cached_attention`; a decode step, one token per row, in the gathered layout [k b w n e],
    `attend_pages`), so both layouts give the same logits up to float rounding. Table entries past a row's pages hold
    page 0: what they read is masked out by position like any key past the row's length. With
    `DecodeAttention.PALLAS` a decode step instead runs the kernel over each row's whole table, which stops at the
    row's own length (`paged_attention.paged_decode_attention`): no window, and no work past a row's tokens.
    """

    k: Float[Array, "r k p n e"]
    v: Float[Array, "r k p n e"]
    pages: PageView | None = None

    ARRAYS = {"k": StateArray(POOL_AXES, pooled=True), "v": StateArray(POOL_AXES, pooled=True)}

    def write_and_attend(
        self,
        q: Float[Array, "b t h e"],
        k: Float[Array, "b t k e"],
        v: Float[Array, "b t k e"],
        offsets: Int[Array, " b"],
        key_mask: Bool[Array, "b t"] | None,
        sharding: ActivationSharding | None = None,
    ) -> tuple[Float[Array, "b t h e"], PagedAttention]:
        """Writes the t new tokens of each row at cache indices offsets .. offsets+t-1 (tokens whose
        `key_mask` is False are not written: padding, finished rows), then attends over the row's pages
        (`sharding`: the mesh the Pallas kernel's `shard_map` runs on)."""
        b, t = q.shape[:2]
        view = self.pages
        positions = offsets[:, None] + jnp.arange(t)[None, :]  # b t: cache index of each new token
        new_k, new_v = write_pages(self.k, self.v, view.table, positions, key_mask, k, v)
        written = self.replace(k=new_k, v=new_v)
        replicas = self.k.shape[0]
        split = lambda x: per_replica(x, replicas)  # noqa: E731
        if t == 1 and view.decode_attention is DecodeAttention.PALLAS:  # each row's own pages, its whole table
            spec = None if sharding is None else sharding.spec(POOL_AXES, new_k.shape, name="page pool")
            live = None if key_mask is None else key_mask[:, 0]  # finished rows and bucket padding read nothing
            out = paged_decode_attention(q, new_k, new_v, view.table, positions, live, sharding=sharding,
                                         pool_spec=spec, interpret=view.pallas_interpret)
            return out, written
        table = split(view.table[:, : view.window_pages])
        if t == 1:  # decode: attend over the pages as gathered, in the pool's layout (no transposed copy of them)
            def attend_replica(pool_k, pool_v, table, q, index):  # one replica: pools [k p n e], its rows' q, indices
                return attend_pages(q, pool_k[:, table], pool_v[:, table], index)

            out = jax.vmap(attend_replica)(new_k, new_v, table, split(q), split(positions))
            return out.reshape(q.shape), written
        keys, values = gather_contiguous(new_k, new_v, table, b)
        return cached_attention(q, keys, values, positions), written


def write_pages(pool_k: Float[Array, "r k p n e"], pool_v: Float[Array, "r k p n e"], table: Int[Array, "b m"],
                positions: Int[Array, "b t"], key_mask: Bool[Array, "b t"] | None, k: Float[Array, "b t k e"],
                v: Float[Array, "b t k e"]) -> tuple[Array, Array]:
    """The pools with the new tokens' keys and values written at their cache indices `positions` through `table`;
    tokens whose `key_mask` is False, or past the table, are not written."""
    replicas, _, num_pages, page_size, _ = pool_k.shape
    columns = table.shape[1]
    column = positions // page_size
    page = jnp.take_along_axis(table, jnp.minimum(column, columns - 1), axis=1)
    writes = column < columns if key_mask is None else key_mask & (column < columns)
    page = jnp.where(writes, page, num_pages)  # past the pool: the scatter drops the write
    within = positions % page_size

    def write(pool, page, within, new):  # pool [k p n e]; page, within [b/r t]; new [b/r t k e]
        return pool.at[:, page, within].set(new.transpose(2, 0, 1, 3).astype(pool.dtype), mode="drop")

    split = lambda x: per_replica(x, replicas)  # noqa: E731
    return (jax.vmap(write)(pool_k, split(page), split(within), split(k)),
            jax.vmap(write)(pool_v, split(page), split(within), split(v)))


def gather_contiguous(pool_k: Float[Array, "r k p n e"], pool_v: Float[Array, "r k p n e"],
                      table: Int[Array, "r c w"], rows: int) -> tuple[Float[Array, "b k e s"], Float[Array, "b k s e"]]:
    """The w pages of each row's `table` (per replica) transposed to the contiguous cache's layout: keys
    [b k e w*n], values [b k w*n e] (a prefill's attention reads them so)."""

    def gather_keys(pool, table):  # [b/r w] pages -> [b/r k e w*n]
        pages = pool[:, table].transpose(1, 0, 4, 2, 3)  # k b/r w n e -> b/r k e w n
        return pages.reshape(*pages.shape[:3], -1)

    def gather_values(pool, table):  # [b/r w] pages -> [b/r k w*n e]
        pages = pool[:, table].transpose(1, 0, 2, 3, 4)  # k b/r w n e -> b/r k w n e
        return pages.reshape(*pages.shape[:2], -1, pages.shape[-1])

    keys = jax.vmap(gather_keys)(pool_k, table)
    values = jax.vmap(gather_values)(pool_v, table)
    return tuple(x.reshape(rows, *x.shape[2:]) for x in (keys, values))


def attend_pages(q: Float[Array, "b 1 h e"], keys: Float[Array, "k b w n e"], values: Float[Array, "k b w n e"],
                 query_index: Int[Array, "b 1"], valid: Bool[Array, "b w n"] | None = None) -> Float[Array, "b 1 h e"]:
    """`cached_attention` of one new token per row over its w gathered pages of n tokens, key w' n + n' at page
    w', offset n' (masked past the query's cache index, or where `valid` is False): the same multiply-and-sum in
    float32, reduced over (w, n) in the pages' own layout (the pool's, KV head first), so XLA reads them straight
    from the gather instead of a [b k w*n e] transposed copy per layer and step."""
    b, _, h, e = q.shape
    kv, _, w, n = keys.shape[:4]
    g = h // kv
    qg = q.reshape(b, kv, g, e).transpose(1, 0, 2, 3)[:, :, :, None, None].astype(jnp.float32)  # k b g 1 1 e
    scores = jnp.sum(qg * keys[:, :, None].astype(jnp.float32), axis=-1) / math.sqrt(e)  # k b g w n
    if valid is None:
        index = jnp.arange(w)[:, None] * n + jnp.arange(n)[None, :]  # w n: cache index of each key
        valid = index[None] <= query_index[:, 0, None, None]  # b w n
    scores = jnp.where(valid[None, :, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=(3, 4))
    out = jnp.sum(probs[..., None] * values[:, :, None].astype(jnp.float32), axis=(3, 4))  # k b g e
    return out.transpose(1, 0, 2, 3).reshape(b, 1, h, e).astype(q.dtype)
