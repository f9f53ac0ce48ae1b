"""Pure functions of the sampler: slot state, prefill into slots, and the compiled decode loop.

A fixed number of slots (rows) share one preallocated `KVCache` of `capacity` = max prompt length +
max new tokens: each layer's state as its kind declares it (keys and values of every position, a window, a state
per row), moved between rows only through the kind's array descriptions (`models.kinds.StateArray`). A slot holds
one sequence: its prompt and response so far in the cache, the last
sampled token (not yet in the cache), and the response tokens and behaviour log-probs written so far.
Slots that are done (or were never filled) still ride along in the batch but write nothing: their
cache length does not advance and their outputs are frozen, so a finished slot can be harvested and
refilled between decode chunks without touching the others.

RoPE position of a token = its cache index (prompts start at 0), so a prompt of length s is
right-padded in the prefill and its first response token sits at position s.

Routing (a mixture-of-experts model, when the sampler records it for router replay): `routing[b, i]` holds the
experts each sparse layer chose for the token at cache index i of row b, written by the pass that computed that
token's hidden state (the prefill for the prompt, the decode step that fed it for a response token); -1 where
nothing was (padding, and a sequence's last sampled token, which no pass feeds). Without recording the state
carries no routing and the programs are the dense sampler's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.generate.completion import EOS_CODE, LENGTH_CODE, RUNNING_CODE, STOP_CODE
from rpegjax.generate.live_rows import decode_live, first_positions, put_rows, take_rows
from rpegjax.generate.sampling import SamplingArrays, row_step_keys, sample_tokens
from rpegjax.models.config import ModelConfig
from rpegjax.models.kinds import StateArray
from rpegjax.models.kv_cache import KVCache
from rpegjax.options import CacheLayout
from rpegjax.sharding import axes
from rpegjax.sharding.abstract import with_shardings
from rpegjax.sharding.rules import ActivationSharding


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries, one row per slot (n = most new tokens per sequence)."""

    cache: KVCache  # every layer's state (full attention: k [b k e t], v [b k t e]); lengths [b] = tokens cached
    last_token: Int[Array, " b"]  # latest sampled token, fed to the next step
    num_generated: Int[Array, " b"]  # response tokens sampled so far
    budget: Int[Array, " b"]  # most response tokens this sequence may have
    done: Bool[Array, " b"]  # finished or empty: the row writes nothing
    finish: Int[Array, " b"]  # finish code (completion.FINISH_CODES), 0 while running
    prompt_index: Int[Array, " b"]  # with sample_index and step: the row's PRNG stream
    sample_index: Int[Array, " b"]
    tokens: Int[Array, "b n"]  # response tokens
    logprobs: Float[Array, "b n"]  # behaviour log-probs of `tokens`
    # experts of every cached token (c = capacity, s sparse layers, k experts per token; -1: none), int16; None
    # when the sampler does not record routing
    routing: Int[Array, "b c s k"] | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, num_slots: int, capacity: int, max_new_tokens: int, *,
              record_routing: bool = False, routing_capacity: int | None = None) -> DecodeState:
        """All slots empty (done, nothing written); with `record_routing` a routing buffer of `routing_capacity`
        positions (default `capacity`) per slot, all -1."""
        zeros = jnp.zeros((num_slots,), jnp.int32)
        routing = None
        if record_routing:
            positions = capacity if routing_capacity is None else routing_capacity
            routing = jnp.full((num_slots, positions, *routing_shape(cfg)), -1, ROUTING_DTYPE)
        return cls(
            cache=KVCache.zeros(cfg, num_slots, capacity),
            last_token=zeros,
            num_generated=zeros,
            budget=zeros,
            done=jnp.ones((num_slots,), bool),
            finish=zeros,
            prompt_index=zeros,
            sample_index=zeros,
            tokens=jnp.zeros((num_slots, max_new_tokens), jnp.int32),
            logprobs=jnp.zeros((num_slots, max_new_tokens), jnp.float32),
            routing=routing,
        )

    @property
    def num_slots(self) -> int:
        return self.done.shape[0]


# recorded expert ids fit in 16 bits (checked by `routing_shape`): half the memory of int32, and -1 for "none"
ROUTING_DTYPE = jnp.int16


def routing_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(sparse layers, experts per token) of one token's recorded routing; raises for a model without experts."""
    if not cfg.sparse_layers:
        raise ValueError("recording the routing needs a mixture-of-experts model; this one has no sparse layer")
    if cfg.num_experts > np.iinfo(np.int16).max:
        raise ValueError(f"recording the routing stores expert ids as int16; {cfg.num_experts} experts do not fit")
    return len(cfg.sparse_layers), cfg.num_experts_per_token


