"""Pure functions of the paged sampler: chunked prefill into pages, starting rows, the decode loop.

The host (`paged_sampler.PagedController`) owns the page tables; it uploads them (small int arrays)
with each call. A prompt is prefilled once, in chunks of at most `prefill_chunk` tokens, through the
page table of the first sample of its group; the other samples' tables point at the same full pages,
and `start_rows` gives each of them its own copy of a partial last page before it decodes.

When the sampler records routing (`decode.DecodeState.routing`, per slot, not paged), the prefill writes the
prompt's routing into its first sample's slot and `start_rows` copies it to every sample of the group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.generate.decode import DecodeState, decode_loop, record_tokens, write_routing
from rpegjax.generate.live_rows import decode_live, put_rows, take_rows
from rpegjax.generate.paged_cache import PagedKVCache
from rpegjax.generate.sampling import SamplingArrays
from rpegjax.models.config import ModelConfig
from rpegjax.options import DecodeAttention
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding


def empty_paged_state(cfg: ModelConfig, *, num_slots: int, replicas: int, pages_per_replica: int, page_size: int,
                      max_pages: int, max_new_tokens: int, record_routing: bool = False) -> DecodeState:
    """All slots empty (done), every pool page zero (`record_routing`: a routing buffer of every slot's pages)."""
    state = DecodeState.empty(cfg, num_slots, 1, max_new_tokens, record_routing=record_routing,
                              routing_capacity=max_pages * page_size)
    cache = PagedKVCache.zeros(cfg, num_slots=num_slots, replicas=replicas, pages_per_replica=pages_per_replica,
                               page_size=page_size, max_pages=max_pages)
    return state.replace(cache=cache)


def paged_state_shardings(state: DecodeState, sharding: ActivationSharding) -> DecodeState:
    """NamedShardings of a paged `DecodeState`: slots and pool replicas over the batch axes, KV heads over tensor."""
    def named(logical, x, name):
        return sharding.sharding(logical, x.shape, name=name)

    row = (axes.BATCH,)
    pool = PagedKVCache.pool_logical_axes()
    cache = state.cache
    return DecodeState(
        cache=PagedKVCache(k=tuple(named(pool, x, "key page pool") for x in cache.k),
                           v=tuple(named(pool, x, "value page pool") for x in cache.v),
                           page_table=named((axes.BATCH, None), cache.page_table, "page table"),
                           lengths=named(row, cache.lengths, "cache lengths"),
                           limits=named(row, cache.limits, "cache limits")),
        **{field: named(row, getattr(state, field), field)
           for field in ("last_token", "num_generated", "budget", "done", "finish", "prompt_index", "sample_index")},
        tokens=named((axes.BATCH, None), state.tokens, "tokens"),
        logprobs=named((axes.BATCH, None), state.logprobs, "logprobs"),
        routing=None if state.routing is None else named((axes.BATCH, None, None, None), state.routing, "routing"),
    )


def prefill_pages(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    page_table: Int[Array, "p m"],
    starts: Int[Array, " p"],
    tokens: Int[Array, "p c"],
    counts: Int[Array, " p"],
    ends: Bool[Array, " p"],
    last_logits: Float[Array, "p v"],
    lead_slots: Int[Array, " p"],
    *,
    window_pages: int,
    sharding: ActivationSharding | None = None,
) -> tuple[DecodeState, Float[Array, "p v"]]:
    """Runs one chunk of p prompts: row i's `counts[i]` tokens at cache indices starts[i] onwards, written
    into the pages of `page_table[i]`. Rows whose prompt ends in this chunk (`ends`) replace their entry of
    `last_logits` with the float32 logits at their last token (the first response token's distribution).
    When recording routing, row i's goes to slot `lead_slots[i]` (its first sample's; past the slots: dropped)."""
    model = nnx.merge(graphdef, params)
    c = tokens.shape[1]
    mask = jnp.arange(c)[None, :] < counts[:, None]
    positions = starts[:, None] + jnp.arange(c)[None, :]
    rows = PagedKVCache(k=state.cache.k, v=state.cache.v, page_table=page_table, lengths=starts,
                        limits=starts + counts, window_pages=window_pages)
    hidden, rows, routing = model.routed_hidden_states(tokens, positions, mask=mask, cache=rows, sharding=sharding)
    last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)  # p 1 d
    logits = jnp.where(ends[:, None], model.logits(last)[:, 0], last_logits)
    recorded = state.routing
    if recorded is not None:
        recorded = write_routing(recorded, routing.expert_ids, starts, mask, rows=lead_slots)
    return state.replace(cache=state.cache.with_pools(rows.k, rows.v), routing=recorded), logits


