"""Paged (block) KV cache: fixed-size pages from a shared pool per layer, a page table per slot.

KV memory then follows the tokens in flight instead of slots x maximum length: a slot holds
ceil(cached tokens / page_size) pages, the G samples of a prompt share its full prompt pages (each gets
its own copy of a partial last page, so decode writes never touch a shared page), and the pool can be
sized to a token budget, with the host admitting only what the free pages hold.

Layout. With a mesh, slots split over R slot replicas (the batch mesh axes); each replica owns its own
pool of P pages, so the pool of one layer is [r p k n e] (replica, page, KV head, offset in the page,
head dim), split over replicas like the slots are, and a page table holds replica-local page ids. Every
gather and scatter below is vmapped over the replica axis: it stays on the devices of that replica,
with no collective. Without a mesh R = 1.

Reading a slot gathers the first `window_pages` entries of its page table (the cache index of a key = its table
column * n + offset), then attends like the contiguous cache (`_cached_attention`: a prefill on the pages
transposed to [b k w*n e]; a decode step, one token per row, in the gathered layout [b w k n e], `_attend_pages`),
so both layouts give the same logits up to float rounding. Table entries past a slot's pages hold
page 0: what they read is masked out by position like any key past the row's length.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.config import ModelConfig
from rpegjax.models.transformer import _NEG_INF, _cached_attention
from rpegjax.options import CacheLayout, parse_choice
from rpegjax.sharding import axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How the sampler stores keys and values.

    * `layout`: `CacheLayout.CONTIGUOUS` (every slot reserves the capacity) or `CacheLayout.PAGED`.
    * `page_size`: tokens per page (paged only).
    * `pages_per_replica`: pool size per slot replica, i.e. the token budget / page_size; None sizes it
      for every slot at full capacity (no preemption ever needed, but the pool reserves the worst case).
    * `prefill_chunk`: most prompt tokens per row in one prefill call (paged only): longer prompts are
      prefilled over several calls, so one admit never needs more than rows x prefill_chunk tokens.
    """

    layout: CacheLayout = CacheLayout.CONTIGUOUS
    page_size: int = 16
    pages_per_replica: int | None = None
    prefill_chunk: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", parse_choice(CacheLayout, self.layout, "CacheConfig.layout"))
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

    k: Float[Array, "r p k n e"]
    v: Float[Array, "r p k n e"]
    page_table: Int[Array, "b m"]  # replica-local page ids
    window_pages: int = flax.struct.field(pytree_node=False)

    def write_and_attend(
        self,
        q: Float[Array, "b t h e"],
        k: Float[Array, "b t k e"],
        v: Float[Array, "b t k e"],
        offsets: Int[Array, " b"],
        key_mask: Bool[Array, "b t"] | None,
    ) -> tuple[Float[Array, "b t h e"], PagedLayer]:
        """Writes the t new tokens of each row at cache indices offsets .. offsets+t-1 (tokens whose
        `key_mask` is False are not written: padding, finished rows), then attends over the row's pages."""
        b, t = q.shape[:2]
        replicas, num_pages, _, page_size, _ = self.k.shape
        columns = self.page_table.shape[1]
        positions = offsets[:, None] + jnp.arange(t)[None, :]  # b t: cache index of each new token
        column = positions // page_size
        page = jnp.take_along_axis(self.page_table, jnp.minimum(column, columns - 1), axis=1)
        writes = column < columns if key_mask is None else key_mask & (column < columns)
        page = jnp.where(writes, page, num_pages)  # past the pool: the scatter drops the write
        within = positions % page_size

        def write(pool, page, within, new):  # pool [p k n e]; page, within [b/r t]; new [b/r t k e]
            return pool.at[page, :, within].set(new.astype(pool.dtype), mode="drop")

        split = lambda x: _per_replica(x, replicas)  # noqa: E731
        new_k = jax.vmap(write)(self.k, split(page), split(within), split(k))
        new_v = jax.vmap(write)(self.v, split(page), split(within), split(v))
        table = split(self.page_table[:, : self.window_pages])
        if t == 1:  # decode: attend over the pages as gathered, in the pool's layout (no transposed copy of them)
            def pages(pool):
                gathered = jax.vmap(lambda pool, table: pool[table])(pool, table)  # r b/r w k n e
                return gathered.reshape(b, *gathered.shape[2:])

            return _attend_pages(q, pages(new_k), pages(new_v), positions), self.replace(k=new_k, v=new_v)

        def gather(pool, table):  # [b/r w] pages -> [b/r k w*n e]
            pages = pool[table]  # b/r w k n e
            rows, w, kv, n, e = pages.shape
            return pages.transpose(0, 2, 1, 3, 4).reshape(rows, kv, w * n, e)

        keys = jax.vmap(gather)(new_k, table)
        values = jax.vmap(gather)(new_v, table)
        keys, values = (x.reshape(b, *x.shape[2:]) for x in (keys, values))
        out = _cached_attention(q, keys, values, positions)
        return out, self.replace(k=new_k, v=new_v)