def write_routing(buffer: Int[Array, "n c s k"], routing: Int[Array, "b t s k"], starts: Int[Array, " b"],
                  written: Bool[Array, "b t"], rows: Int[Array, " b"] | None = None) -> Int[Array, "n c s k"]:
    """`buffer` with the routing of the t tokens of each row b at positions starts[b] onwards of buffer row
    rows[b] (default b), where `written` (the others are dropped: their position points past the buffer)."""
    b, t = written.shape
    columns = starts[:, None] + jnp.arange(t)[None, :]
    columns = jnp.where(written, columns, buffer.shape[1])
    rows = jnp.arange(b) if rows is None else rows
    return buffer.at[rows[:, None], columns].set(routing.astype(buffer.dtype), mode="drop")


def decode_state_shardings(state: DecodeState, sharding: ActivationSharding) -> DecodeState:
    """NamedShardings for a `DecodeState` (same tree): slots over the batch axes, cache heads over tensor."""
    def named(logical, x):
        return sharding.sharding(logical, x.shape)

    row = (axes.BATCH,)
    cache = state.cache
    return DecodeState(
        cache=cache.replace(layers=cache.map_layers(lambda spec, x: named(spec.logical, x)),
                            lengths=named(row, cache.lengths)),
        last_token=named(row, state.last_token),
        num_generated=named(row, state.num_generated),
        budget=named(row, state.budget),
        done=named(row, state.done),
        finish=named(row, state.finish),
        prompt_index=named(row, state.prompt_index),
        sample_index=named(row, state.sample_index),
        tokens=named((axes.BATCH, None), state.tokens),
        logprobs=named((axes.BATCH, None), state.logprobs),
        routing=None if state.routing is None else named((axes.BATCH, None, None, None), state.routing),
    )


def abstract_state_of(build: Callable[[], Any], shardings: Any | None) -> Any:
    """Shapes and dtypes of the state `build()` makes (nothing allocated), carrying `shardings` when given."""
    state = jax.eval_shape(build)
    return state if shardings is None else with_shardings(state, shardings)


def _ends_with_stop_sequence(responses: Int[Array, "b n"], num_generated: Int[Array, " b"],
                             stop_table: Int[Array, "s l"]) -> Bool[Array, " b"]:
    """Whether each row's response (its first `num_generated` tokens) ends with one of the stop sequences."""
    longest = stop_table.shape[1]
    columns = num_generated[:, None] - longest + jnp.arange(longest)[None, :]  # b l: the response's last l tokens
    last = jnp.take_along_axis(responses, jnp.clip(columns, 0, responses.shape[1] - 1), axis=1)
    last = jnp.where(columns >= 0, last, -2)  # before the response: matches no token (padding is -1)
    matches = (last[:, None, :] == stop_table[None]) | (stop_table[None] < 0)  # b s l
    return jnp.any(jnp.all(matches, axis=-1), axis=-1)


def _finish_codes(
    tokens: Int[Array, " b"], num_generated: Int[Array, " b"], budget: Int[Array, " b"], sampling: SamplingArrays,
    responses: Int[Array, "b n"],
) -> Int[Array, " b"]:
    """Finish code after sampling `tokens` as the num_generated-th response token (EOS > stop > length);
    `responses` holds the response tokens so far, `tokens` included."""
    eos = tokens == sampling.eos_id
    stop = jnp.asarray(sampling.is_stop)[tokens]
    if sampling.stop_table is not None:
        stop = stop | _ends_with_stop_sequence(responses, num_generated, jnp.asarray(sampling.stop_table))
    length = num_generated >= budget
    return jnp.where(eos, EOS_CODE, jnp.where(stop, STOP_CODE, jnp.where(length, LENGTH_CODE, RUNNING_CODE)))


def record_tokens(
    state: DecodeState, logits: Float[Array, "b v"], key: Array, sampling: SamplingArrays
) -> DecodeState:
    """Samples the next token of every running row from `logits` and appends it to the row's response."""
    active = ~state.done
    keys = row_step_keys(key, state.prompt_index, state.sample_index, state.num_generated)
    tokens, logprobs = sample_tokens(logits, keys, sampling)
    rows = jnp.arange(state.num_slots)
    # finished rows point past the buffer, so the scatter drops their write
    column = jnp.where(active, state.num_generated, state.tokens.shape[1])
    num_generated = state.num_generated + active.astype(jnp.int32)
    responses = state.tokens.at[rows, column].set(tokens, mode="drop")
    finish = jnp.where(active, _finish_codes(tokens, num_generated, state.budget, sampling, responses), state.finish)
    return state.replace(
        last_token=jnp.where(active, tokens, state.last_token),
        num_generated=num_generated,
        done=state.done | (finish != RUNNING_CODE),
        finish=finish,
        tokens=responses,
        logprobs=state.logprobs.at[rows, column].set(logprobs, mode="drop"),
    )


