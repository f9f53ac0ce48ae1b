"""Paged (block) KV cache: fixed-size pages from a shared pool per layer, a page table per slot.

KV memory then follows the tokens in flight instead of slots x maximum length: a slot holds
ceil(cached tokens / page_size) pages, the G samples of a prompt share its full prompt pages (each gets
its own copy of a partial last page, so decode writes never touch a shared page), and the pool can be
sized to a token budget, with the host admitting only what the free pages hold.

Layout. With a mesh, slots split over R slot replicas (the batch mesh axes); each replica owns its own
pool of P pages, so the pool of one layer is [r k p n e] (replica, KV head, page, offset in the page,
head dim), split over replicas like the slots are (and KV heads over tensor), and a page table holds
replica-local page ids. A replica's pool [k p n e] is the layout the Pallas paged-attention kernel reads
(`paged_attention`), so no step transposes it. Every gather and scatter below is vmapped over the replica axis:
it stays on the devices of that replica, with no collective. Without a mesh R = 1.

Reading a slot gathers the first `window_pages` entries of its page table (the cache index of a key = its table
column * n + offset), then attends like the contiguous cache (`_cached_attention`: a prefill on the pages
transposed to that cache's layout, keys [b k e w*n] and values [b k w*n e]; a decode step, one token per row, in
the gathered layout [k b w n e], `_attend_pages`), so both layouts give the same logits up to float rounding.
Table entries past a slot's pages hold page 0: what they read is masked out by position like any key past the
row's length. With
`DecodeAttention.PALLAS` a decode step instead runs the kernel over each row's whole table, which stops at the
row's own length (`paged_attention.paged_decode_attention`): no window, and no work past a row's tokens.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from rpegjax.generate.paged_attention import paged_decode_attention
from rpegjax.models.config import ModelConfig
from rpegjax.models.transformer import _NEG_INF, _cached_attention
from rpegjax.options import CacheLayout, DecodeAttention, parse_choice
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How the sampler stores keys and values.

    * `layout`: `CacheLayout.CONTIGUOUS` (every slot reserves the capacity) or `CacheLayout.PAGED`.
    * `page_size`: tokens per page (paged only).
    * `pages_per_replica`: pool size per slot replica, i.e. the token budget / page_size; None sizes it
      for every slot at full capacity (no preemption ever needed, but the pool reserves the worst case).
    * `prefill_chunk`: most prompt tokens per row in one prefill call (paged only): longer prompts are
      prefilled over several calls, so one admit never needs more than rows x prefill_chunk tokens.
    * `decode_attention` (paged only): `DecodeAttention.GATHER` (XLA, any platform) or `PALLAS` (the Pallas
      paged-attention kernel: each row reads its own pages; CUDA GPUs only, refused elsewhere unless
      `pallas_interpret`, Pallas's interpret mode, a test and debugging setting).
    """

    layout: CacheLayout = CacheLayout.CONTIGUOUS
    page_size: int = 16
    pages_per_replica: int | None = None
    prefill_chunk: int = 256
    decode_attention: DecodeAttention = DecodeAttention.GATHER
    pallas_interpret: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", parse_choice(CacheLayout, self.layout, "CacheConfig.layout"))
        object.__setattr__(self, "decode_attention",
                           parse_choice(DecodeAttention, self.decode_attention, "CacheConfig.decode_attention"))
        if self.decode_attention is DecodeAttention.PALLAS and self.layout is not CacheLayout.PAGED:
            raise ValueError(f"CacheConfig.decode_attention=pallas reads a paged pool; the {self.layout} cache has "
                             "none (set layout=paged, or decode_attention=gather)")
        if not isinstance(self.pallas_interpret, bool):
            raise ValueError(f"CacheConfig.pallas_interpret must be true or false, got {self.pallas_interpret!r}")
        for name in ("page_size", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheConfig.{name} must be a positive integer, got {value!r}")
        pages = self.pages_per_replica
        if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int) or pages < 1):
            raise ValueError(f"CacheConfig.pages_per_replica must be a positive integer or None, got {pages!r}")

    @classmethod
    def paged(cls, **changes) -> CacheConfig:
        return cls(layout=CacheLayout.PAGED, **changes)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _per_replica(x: Array, replicas: int) -> Array:
    """[b ...] -> [r b/r ...]: slot b lives in replica b // (b/r), as the batch sharding splits it."""
    return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])