def start_rows(
    state: DecodeState,
    logits: Float[Array, "p v"],
    lead: Int[Array, "r q"],
    lead_slots: Int[Array, "r q"],
    slots: Int[Array, "r q"],
    prompt_lengths: Int[Array, "r q"],
    prompt_index: Int[Array, "r q"],
    sample_index: Int[Array, "r q"],
    budgets: Int[Array, "r q"],
    copy_source: Int[Array, "r c"],
    copy_target: Int[Array, "r c"],
    key: Array,
    sampling: SamplingArrays,
) -> DecodeState:
    """Starts up to q sequences on each of the r slot replicas: row j of replica i goes to the replica's slot
    `slots[i, j]` (one >= the slots per replica marks a padding row) and samples its first token from the replica's
    prefill row `lead[i, j]` of `logits` (p = r blocks of prefill rows, replica-major) with its own key, and (when
    recording routing) takes the prompt's routing from the replica's slot `lead_slots[i, j]`, where the prefill
    wrote it. First,
    replica i's page `copy_source[i, j]` is copied to `copy_target[i, j]` (a target past the pool is padding): a
    sample's own copy of its prompt's partial last page.

    Every gather and scatter is vmapped over the replica axis, so the float32 logits a device reads and samples are
    its own replica's q rows, never the whole [r*q, v] (replicated, they were 55 GB at W-plan shapes)."""
    def copy(pool):  # [r k p n e]
        return jax.vmap(lambda pool, source, target: pool.at[:, target].set(pool[:, source], mode="drop"))(
            pool, copy_source, copy_target)

    cache = state.cache.with_pools(map(copy, state.cache.k), map(copy, state.cache.v))
    r, q = slots.shape
    zeros = jnp.zeros((r * q,), jnp.int32)
    width = state.tokens.shape[1]
    flat = lambda x: x.reshape(r * q)  # noqa: E731
    rows = DecodeState(cache=None, last_token=zeros, num_generated=zeros, budget=flat(budgets),
                       done=jnp.zeros((r * q,), bool), finish=zeros, prompt_index=flat(prompt_index),
                       sample_index=flat(sample_index), tokens=jnp.zeros((r * q, width), jnp.int32),
                       logprobs=jnp.zeros((r * q, width), jnp.float32))
    blocks = logits.reshape(r, logits.shape[0] // r, logits.shape[1])  # replica i's prefill rows
    lead_logits = jax.vmap(lambda block, index: block[index])(blocks, lead).reshape(r * q, logits.shape[1])
    rows = record_tokens(rows, lead_logits, key, sampling)

    def put(old, new):  # old [b ...], new [r*q ...]: replica i's rows into its block of old
        blocks = old.reshape(r, old.shape[0] // r, *old.shape[1:])
        parts = new.reshape(r, q, *new.shape[1:])
        put_one = lambda block, index, part: block.at[index].set(part, mode="drop")  # noqa: E731
        return jax.vmap(put_one)(blocks, slots, parts).reshape(old.shape)

    recorded = state.routing
    if recorded is not None:  # the prompt's routing, -1 past it (a slot's previous sequence)
        blocks = recorded.reshape(r, recorded.shape[0] // r, *recorded.shape[1:])
        take = lambda block, index: block[jnp.clip(index, 0, block.shape[0] - 1)]  # noqa: E731
        lead_routing = jax.vmap(take)(blocks, lead_slots).reshape(r * q, *recorded.shape[1:])
        prompt = jnp.arange(recorded.shape[1])[None, :] < flat(prompt_lengths)[:, None]
        recorded = put(recorded, jnp.where(prompt[:, :, None, None], lead_routing, jnp.asarray(-1, recorded.dtype)))
    return state.replace(
        routing=recorded,
        cache=cache.replace(lengths=put(cache.lengths, flat(prompt_lengths))),
        **{field: put(getattr(state, field), getattr(rows, field))
           for field in ("last_token", "num_generated", "budget", "done", "finish", "prompt_index", "sample_index",
                         "tokens", "logprobs")},
    )


def decode_paged(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    page_table: Int[Array, "b m"],
    limits: Int[Array, " b"],
    evict: Bool[Array, " b"],
    live: Int[Array, "r q"],
    key: Array,
    sampling: SamplingArrays,
    max_steps: Int[Array, ""],
    *,
    window_pages: int,
    decode_attention: DecodeAttention = DecodeAttention.GATHER,
    pallas_interpret: bool = False,
    sharding: ActivationSharding | None = None,
) -> tuple[DecodeState, Int[Array, ""]]:
    """Up to `max_steps` decode steps over the paged cache (a `lax.while_loop`) on the rows `live` of each slot
    replica (`live_rows`), stopping early once every row is done or before a running row would write past its
    pages (`limits`). Rows in `evict` (preempted by the host, their pages already reused) are marked done first.
    The bucket shares the whole pools: only its page tables, lengths and limits are gathered. Each step attends
    as `decode_attention` says (`DecodeAttention.PALLAS`: each row over its own pages, `window_pages` unused).
    Returns the new state and the steps run."""
    cache = state.cache.replace(page_table=page_table, limits=limits)
    state = state.replace(cache=cache, done=state.done | evict)

    def take_cache(cache: PagedKVCache) -> PagedKVCache:
        return cache.replace(page_table=take_rows(cache.page_table, live), lengths=take_rows(cache.lengths, live),
                             limits=take_rows(cache.limits, live), window_pages=window_pages,
                             decode_attention=decode_attention, pallas_interpret=pallas_interpret)

    def put_cache(cache: PagedKVCache, part: PagedKVCache) -> PagedKVCache:
        return cache.replace(k=part.k, v=part.v, lengths=put_rows(cache.lengths, live, part.lengths))

    def run(compact: DecodeState) -> tuple[DecodeState, Int[Array, ""]]:
        return decode_loop(graphdef, params, compact, key, sampling, max_steps, sharding, lambda s: s.cache.limits)

    return decode_live(run, state, live, take_cache, put_cache)