def prefill(model, prompts: Int[Array, "p s"], prompt_lengths: Int[Array, " p"],
            sharding: ActivationSharding | None) -> tuple[KVCache, Float[Array, "p v"], Any]:
    """Runs right-padded prompts through a fresh cache of capacity s.

    Returns that cache (lengths = prompt_lengths), the float32 logits at each prompt's last token, i.e. the
    distribution of the first response token, and the prompts' `Routing` (None for a dense model): expert_ids
    [p s layers k].
    """
    p, s = prompts.shape
    mask = jnp.arange(s)[None, :] < prompt_lengths[:, None]
    positions = jnp.broadcast_to(jnp.arange(s), (p, s))
    cache = KVCache.zeros(model.cfg, p, s)
    hidden, cache, routing = model.routed_hidden_states(prompts, positions, mask=mask, cache=cache, sharding=sharding)
    last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)  # p 1 d
    return cache, model.logits(last)[:, 0], routing


def admit(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    prompts: Int[Array, "p s"],
    prompt_lengths: Int[Array, " p"],
    slots: Int[Array, " r"],
    prompt_index: Int[Array, " r"],
    sample_index: Int[Array, " r"],
    budgets: Int[Array, " r"],
    key: Array,
    sampling: SamplingArrays,
    *,
    group_size: int,
    sharding: ActivationSharding | None = None,
) -> DecodeState:
    """Prefills p prompts ONCE and starts `group_size` sequences of each in the given slots.

    New row r = prompt r // group_size; its prefilled cache is copied into slot `slots[r]` (a slot
    >= num_slots marks a padding row and is dropped), and its first token is sampled there with the
    row's own key, so the G samples of a prompt share one prefill and still differ.
    """
    model = nnx.merge(graphdef, params)
    s = prompts.shape[1]
    cache, logits, routing = prefill(model, prompts, prompt_lengths, sharding)
    repeat = lambda x, axis=0: jnp.repeat(x, group_size, axis=axis)  # noqa: E731

    def copy_in(spec: StateArray, slot_array, prefilled):
        """One array of a layer's state: the prefilled rows into their slots (the positions the prefill wrote, or
        the whole row of a per-row state)."""
        at = slots if spec.positions is None else (slots, *first_positions(spec.positions,
                                                                           prefilled.shape[spec.positions]))
        return slot_array.at[at].set(repeat(prefilled).astype(slot_array.dtype), mode="drop")

    layers = state.cache.map_layers(copy_in, cache)

    # the new rows as a small state of their own (no cache: sampling never reads it), advanced by one
    # sampled token, then scattered in; sampling only the r new rows keeps an admit cheap at large vocab
    r = slots.shape[0]
    zeros = jnp.zeros((r,), jnp.int32)
    rows = DecodeState(
        cache=None,
        last_token=zeros,
        num_generated=zeros,
        budget=budgets,
        done=jnp.zeros((r,), bool),
        finish=zeros,
        prompt_index=prompt_index,
        sample_index=sample_index,
        tokens=jnp.zeros((r, state.tokens.shape[1]), jnp.int32),
        logprobs=jnp.zeros((r, state.tokens.shape[1]), jnp.float32),
    )
    rows = record_tokens(rows, repeat(logits), key, sampling)

    def put(old, new):
        return old.at[slots].set(new, mode="drop")

    recorded = state.routing
    if recorded is not None:  # each new row's routing: its prompt's, -1 past it (a slot's previous sequence)
        fresh = jnp.full((r, *recorded.shape[1:]), -1, recorded.dtype)
        prompt_mask = repeat(jnp.arange(s)[None, :] < prompt_lengths[:, None])
        recorded = put(recorded, write_routing(fresh, repeat(routing.expert_ids), zeros, prompt_mask))
    return state.replace(
        routing=recorded,
        cache=state.cache.replace(layers=layers, lengths=put(state.cache.lengths, repeat(prompt_lengths))),
        last_token=put(state.last_token, rows.last_token),
        num_generated=put(state.num_generated, rows.num_generated),
        budget=put(state.budget, rows.budget),
        done=put(state.done, rows.done),
        finish=put(state.finish, rows.finish),
        prompt_index=put(state.prompt_index, rows.prompt_index),
        sample_index=put(state.sample_index, rows.sample_index),
        tokens=put(state.tokens, rows.tokens),
        logprobs=put(state.logprobs, rows.logprobs),
    )