def _attend_pages(q: Float[Array, "b 1 h e"], keys: Float[Array, "b w k n e"], values: Float[Array, "b w k n e"],
                  query_index: Int[Array, "b 1"]) -> Float[Array, "b 1 h e"]:
    """`_cached_attention` of one new token per row over its w gathered pages of n tokens, key w' n + n' at page
    w', offset n': the same multiply-and-sum in float32, reduced over (w, n) in the pages' own layout, so XLA
    reads them straight from the gather instead of a [b k w*n e] transposed copy per layer and step."""
    b, _, h, e = q.shape
    w, kv, n = keys.shape[1:4]
    g = h // kv
    qg = q.reshape(b, 1, kv, g, 1, e).astype(jnp.float32)
    scores = jnp.sum(qg * keys[:, :, :, None].astype(jnp.float32), axis=-1) / math.sqrt(e)  # b w k g n
    index = jnp.arange(w)[:, None] * n + jnp.arange(n)[None, :]  # w n: cache index of each key
    valid = index[None] <= query_index[:, 0, None, None]  # b w n
    scores = jnp.where(valid[:, :, None, None, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=(1, 4))
    out = jnp.sum(probs[..., None] * values[:, :, :, None].astype(jnp.float32), axis=(1, 4))  # b k g e
    return out.reshape(b, 1, h, e).astype(q.dtype)


@flax.struct.dataclass
class PagedKVCache:
    """Pools of every layer, page tables, lengths and page limits of b rows (slots, or prompts in a prefill).

    `limits[b]` = tokens the row's pages hold: the decode loop stops before a running row writes past it.
    `window_pages` (static) is how many page-table columns an attention call gathers; the stored state
    keeps 0 there and each compiled call sets its own.
    """

    k: tuple[Float[Array, "r p k n e"], ...]
    v: tuple[Float[Array, "r p k n e"], ...]
    page_table: Int[Array, "b m"]
    lengths: Int[Array, " b"]
    limits: Int[Array, " b"]
    window_pages: int = flax.struct.field(pytree_node=False, default=0)

    @classmethod
    def zeros(cls, cfg: ModelConfig, *, num_slots: int, replicas: int, pages_per_replica: int, page_size: int,
              max_pages: int) -> PagedKVCache:
        shape = (replicas, pages_per_replica, cfg.num_kv_heads, page_size, cfg.head_dim)
        layers = range(cfg.num_layers)
        rows = jnp.zeros((num_slots,), jnp.int32)
        return cls(k=tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in layers),
                   v=tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in layers),
                   page_table=jnp.zeros((num_slots, max_pages), jnp.int32), lengths=rows, limits=rows)

    @staticmethod
    def pool_logical_axes() -> tuple[str | None, ...]:
        """Logical axes of each layer's pool: replicas split like slots, KV heads over tensor."""
        return (axes.BATCH, None, axes.KV_HEADS, None, axes.HEAD_DIM)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[3]

    @property
    def capacity(self) -> int:
        """Cache indices a row can address (page-table columns x page size)."""
        return self.page_table.shape[1] * self.page_size

    def layer(self, index: int) -> PagedLayer:
        return PagedLayer(k=self.k[index], v=self.v[index], page_table=self.page_table, window_pages=self.window_pages)

    def with_layers(self, written: list[PagedLayer], added: Int[Array, " b"]) -> PagedKVCache:
        return self.replace(k=tuple(layer.k for layer in written), v=tuple(layer.v for layer in written),
                            lengths=self.lengths + added)

    def with_pools(self, k, v) -> PagedKVCache:
        return self.replace(k=tuple(k), v=tuple(v))

    def bytes_per_page(self) -> int:
        """KV bytes of one page over all layers (keys and values)."""
        _, _, kv, n, e = self.k[0].shape
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
