"""Paged (block) KV cache: fixed-size pages from a shared pool per layer, a page table per slot and page group.

KV memory then follows the tokens in flight instead of slots x maximum length: a slot holds
ceil(cached tokens / page_size) pages, the G samples of a prompt share its full prompt pages (each gets
its own copy of a partial last page, so decode writes never touch a shared page), and the pool can be
sized to a token budget, with the host admitting only what the free pages hold.

Layers keep what their kind declares (`paged_state` of `models.layer_stack.MIXERS[kind]`): pools of a page group
(full attention: keys and values of every position; a sliding layer: its window's), or arrays with one row per slot
(a recurrent state). Layers of one page group (`models.kinds.PageGroup`) share page tables and page ids; each group
has its own pool size. The cache binds a `models.pages.PageView` (the group's table and the call's attention
settings) to each layer it hands to a mixer.

Layout. With a mesh, slots split over R slot replicas (the batch mesh axes); each replica owns its own
pool of P pages, so a full-attention pool is [r k p n e] (replica, KV head, page, offset in the page,
head dim), split over replicas like the slots are (and KV heads over tensor), and a page table holds
replica-local page ids. Every gather and scatter is vmapped over the replica axis: it stays on the devices of that
replica, with no collective. Without a mesh R = 1. How a layer reads its pages is its kind's
(`models.full_attention.PagedAttention`).
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from rpegjax.models.config import ModelConfig
from rpegjax.models.kinds import map_state, state_arrays
from rpegjax.models.layer_stack import mixer_of, page_groups
from rpegjax.models.pages import PageView
from rpegjax.options import CacheLayout, DecodeAttention, parse_choice


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


@flax.struct.dataclass
class PagedKVCache:
    """Every layer's paged state, the page tables, lengths and page limits of b rows (slots, or prompts in a
    prefill).

    `tables[g]` is page group g's table (`models.layer_stack.page_groups`; `groups[l]`: layer l's group, None for a
    layer with per-row state only). `limits[b]` = tokens the row's pages hold: the decode loop stops before a running
    row writes past it. `window_pages` (static) is how many page-table columns an attention call gathers; the stored
    state keeps 0 there and each compiled call sets its own, and its decode kernel (`decode_attention`, static too).
    """

    layers: tuple
    tables: tuple[Int[Array, "b m"], ...]
    lengths: Int[Array, " b"]
    limits: Int[Array, " b"]
    groups: tuple[int | None, ...] = flax.struct.field(pytree_node=False, default=())
    window_pages: int = flax.struct.field(pytree_node=False, default=0)
    decode_attention: DecodeAttention = flax.struct.field(pytree_node=False, default=DecodeAttention.GATHER)
    pallas_interpret: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def zeros(cls, cfg: ModelConfig, *, num_slots: int, replicas: int, pages_per_replica: tuple[int, ...],
              page_size: int, max_pages: int) -> PagedKVCache:
        """Every pool page zero; `pages_per_replica[g]`: page group g's pool size."""
        _, groups = page_groups(cfg)
        layers = tuple(mixer_of(cfg, i).paged_state(
            cfg, i, num_slots=num_slots, replicas=replicas, page_size=page_size,
            pages=0 if groups[i] is None else pages_per_replica[groups[i]]) for i in range(cfg.num_layers))
        rows = jnp.zeros((num_slots,), jnp.int32)
        tables = tuple(jnp.zeros((num_slots, max_pages), jnp.int32) for _ in pages_per_replica)
        return cls(layers=layers, tables=tables, lengths=rows, limits=rows, groups=groups)

    @property
    def page_size(self) -> int:
        return next(array.shape[3] for layer in self.layers for array, spec in state_arrays(layer).values()
                    if spec.pooled)

    @property
    def capacity(self) -> int:
        """Cache indices a row can address (page-table columns x page size)."""
        return self.tables[0].shape[1] * self.page_size

    def layer(self, index: int):
        """What layer `index`'s mixer receives: its state, bound to its page group's table and the call's settings."""
        state, group = self.layers[index], self.groups[index]
        if group is None:
            return state
        return state.replace(pages=PageView(table=self.tables[group], window_pages=self.window_pages,
                                            decode_attention=self.decode_attention,
                                            pallas_interpret=self.pallas_interpret))

    def with_layers(self, written: list, added: Int[Array, " b"]) -> PagedKVCache:
        """The layers' states as the mixers returned them, stored without the page views `layer` bound."""
        layers = tuple(layer if group is None else layer.replace(pages=None)
                       for layer, group in zip(written, self.groups, strict=True))
        return self.replace(layers=layers, lengths=self.lengths + added)

    def map_layers(self, function, *others: PagedKVCache) -> tuple:
        """Every layer's state with each array replaced by `function(spec, array, *the same array of others)`."""
        return tuple(map_state(function, layer, *(other.layers[i] for other in others))
                     for i, layer in enumerate(self.layers))


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