def step_state(model, state: DecodeState, sharding: ActivationSharding | None) -> tuple[Float[Array, "b v"], DecodeState]:
    """Feeds every row's last token through the cache: the logits of the next token and the state with the new
    cache and, when recording, the fed tokens' routing written at their cache index.

    Finished rows are masked out, so their cache length does not move (their write lands past it).
    """
    active = ~state.done
    hidden, cache, routing = model.routed_hidden_states(
        state.last_token[:, None], state.cache.lengths[:, None], mask=active[:, None], cache=state.cache, sharding=sharding
    )
    recorded = state.routing
    if recorded is not None:
        recorded = write_routing(recorded, routing.expert_ids, state.cache.lengths, active[:, None])
    return model.logits(hidden)[:, 0], state.replace(cache=cache, routing=recorded)


def decode_loop(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, key: Array, sampling: SamplingArrays,
                max_steps: Int[Array, ""], sharding: ActivationSharding | None,
                row_end: Callable[[DecodeState], Int[Array, " b"]]) -> tuple[DecodeState, Int[Array, ""]]:
    """Up to `max_steps` decode steps in one `lax.while_loop` (no host round trip), stopping once every row is
    done or before a running row would write at or past `row_end(state)` (the contiguous cache's capacity,
    the paged cache's page limit). Returns the new state and the number of steps run."""
    def cond(carry):
        step, s = carry
        fits = jnp.all(s.done | (s.cache.lengths < row_end(s)))
        return (step < max_steps) & ~jnp.all(s.done) & fits

    def body(carry):
        step, s = carry
        model = nnx.merge(graphdef, params)
        logits, s = step_state(model, s, sharding)
        return step + 1, record_tokens(s, logits, key, sampling)

    steps, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
    return state, steps


class DecodeStalledError(RuntimeError):
    """A decode chunk ran no step and finished no sequence. With the host's bookkeeping right that cannot
    happen (every running row has room for at least one step), so the host and the device state disagree;
    the controller raises this rather than dispatch chunks that may never progress."""

    @classmethod
    def describe(cls, sampler: CacheLayout, chunk: int, running: list[int], done: np.ndarray, lengths: np.ndarray,
                 limits: np.ndarray) -> DecodeStalledError:
        """The error for the sampler's `chunk`-th decode call, naming the device rows that stop the loop
        (running on the device, cache length at or past the row's limit) and the slots the host runs."""
        blocking = [f"slot {slot}: cache length {int(lengths[slot])}, limit {int(limits[slot])}"
                    + ("" if slot in running else ", free on the host")
                    for slot in range(done.shape[0]) if not done[slot] and lengths[slot] >= limits[slot]]
        return cls(
            f"{sampler} sampler: decode call {chunk} ran 0 steps and finished no sequence (the host's bookkeeping "
            f"and the device state disagree: a bug, not bad input). Device rows that stop the loop: "
            f"{'; '.join(blocking) or 'none'}. Running on the host: slots {running}."
        )


def decode(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    live: Int[Array, "r q"],
    key: Array,
    sampling: SamplingArrays,
    max_steps: Int[Array, ""],
    *,
    window: int | None = None,
    sharding: ActivationSharding | None = None,
) -> tuple[DecodeState, Int[Array, ""]]:
    """Up to `max_steps` decode steps (a `lax.while_loop`, no host round trip) on the rows `live` of each slot
    replica (`live_rows`: the running slots, padded with free ones), stopping early once every row is done.
    Returns the new state and the number of steps run.

    The bucket's rows are gathered once, with only the first `window` cache positions when a static `window` <
    capacity, and written back once, so a step costs O(bucket rows x window) instead of O(slots x capacity);
    the loop also stops before any running row would write past the window, so a window chosen too small
    costs an early return, never a wrong token. Logits are the same: keys past a row's length are masked.
    """
    window = None if window is None or window >= state.cache.capacity else window

    def narrowed(spec: StateArray, x) -> int | None:
        """How many of the array's positions the bucket takes: the window, unless the array holds no more (a
        sliding layer's ring, every position of it) or is kept per row (none: the whole row)."""
        if spec.positions is None or window is None or window >= x.shape[spec.positions]:
            return None
        return window

    def take_cache(cache: KVCache) -> KVCache:
        layers = cache.map_layers(lambda spec, x: take_rows(x, live, narrowed(spec, x), spec.positions or 0))
        return cache.replace(layers=layers, lengths=take_rows(cache.lengths, live), capacity=window or cache.capacity)

    def put_cache(cache: KVCache, part: KVCache) -> KVCache:
        layers = cache.map_layers(lambda spec, x, new: put_rows(x, live, new, narrowed(spec, x), spec.positions or 0),
                                  part)
        return cache.replace(layers=layers, lengths=put_rows(cache.lengths, live, part.lengths))

    def run(compact: DecodeState) -> tuple[DecodeState, Int[Array, ""]]:
        return decode_loop(graphdef, params, compact, key, sampling, max_steps, sharding, lambda s: s.cache.capacity)

    return decode_live(run, state, live, take_cache, put_cache)