@flax.struct.dataclass
class PagedLayer:
    """One layer's pools and the page table of the rows being run: what `Attention` receives."""

    k: Float[Array, "r k p n e"]
    v: Float[Array, "r k p n e"]
    page_table: Int[Array, "b m"]  # replica-local page ids
    window_pages: int = flax.struct.field(pytree_node=False)
    decode_attention: DecodeAttention = flax.struct.field(pytree_node=False, default=DecodeAttention.GATHER)
    pallas_interpret: bool = flax.struct.field(pytree_node=False, default=False)

    def write_and_attend(
        self,
        q: Float[Array, "b t h e"],
        k: Float[Array, "b t k e"],
        v: Float[Array, "b t k e"],
        offsets: Int[Array, " b"],
        key_mask: Bool[Array, "b t"] | None,
        sharding: ActivationSharding | None = None,
    ) -> tuple[Float[Array, "b t h e"], PagedLayer]:
        """Writes the t new tokens of each row at cache indices offsets .. offsets+t-1 (tokens whose
        `key_mask` is False are not written: padding, finished rows), then attends over the row's pages
        (`sharding`: the mesh the Pallas kernel's `shard_map` runs on)."""
        b, t = q.shape[:2]
        replicas, _, num_pages, page_size, _ = self.k.shape
        columns = self.page_table.shape[1]
        positions = offsets[:, None] + jnp.arange(t)[None, :]  # b t: cache index of each new token
        column = positions // page_size
        page = jnp.take_along_axis(self.page_table, jnp.minimum(column, columns - 1), axis=1)
        writes = column < columns if key_mask is None else key_mask & (column < columns)
        page = jnp.where(writes, page, num_pages)  # past the pool: the scatter drops the write
        within = positions % page_size

        def write(pool, page, within, new):  # pool [k p n e]; page, within [b/r t]; new [b/r t k e]
            return pool.at[:, page, within].set(new.transpose(2, 0, 1, 3).astype(pool.dtype), mode="drop")

        split = lambda x: _per_replica(x, replicas)  # noqa: E731
        new_k = jax.vmap(write)(self.k, split(page), split(within), split(k))
        new_v = jax.vmap(write)(self.v, split(page), split(within), split(v))
        written = self.replace(k=new_k, v=new_v)
        if t == 1 and self.decode_attention is DecodeAttention.PALLAS:  # each row's own pages, its whole table
            spec = None if sharding is None else sharding.spec(PagedKVCache.pool_logical_axes(), new_k.shape,
                                                               name="page pool")
            live = None if key_mask is None else key_mask[:, 0]  # finished rows and bucket padding read nothing
            out = paged_decode_attention(q, new_k, new_v, self.page_table, positions, live, sharding=sharding,
                                         pool_spec=spec, interpret=self.pallas_interpret)
            return out, written
        table = split(self.page_table[:, : self.window_pages])
        if t == 1:  # decode: attend over the pages as gathered, in the pool's layout (no transposed copy of them)
            def attend(pool_k, pool_v, table, q, index):  # one replica: pools [k p n e], its rows' q and indices
                return _attend_pages(q, pool_k[:, table], pool_v[:, table], index)

            out = jax.vmap(attend)(new_k, new_v, table, split(q), split(positions))
            return out.reshape(q.shape), written

        def gather_keys(pool, table):  # [b/r w] pages -> the contiguous cache's keys [b/r k e w*n]
            pages = pool[:, table].transpose(1, 0, 4, 2, 3)  # k b/r w n e -> b/r k e w n
            return pages.reshape(*pages.shape[:3], -1)

        def gather_values(pool, table):  # [b/r w] pages -> the contiguous cache's values [b/r k w*n e]
            pages = pool[:, table].transpose(1, 0, 2, 3, 4)  # k b/r w n e -> b/r k w n e
            return pages.reshape(*pages.shape[:2], -1, pages.shape[-1])

        keys = jax.vmap(gather_keys)(new_k, table)
        values = jax.vmap(gather_values)(new_v, table)
        keys, values = (x.reshape(b, *x.shape[2:]) for x in (keys, values))
        out = _cached_attention(q, keys, values, positions)
        return out, written


