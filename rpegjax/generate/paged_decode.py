"""Pure functions of the paged sampler: chunked prefill into pages, starting rows, the decode loop.

The host (`paged_sampler.PagedController`) owns the page tables; it uploads them (small int arrays)
with each call. A prompt is prefilled once, in chunks of at most `prefill_chunk` tokens, through the
page table of the first sample of its group; the other samples' tables point at the same full pages,
and `start_rows` gives each of them its own copy of a partial last page before it decodes.

A layer's per-row state (a recurrent state: `models.kinds.StateArray` not pooled) lives in the slots' rows: a prefill
chunk reads it from the first sample's slot (zero where the chunk starts a prompt), writes it back there, and
`start_rows` copies it to every sample of the group, as it does the prompt's routing when the sampler records
routing (`decode.DecodeState.routing`, per slot, not paged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.generate.decode import DecodeState, decode_loop, record_tokens, write_routing
from rpegjax.generate.live_rows import decode_live, put_rows, take_rows
from rpegjax.generate.paged_cache import PagedKVCache
from rpegjax.models.kinds import StateArray, map_state
from rpegjax.generate.sampling import SamplingArrays
from rpegjax.models.config import ModelConfig
from rpegjax.options import DecodeAttention
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding


def empty_paged_state(cfg: ModelConfig, *, num_slots: int, replicas: int, pages_per_replica: tuple[int, ...],
                      page_size: int, max_pages: int, max_new_tokens: int, record_routing: bool = False) -> DecodeState:
    """All slots empty (done), every pool page zero (`pages_per_replica[g]`: page group g's pool;
    `record_routing`: a routing buffer of every slot's pages)."""
    state = DecodeState.empty(cfg, num_slots, 1, max_new_tokens, record_routing=record_routing,
                              routing_capacity=max_pages * page_size)
    cache = PagedKVCache.zeros(cfg, num_slots=num_slots, replicas=replicas, pages_per_replica=pages_per_replica,
                               page_size=page_size, max_pages=max_pages)
    return state.replace(cache=cache)


def paged_state_shardings(state: DecodeState, sharding: ActivationSharding) -> DecodeState:
    """NamedShardings of a paged `DecodeState`: slots and pool replicas over the batch axes, heads as each layer's
    kind says (full attention: KV heads over tensor)."""
    def named(logical, x, name):
        return sharding.sharding(logical, x.shape, name=name)

    row = (axes.BATCH,)
    cache = state.cache
    layers = cache.map_layers(lambda spec, x: named(spec.logical, x, "page pool" if spec.pooled else "slot state"))
    return DecodeState(
        cache=cache.replace(layers=layers, tables=tuple(named((axes.BATCH, None), t, "page table") for t in cache.tables),
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
    page_tables: tuple[Int[Array, "p m"], ...],
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
    into the pages of its row of each page group's table (`page_tables[g][i]`). Rows whose prompt ends in this chunk (`ends`) replace their entry of
    `last_logits` with the float32 logits at their last token (the first response token's distribution).
    Row i's per-row layer state and, when recording, its routing live in slot `lead_slots[i]` (its first sample's;
    past the slots: dropped)."""
    model = nnx.merge(graphdef, params)
    c = tokens.shape[1]
    mask = jnp.arange(c)[None, :] < counts[:, None]
    positions = starts[:, None] + jnp.arange(c)[None, :]
    slots = state.cache.lengths.shape[0]
    lead = jnp.clip(lead_slots, 0, slots - 1)

    def take_lead(spec: StateArray, x):  # a pool as it is; a per-row array's lead rows, zero where a prompt starts
        if spec.pooled:
            return x
        fresh = (starts == 0).reshape(-1, *(1,) * (x.ndim - 1))
        return jnp.where(fresh, jnp.zeros((), x.dtype), x[lead])

    def put_lead(spec: StateArray, x, new):
        return new if spec.pooled else x.at[lead_slots].set(new, mode="drop")

    rows = state.cache.replace(layers=state.cache.map_layers(take_lead), tables=tuple(page_tables), lengths=starts,
                               limits=starts + counts, window_pages=window_pages)
    hidden, rows, routing = model.routed_hidden_states(tokens, positions, mask=mask, cache=rows, sharding=sharding)
    last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)  # p 1 d
    logits = jnp.where(ends[:, None], model.logits(last)[:, 0], last_logits)
    recorded = state.routing
    if recorded is not None:
        recorded = write_routing(recorded, routing.expert_ids, starts, mask, rows=lead_slots)
    return state.replace(cache=state.cache.replace(layers=state.cache.map_layers(put_lead, rows)),
                         routing=recorded), logits


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
    copy_source: tuple[Int[Array, "r c"], ...],
    copy_target: tuple[Int[Array, "r c"], ...],
    key: Array,
    sampling: SamplingArrays,
) -> DecodeState:
    """Starts up to q sequences on each of the r slot replicas: row j of replica i goes to the replica's slot
    `slots[i, j]` (one >= the slots per replica marks a padding row) and samples its first token from the replica's
    prefill row `lead[i, j]` of `logits` (p = r blocks of prefill rows, replica-major) with its own key, and takes the
    prompt's per-row layer state and (when recording) routing from the replica's slot `lead_slots[i, j]`, where the
    prefill wrote them. First, in page group g's pools, replica i's page `copy_source[g][i, j]` is copied to
    `copy_target[g][i, j]` (a target past the pool is padding): a sample's own copy of its prompt's partial last page.

    Every gather and scatter is vmapped over the replica axis, so the float32 logits a device reads and samples are
    its own replica's q rows, never the whole [r*q, v] (replicated, they were 55 GB at W-plan shapes)."""
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

    def from_lead(old):  # [b ...]: each started row's lead slot's row (its replica's), as `put` takes them
        blocks = old.reshape(r, old.shape[0] // r, *old.shape[1:])
        take = lambda block, index: block[jnp.clip(index, 0, block.shape[0] - 1)]  # noqa: E731
        return jax.vmap(take)(blocks, lead_slots).reshape(r * q, *old.shape[1:])

    def start_layer(spec: StateArray, x, group: int | None):
        """A pool with each sample's partial last page copied; a per-row array with the prompt's row copied."""
        if not spec.pooled:
            return put(x, from_lead(x))
        copy = lambda pool, source, target: pool.at[:, target].set(pool[:, source], mode="drop")  # noqa: E731
        return jax.vmap(copy)(x, copy_source[group], copy_target[group])

    cache = state.cache
    cache = cache.replace(layers=tuple(map_state(lambda spec, x, group=group: start_layer(spec, x, group), layer)
                                       for layer, group in zip(cache.layers, cache.groups, strict=True)))
    recorded = state.routing
    if recorded is not None:  # the prompt's routing, -1 past it (a slot's previous sequence)
        lead_routing = from_lead(recorded)
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
    page_tables: tuple[Int[Array, "b m"], ...],
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
    cache = state.cache.replace(tables=tuple(page_tables), limits=limits)
    state = state.replace(cache=cache, done=state.done | evict)

    def take_cache(cache: PagedKVCache) -> PagedKVCache:  # pools shared by the bucket, rows gathered
        layers = cache.map_layers(lambda spec, x: x if spec.pooled else take_rows(x, live))
        return cache.replace(layers=layers, tables=tuple(take_rows(t, live) for t in cache.tables),
                             lengths=take_rows(cache.lengths, live), limits=take_rows(cache.limits, live),
                             window_pages=window_pages, decode_attention=decode_attention,
                             pallas_interpret=pallas_interpret)

    def put_cache(cache: PagedKVCache, part: PagedKVCache) -> PagedKVCache:
        layers = cache.map_layers(lambda spec, x, new: new if spec.pooled else put_rows(x, live, new), part)
        return cache.replace(layers=layers, lengths=put_rows(cache.lengths, live, part.lengths))

    def run(compact: DecodeState) -> tuple[DecodeState, Int[Array, ""]]:
        return decode_loop(graphdef, params, compact, key, sampling, max_steps, sharding, lambda s: s.cache.limits)

    return decode_live(run, state, live, take_cache, put_cache)
