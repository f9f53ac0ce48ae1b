"""Host controller of the contiguous sampler: every slot reserves the capacity (`CacheLayout.CONTIGUOUS`).

Per decode chunk the controller (1) admits pending requests into free slots (continuous batching: before every
chunk; static batching: once every slot is free), runs of requests with one number of samples G sharing one
prefill, (2) runs the chunk on the live bucket of the running slots (`live_rows`) over an attention window sized
to the longest running row and (3) fetches to the host only the small per-slot arrays plus the rows of the
sequences that finished.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.generate.completion import FINISH_CODES, Completion, FinishReason, unstarted
from rpegjax.generate.decode import (
    DecodeStalledError,
    DecodeState,
    abstract_state_of,
    admit,
    decode,
    decode_state_shardings,
)
from rpegjax.generate.live_rows import finished_rows, least_busy_first, live_rows, padded_rows
from rpegjax.generate.requests import Request, RequestFeed, RequestQueue
from rpegjax.models.config import ModelConfig
from rpegjax.options import CacheLayout
from rpegjax.sharding.rules import ActivationSharding


class ContiguousController:
    """Compiled functions and host bookkeeping of a contiguous sampler (built by `Sampler`)."""

    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, *, num_slots: int, replicas: int,
                 max_prompt_len: int, max_new_tokens: int, chunk_steps: int, window_step: int, stats,
                 mesh: Mesh | None, activation: ActivationSharding | None, params_sharding, live_buckets: bool,
                 record_routing: bool = False):
        self.num_slots = num_slots
        self.live_buckets = live_buckets
        self.replicas = replicas
        self.max_prompt_len = max_prompt_len
        self.capacity = max_prompt_len + max_new_tokens
        self.chunk_steps = chunk_steps
        self.window_step = window_step
        self.stats = stats
        self._empty = partial(DecodeState.empty, cfg, num_slots, self.capacity, max_new_tokens,
                              record_routing=record_routing)

        def admit_fn(group_size, *arrays):  # group size positional: jit takes no kwargs with in_shardings
            return admit(graphdef, *arrays, group_size=group_size, sharding=activation)

        def decode_fn(window, *arrays):  # the attention window is static: one program per window size
            return decode(graphdef, *arrays, window=window, sharding=activation)

        self._state_sharding = None
        if mesh is None:
            self._admit = jax.jit(admit_fn, static_argnums=(0,), donate_argnums=(2,))
            self._decode = jax.jit(decode_fn, static_argnums=(0,), donate_argnums=(2,))
            self._build_state = jax.jit(self._empty)
            self._rows = jax.jit(finished_rows)
            return
        self._state_sharding = state_sharding = decode_state_shardings(jax.eval_shape(self._empty), activation)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._admit = jax.jit(
            admit_fn,
            static_argnums=(0,),
            # a few small host arrays per admit (their row count varies with the bucket): replicated
            in_shardings=(params_sharding, state_sharding) + (replicated,) * 8,
            out_shardings=state_sharding,
            donate_argnums=(2,),
        )
        self._decode = jax.jit(
            decode_fn,
            static_argnums=(0,),
            in_shardings=(params_sharding, state_sharding) + (replicated,) * 4,
            out_shardings=(state_sharding, replicated),
            donate_argnums=(2,),
        )
        self._build_state = jax.jit(self._empty, out_shardings=state_sharding)
        # a mesh spanning processes splits slots across them: `_fetch` replicates what it reads first
        self._replicate = jax.jit(lambda values: values, out_shardings=replicated)
        # the rows of finished sequences only, replicated so that every process can read them
        self._rows = jax.jit(finished_rows, out_shardings=replicated)

    def compile_counts(self) -> dict[str, int]:
        return {"admit": self._admit._cache_size(), "decode": self._decode._cache_size()}

    def new_state(self) -> DecodeState:
        return self._build_state()

    # ---- lowering ahead of time ----------------------------------------------------------------------
    def abstract_state(self) -> DecodeState:
        """The decode state's shapes and dtypes with its shardings (nothing allocated)."""
        return abstract_state_of(self._empty, self._state_sharding)

    def lower_programs(self, params, state, key, arrays, *, max_prompt_len: int, group_size: int
                       ) -> dict[str, jax.stages.Lowered]:
        """`prefill` and `decode` lowered at the largest shapes `run` gives them (`Sampler.lower_programs`): every
        group's prompts at once, `max_prompt_len` wide, and a decode chunk attending to the whole capacity."""
        prefill = self._admit.lower(group_size, params, state, *self._admit_arrays(
            self._admit_bucket(self.num_slots // group_size, group_size), max_prompt_len, group_size), key, arrays)
        every = live_rows([], num_slots=self.num_slots, replicas=self.replicas, compact=False)
        decode = self._decode.lower(self.capacity, params, state, every, key, arrays, np.int32(self.chunk_steps))
        return {"prefill": prefill, "decode": decode}

    # ---- admission -----------------------------------------------------------------------------------
    def _admit_requests(self, params, state, requests, indices, slots, key, arrays):
        """Prefills requests[indices] (one number of samples G) once each into `slots` (G consecutive slots per
        request). The prefill is max_prompt_len wide, or the capacity when a context (a later turn) is longer."""
        group_size = requests[indices[0]].samples
        n = len(indices)
        width = self.max_prompt_len if max(requests[i].size for i in indices) <= self.max_prompt_len else self.capacity
        tokens, lengths, slot_ids, key_index, sample_index, row_budgets = self._admit_arrays(
            self._admit_bucket(n, group_size), width, group_size)
        for row, index in enumerate(indices):
            tokens[row, : requests[index].size] = requests[index].tokens
            lengths[row] = requests[index].size
        slot_ids[: n * group_size] = slots
        key_index[: n * group_size] = np.repeat([requests[i].key_index for i in indices], group_size)
        sample_index[: n * group_size] = (np.repeat([requests[i].first_sample for i in indices], group_size)
                                          + np.tile(np.arange(group_size), n))
        row_budgets[: n * group_size] = np.repeat([requests[i].budget for i in indices], group_size)
        self.stats.prefill_calls += 1
        self.stats.prefilled_prompts += n
        return self._admit(group_size, params, state, tokens, lengths, slot_ids, key_index, sample_index,
                           row_budgets, key, arrays)

    def _admit_bucket(self, prompts: int, group_size: int) -> int:
        """Prompt rows of one admit of `prompts` prompts: a power of two up to the groups the slots hold (few
        shapes), a multiple of the slot replicas (prompt rows split over them too)."""
        bucket = min(1 << (prompts - 1).bit_length(), self.num_slots // group_size)
        return -(-bucket // self.replicas) * self.replicas

    def _admit_arrays(self, bucket: int, width: int, group_size: int) -> tuple[np.ndarray, ...]:
        """The host arrays of one admit, padded: tokens [bucket, width], lengths [bucket], then per sample row
        slot ids (past the end: dropped), key index, sample index and budget."""
        rows = bucket * group_size
        return (np.zeros((bucket, width), np.int32), np.ones((bucket,), np.int32),
                np.full((rows,), self.num_slots, np.int32), np.zeros((rows,), np.int32), np.zeros((rows,), np.int32),
                np.ones((rows,), np.int32))

    def _admit_pending(self, params, state, requests: list[Request], pending, owners, cache_length, key, arrays):
        """Admits pending requests into the free slots, in order, runs of one number of samples at a time (one
        compiled admit per group size), until the next request's group does not fit. Free slots are taken from the
        least busy slot replica first (`least_busy_first`: a group's samples may land on several)."""
        free = least_busy_first([slot for slot, owner in enumerate(owners) if owner is None],
                                [slot for slot, owner in enumerate(owners) if owner is not None],
                                num_slots=self.num_slots, replicas=self.replicas)
        while pending:
            group_size = requests[pending[0]].samples
            admitted = []
            while pending and requests[pending[0]].samples == group_size and (
                    len(admitted) + 1) * group_size <= len(free):
                admitted.append(pending.popleft())
            if not admitted:
                break
            slots, free = free[: len(admitted) * group_size], free[len(admitted) * group_size:]
            state = self._admit_requests(params, state, requests, admitted, slots, key, arrays)
            for i, slot in enumerate(slots):
                owners[slot] = (admitted[i // group_size], i % group_size)
                cache_length[slot] = requests[owners[slot][0]].size  # the first token is not cached yet
        return state

    # ---- decoding ------------------------------------------------------------------------------------
    def _window(self, longest: int) -> int:
        """Cache positions a chunk attends to: enough for the longest running row to take every step of
        the chunk, `window_step` times a power of two (at most 2 + log2(capacity / window_step) compiled
        sizes), at most the capacity."""
        steps = -(-(longest + self.chunk_steps) // self.window_step)
        return min(self.capacity, self.window_step * (1 << (steps - 1).bit_length()))

    def _decode_chunk(self, params, state, key, arrays, window: int, running: list[int]):
        """One chunk over the running slots' live bucket (every slot without live buckets)."""
        live = live_rows(running, num_slots=self.num_slots, replicas=self.replicas, compact=self.live_buckets)
        state, steps = self._decode(window, params, state, live, key, arrays, np.int32(self.chunk_steps))
        return state, steps, live

    def _fetch(self, state: DecodeState):
        """The small per-slot arrays: done, num_generated, finish."""
        values = (state.done, state.num_generated, state.finish)
        if not all(value.is_fully_addressable for value in values):  # other processes hold some slots
            values = self._replicate(values)  # one program for the three arrays; then every process reads all
        return jax.device_get(values)

    def _fetch_lengths(self, state: DecodeState) -> np.ndarray:
        """Every slot's cache length (only to explain a stalled chunk)."""
        lengths = state.cache.lengths
        return jax.device_get(lengths if lengths.is_fully_addressable else self._replicate(lengths))

    # ---- the controller ----------------------------------------------------------------------------
    def run(self, params, requests: list[Request], arrays, key: jax.Array, version, *, continuous: bool,
            feed: RequestFeed | None = None, interrupt: Callable[[], bool] | None = None,
            tally=None) -> Iterator[Completion]:
        """Serves `requests`, and those `feed` adds before each chunk (blocking on `feed.wait()` when idle).
        Continuous: refill free slots before every chunk. Static: refill only once every slot is free (each batch
        waits for its slowest sequence). `interrupt()` is asked before each chunk: once True, every running and
        pending sequence is handed out as a `PARTIAL` completion (its tokens so far) and the run ends. `tally`: a
        `SamplerStats` that also counts this call's decode chunks."""
        queue = RequestQueue(requests, lambda index, _: index)
        requests, pending = queue.requests, queue.pending  # grown in place as the feed adds requests
        owners: list[tuple[int, int] | None] = [None] * self.num_slots
        cache_length = np.zeros(self.num_slots, np.int64)  # per running slot: context + response tokens cached
        state = self.new_state()
        while True:
            if interrupt is not None and interrupt():
                yield from self._interrupted(state, requests, owners, pending, version)
                return
            if not queue.refill(feed, idle=all(o is None for o in owners)):
                return
            if continuous or all(o is None for o in owners):
                state = self._admit_pending(params, state, requests, pending, owners, cache_length, key, arrays)
            running = [slot for slot, owner in enumerate(owners) if owner is not None]
            if not running:
                raise ValueError(f"sampler: request {pending[0]} ({requests[pending[0]].samples} samples) cannot "
                                 f"start in {self.num_slots} slots")
            before = int(cache_length[running].sum())
            window = self._window(int(cache_length[running].max()))
            state, steps, live = self._decode_chunk(params, state, key, arrays, window, running)
            done, num_generated, finish = self._fetch(state)
            steps = int(steps)
            for slot in running:
                cache_length[slot] = requests[owners[slot][0]].size + int(num_generated[slot]) - 1
            for stats in (self.stats, tally)[: 1 + (tally is not None)]:
                stats.record_chunk(steps, window=window, bucket=live.shape[1], rows=live.size, slots=self.num_slots,
                                   live_tokens=int(cache_length[running].sum()) - before)
            self.stats.record_memory(steps, reserved=self.num_slots * self.capacity,
                                     cached=(before + int(cache_length[running].sum())) / 2)
            finished = [slot for slot in running if done[slot]]
            if steps == 0 and not finished:
                lengths = self._fetch_lengths(state)
                raise DecodeStalledError.describe(CacheLayout.CONTIGUOUS, self.stats.decode_calls, running, done,
                                                  lengths, np.full(self.num_slots, window))
            if finished:
                yield from self._hand_out(state, requests, owners, finished, num_generated, finish, version)

    def _interrupted(self, state, requests, owners, pending, version) -> Iterator[Completion]:
        """Every running sequence's tokens so far and every pending one (none), as `PARTIAL` completions."""
        running = [slot for slot, owner in enumerate(owners) if owner is not None]
        if running:
            _, num_generated, _ = self._fetch(state)
            yield from self._hand_out(state, requests, owners, running, num_generated, None, version,
                                      FinishReason.PARTIAL)
        for index in pending:
            for sample in range(requests[index].samples):
                yield unstarted(index, sample, requests[index].tokens, version)

    def _hand_out(self, state, requests, owners, finished, num_generated, finish, version,
                  reason: FinishReason | None = None) -> Iterator[Completion]:
        """Completions of the `finished` slots, which become free (`reason`: instead of the finish codes). Only
        their rows come back: tokens, log-probs and (when recorded) routing in one program."""
        tokens, logprobs, routing = jax.device_get(
            self._rows(state.tokens, state.logprobs, state.routing, padded_rows(finished, self.num_slots)))
        for row, slot in enumerate(finished):
            (index, sample), n = owners[slot], int(num_generated[slot])
            size = requests[index].size
            owners[slot] = None
            yield Completion(prompt_index=index, sample_index=sample,
                             prompt_ids=requests[index].tokens.copy(),  # each completion owns its arrays
                             response_ids=np.array(tokens[row, :n]), behaviour_logprobs=np.array(logprobs[row, :n]),
                             finish_reason=reason or FINISH_CODES[int(finish[slot])], version=version,
                             expert_ids=None if routing is None else np.array(routing[row, :size + n]))