def _attend_pages(q: Float[Array, "b 1 h e"], keys: Float[Array, "k b w n e"], values: Float[Array, "k b w n e"],
                  query_index: Int[Array, "b 1"]) -> Float[Array, "b 1 h e"]:
    """`_cached_attention` of one new token per row over its w gathered pages of n tokens, key w' n + n' at page
    w', offset n': the same multiply-and-sum in float32, reduced over (w, n) in the pages' own layout (the pool's,
    KV head first), so XLA reads them straight from the gather instead of a [b k w*n e] transposed copy per layer
    and step."""
    b, _, h, e = q.shape
    kv, _, w, n = keys.shape[:4]
    g = h // kv
    qg = q.reshape(b, kv, g, e).transpose(1, 0, 2, 3)[:, :, :, None, None].astype(jnp.float32)  # k b g 1 1 e
    scores = jnp.sum(qg * keys[:, :, None].astype(jnp.float32), axis=-1) / math.sqrt(e)  # k b g w n
    index = jnp.arange(w)[:, None] * n + jnp.arange(n)[None, :]  # w n: cache index of each key
    valid = index[None] <= query_index[:, 0, None, None]  # b w n
    scores = jnp.where(valid[None, :, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=(3, 4))
    out = jnp.sum(probs[..., None] * values[:, :, None].astype(jnp.float32), axis=(3, 4))  # k b g e
    return out.transpose(1, 0, 2, 3).reshape(b, 1, h, e).astype(q.dtype)


@flax.struct.dataclass
class PagedKVCache:
    """Pools of every layer, page tables, lengths and page limits of b rows (slots, or prompts in a prefill).

    `limits[b]` = tokens the row's pages hold: the decode loop stops before a running row writes past it.
    `window_pages` (static) is how many page-table columns an attention call gathers; the stored state
    keeps 0 there and each compiled call sets its own, and its decode kernel (`decode_attention`, static too).
    """

    k: tuple[Float[Array, "r k p n e"], ...]
    v: tuple[Float[Array, "r k p n e"], ...]
    page_table: Int[Array, "b m"]
    lengths: Int[Array, " b"]
    limits: Int[Array, " b"]
    window_pages: int = flax.struct.field(pytree_node=False, default=0)
    decode_attention: DecodeAttention = flax.struct.field(pytree_node=False, default=DecodeAttention.GATHER)
    pallas_interpret: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def zeros(cls, cfg: ModelConfig, *, num_slots: int, replicas: int, pages_per_replica: int, page_size: int,
              max_pages: int) -> PagedKVCache:
        shape = (replicas, cfg.num_kv_heads, pages_per_replica, page_size, cfg.head_dim)
        layers = range(cfg.num_layers)
        rows = jnp.zeros((num_slots,), jnp.int32)
        return cls(k=tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in layers),
                   v=tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in layers),
                   page_table=jnp.zeros((num_slots, max_pages), jnp.int32), lengths=rows, limits=rows)

    @staticmethod
    def pool_logical_axes() -> tuple[str | None, ...]:
        """Logical axes of each layer's pool: replicas split like slots, KV heads over tensor."""
        return (axes.BATCH, axes.KV_HEADS, None, None, axes.HEAD_DIM)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[3]

    @property
    def capacity(self) -> int:
        """Cache indices a row can address (page-table columns x page size)."""
        return self.page_table.shape[1] * self.page_size

    def layer(self, index: int) -> PagedLayer:
        return PagedLayer(k=self.k[index], v=self.v[index], page_table=self.page_table, window_pages=self.window_pages,
                          decode_attention=self.decode_attention, pallas_interpret=self.pallas_interpret)

    def with_layers(self, written: list[PagedLayer], added: Int[Array, " b"]) -> PagedKVCache:
        return self.replace(k=tuple(layer.k for layer in written), v=tuple(layer.v for layer in written),
                            lengths=self.lengths + added)

    def with_pools(self, k, v) -> PagedKVCache:
        return self.replace(k=tuple(k), v=tuple(v))

    def bytes_per_page(self) -> int:
        """KV bytes of one page over all layers (keys and values)."""
        _, kv, _, n, e = self.k[0].shape
        return 2 * len(self.k) * kv * n * e * self.k[0].dtype.itemsize


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV bytes one cached token takes over all layers (keys and values)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize


class PagePool:
    """Host bookkeeping of the pools: free pages and reference counts per replica.

    A page shared by the G samples of a prompt has G references and returns to the free list when the
    last one is released. Free pages are handed out lowest id first (deterministic runs).
    """

    def __init__(self, replicas: int, pages_per_replica: int):
        self.pages_per_replica = pages_per_replica
        self._free = [list(range(pages_per_replica - 1, -1, -1)) for _ in range(replicas)]
        self._refs = np.zeros((replicas, pages_per_replica), np.int64)

    def num_free(self, replica: int) -> int:
        return len(self._free[replica])

    def held(self) -> int:
        """Pages in use over all replicas."""
        return int((self._refs > 0).sum())

    def take(self, replica: int, count: int) -> list[int]:
        if count > len(self._free[replica]):
            raise ValueError(f"replica {replica} has {len(self._free[replica])} free pages, {count} were asked for")
        pages = [self._free[replica].pop() for _ in range(count)]
        self._refs[replica, pages] = 1
        return pages

    def share(self, replica: int, pages: list[int], times: int) -> None:
        self._refs[replica, pages] += times

    def release(self, replica: int, pages: list[int]) -> None:
        for page in pages:
            self._refs[replica, page] -= 1
            if self._refs[replica, page] == 0:
                self._free[replica].append(page)
        self._free[replica].sort(reverse=True)


def pow2_at_least(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most `cap`: few distinct shapes, so few compiled programs."""
    return min(cap, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
