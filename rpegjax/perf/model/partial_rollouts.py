"""Partial rollouts in the performance model: generation that runs continuously over more groups than a step
trains, as `rpegjax.runtime.partial_rollouts` runs it, simulated step after step on one generation replica.

A replica keeps `inflight_batches` x its share of a step's groups in flight (`PartialSchedule`). Each step serves
them in pool order (groups carried from earlier steps first, then new prompts), admitting requests into free
slots before every decode chunk (a group never started is one request of all its samples, which needs that many
free slots at once; a started sample is a request of its own); the step ends at the first chunk boundary where
its share of complete groups is there and every *due* group is complete (the runtime's `StalePolicy.WAIT`). The
sequences still decoding are carried: their tokens stay, and they continue at a later step either by
*re-prefilling* prompt + prefix under the newer weights (`carry_pages` False: the runtime's `carry=recompute`) or
from their KV pages kept in the pool (`carry_pages`: `carry=pages`, no prefill; the kept pages' memory through
the training step is not costed here). A group whose first tokens were sampled at step t0 is due at step
t0 + `max_token_lag` - k (k the asynchrony bound: new tokens lag by k, so a trained token lags at most
`max_token_lag` versions). The batch takes due groups first, then the others in order of completion.

Per step the simulation gives the decode steps, the rows decoded and live (slot occupancy), the generation time
(the decode-step roofline of `rpegjax.perf.model.generation_cost` plus each admitted sequence's prefill of its context),
the sequences carried into the trained batch, the tokens re-prefilled and the version lag of the trained tokens.
`steady_state` averages measured steps after warm-up steps, with new groups' lengths drawn from the workload's
length distribution (a replica's random share of every step: the batch takes the first complete groups, so the
replicas' tails even out); `tests/perf/model/test_partial_rollout_model.py` checks the per-step counts against what the
runtime's sampler counts (`SamplerStats`) on the same sequence lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable

import numpy as np

from rpegjax.perf.model.costs import DecodeKernel
from rpegjax.perf.model.generation_cost import (
    KERNEL_BLOCK_TOKENS,
    DecodeStepCost,
    ResponseLengths,
    _pow2_at_least,
    running_sums,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialSchedule:
    """One replica's partial rollouts: `groups_per_step` groups of `group_size` trained per step,
    `inflight_batches` times as many in flight, `slots` decode slots of `capacity` tokens, prompts of `prompt`
    tokens, admission and interruption every `chunk` decode steps; a trained token lags at most `max_token_lag`
    weights versions, new ones `async_bound`; `carry_pages`: carried sequences continue from kept KV pages
    instead of a prefill of their context."""

    group_size: int
    groups_per_step: int
    inflight_batches: int
    max_token_lag: int
    async_bound: int
    slots: int
    prompt: int
    capacity: int
    chunk: int = 1
    carry_pages: bool = False  # carried sequences keep their KV pages: no re-prefill

    def __post_init__(self) -> None:
        for name in ("group_size", "groups_per_step", "slots", "prompt", "capacity", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"PartialSchedule.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.inflight_batches < 2:
            raise ValueError(f"PartialSchedule.inflight_batches must be >= 2, got {self.inflight_batches!r}")
        if self.max_token_lag <= self.async_bound:
            raise ValueError(f"PartialSchedule.max_token_lag ({self.max_token_lag}) must exceed the asynchrony bound "
                             f"({self.async_bound})")
        if self.group_size > self.slots:
            raise ValueError(f"PartialSchedule: a group of {self.group_size} cannot start in {self.slots} slots")

    @property
    def carries(self) -> int:
        """Steps after its first one that a group may still be generated in (it is due at the last)."""
        return self.max_token_lag - self.async_bound


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillCost:
    """Seconds of one prefill of `n` context tokens: fixed (the last token's logits) + per token + per attended
    pair (n(n+1)/2 pairs, or n x capacity with dense attention: `dense_width`)."""

    seconds_fixed: float
    seconds_per_token: float
    seconds_per_pair: float
    dense_width: int | None = None

    def seconds(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.float64)
        pairs = tokens * (self.dense_width if self.dense_width is not None else (tokens + 1) / 2)
        return self.seconds_fixed + self.seconds_per_token * tokens + self.seconds_per_pair * pairs


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """One simulated step of a replica (sums over its decode steps)."""

    decode_steps: int
    seconds: float
    live_row_steps: float  # running sequences x steps
    decoded_row_steps: float  # rows the kernel processes x steps (live buckets)
    live_key_steps: float  # the running sequences' own context keys x steps
    decoded_key_steps: float  # cached keys the kernel reads x steps
    compute_bound_steps: int
    decoded_tokens: int
    trained_tokens: int
    carried_sequences: int  # trained sequences with tokens sampled at earlier steps
    reprefill_tokens: int  # context tokens prefilled again for sequences carried into this step
    lag_token_sum: float  # over trained tokens: weights versions each lags the trainer
    lag_max: int
    dropped_groups: int
    finish_fractions: tuple[float, ...]  # when each trained group completed, as a fraction of the step


@dataclasses.dataclass(eq=False)
class _Group:
    lengths: np.ndarray  # int [g] each sample's whole response length
    done: np.ndarray  # int [g] tokens sampled so far
    first: int | None = None  # the step of its first tokens
    tokens_by_step: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return bool((self.done >= self.lengths).all())


class PartialSimulation:
    """The groups in flight on one replica, stepped as the runtime steps them. `new_group()` gives the next new
    prompt's `group_size` response lengths (queue order)."""

    def __init__(self, schedule: PartialSchedule, new_group: Callable[[], np.ndarray], *, kernel: DecodeKernel | str,
                 cost: DecodeStepCost, prefill: PrefillCost):
        self.schedule, self.new_group, self.kernel = schedule, new_group, DecodeKernel(kernel)
        self.cost, self.prefill = cost, prefill
        self.pool: list[_Group] = []
        self.step_index = 0

    def _fill(self) -> None:
        """Tops the pool up with new prompts a step's batch at a time (as the runtime takes them)."""
        s = self.schedule
        while len(self.pool) < s.inflight_batches * s.groups_per_step:
            for _ in range(s.groups_per_step):
                lengths = np.minimum(np.asarray(self.new_group(), dtype=np.int64), s.capacity - s.prompt)
                self.pool.append(_Group(lengths=lengths, done=np.zeros_like(lengths)))

    def _admissions(self) -> tuple[list[tuple[_Group, np.ndarray]], np.ndarray]:
        """(group and samples of each request, in pool order; each request's start step): requests enter in order
        as soon as as many slots as their samples are free at a chunk boundary."""
        s = self.schedule
        requests = []
        for group in self.pool:
            unfinished = np.flatnonzero(group.done < group.lengths)
            if not len(unfinished):
                continue
            if group.first is None:
                requests.append((group, unfinished))
            else:
                requests.extend((group, unfinished[j:j + 1]) for j in range(len(unfinished)))
        free = [0] * s.slots
        starts, previous = np.zeros(len(requests), dtype=np.int64), 0
        for index, (group, samples) in enumerate(requests):
            ready = max(heapq.heappop(free) for _ in range(len(samples)))
            start = max(previous, -(-ready // s.chunk) * s.chunk)
            starts[index] = previous = start
            for occupied in _occupied(group.lengths[samples] - group.done[samples]):
                heapq.heappush(free, int(start + occupied))
        return requests, starts

    def _end_step(self, requests, starts, due: list[_Group]) -> tuple[int, dict[int, int]]:
        """(the step's last decode step, each group's completion step) where the step stops: its share of
        complete groups there and every due group complete, rounded up to a chunk boundary."""
        s = self.schedule
        completion = {id(g): 0 for g in self.pool if g.complete}
        for (group, samples), start in zip(requests, starts, strict=True):
            end = int(start + _occupied(group.lengths[samples] - group.done[samples]).max())
            completion[id(group)] = max(completion.get(id(group), 0), end)
        need = sorted(completion[id(g)] for g in self.pool)[s.groups_per_step - 1]
        stop = max([need] + [completion[id(g)] for g in due])
        return -(-stop // s.chunk) * s.chunk, completion

    def step(self) -> StepOutcome:
        """Generates one step (filling the pool first) and takes its batch; returns its counts."""
        s, step = self.schedule, self.step_index
        self._fill()
        due = [g for g in self.pool if g.first is not None and step - g.first >= s.carries]
        requests, starts = self._admissions()
        stop, completion = self._end_step(requests, starts, due)
        intervals, reprefill, decoded = [], 0, 0
        for (group, samples), start in zip(requests, starts, strict=True):
            if start >= stop:
                continue
            prefix = group.done[samples].copy()
            # the prefill samples the first token, each decode step one more
            ends = np.minimum(start + group.lengths[samples] - prefix - 1, stop)
            reprefill += 0 if s.carry_pages else int(prefix.sum())
            intervals += [(start, int(end), start - int(p) - 1) for end, p in zip(ends, prefix, strict=True)]
            group.done[samples] = prefix + 1 + (ends - start)
            tokens = int((ends - start + 1).sum())
            decoded += tokens
            group.tokens_by_step[step] = group.tokens_by_step.get(step, 0) + tokens
            group.first = step if group.first is None else group.first
        timeline = self._timeline(np.array(intervals, dtype=np.int64).reshape(-1, 3), stop)
        due_ids = {id(g) for g in due}
        ready = [g for g in self.pool if g.complete]
        ready.sort(key=lambda g: (id(g) not in due_ids, completion[id(g)]))
        batch = ready[:s.groups_per_step]
        chosen = {id(g) for g in batch}
        remaining = [g for g in self.pool if id(g) not in chosen]
        self.pool = [g for g in remaining if g.first is None or step - g.first < s.carries]
        self.step_index += 1
        return self._outcome(timeline, batch, step, decoded=decoded, reprefill=reprefill,
                             dropped=len(remaining) - len(self.pool),
                             finished=[completion[id(g)] for g in batch], stop=stop)

    def _outcome(self, timeline: dict, batch: list[_Group], step: int, *, decoded: int, reprefill: int, dropped: int,
                 finished: list[int], stop: int) -> StepOutcome:
        lags = [(step - u + self.schedule.async_bound, n) for g in batch for u, n in g.tokens_by_step.items()]
        carried = sum(int((g.done > 0).sum()) for g in batch if g.first is not None and g.first < step)
        fractions = tuple(sorted(f / stop for f in finished)) if stop else tuple(1.0 for _ in finished)
        return StepOutcome(
            decode_steps=stop, decoded_tokens=decoded, trained_tokens=sum(int(g.lengths.sum()) for g in batch),
            carried_sequences=carried, reprefill_tokens=reprefill, lag_token_sum=float(sum(lag * n for lag, n in lags)),
            lag_max=max((lag for lag, n in lags if n), default=0), dropped_groups=dropped, finish_fractions=fractions,
            **timeline)

    def _timeline(self, intervals: np.ndarray, stop: int) -> dict:
        """Seconds and row counts of the step's decode steps [0, stop): `intervals` rows (start, end, virtual start
        = start - prefix) of every admitted sequence."""
        s, cost = self.schedule, self.cost
        starts, ends, virtual = intervals[:, 0], intervals[:, 1], intervals[:, 2]
        contexts = s.prompt + starts - virtual - 1  # prompt + the prefix a carried sequence had
        prefilled = contexts == s.prompt if s.carry_pages else np.ones(len(contexts), bool)  # kept: no prefill
        prefill = float(self.prefill.seconds(contexts[prefilled]).sum())
        if stop == 0:
            return dict(seconds=prefill, live_row_steps=0.0, decoded_row_steps=0.0, live_key_steps=0.0,
                        decoded_key_steps=0.0, compute_bound_steps=0)
        active, virtual_sum = running_sums(starts, ends, virtual, stop)
        t = np.arange(stop, dtype=np.float64)
        chunk_start = (np.arange(stop) // s.chunk) * s.chunk
        live_keys = active * (s.prompt + t + 1) - virtual_sum
        if self.kernel is DecodeKernel.STATIC:
            rows = np.full(stop, float(s.slots))
            keys = rows * s.capacity
        elif self.kernel is DecodeKernel.LIVE:
            oldest = np.full(stop, np.inf)
            for start, end, v in intervals:
                oldest[start:end] = np.minimum(oldest[start:end], v)
            longest = s.prompt + chunk_start + s.chunk - oldest[chunk_start]
            rows = np.minimum(float(s.slots), _pow2_at_least(active[chunk_start]))
            keys = rows * np.minimum(float(s.capacity), _pow2_at_least(np.where(np.isfinite(longest), longest, 1.0)))
        else:
            rows, keys = active, live_keys
            if self.kernel is DecodeKernel.LIVE_PAGED:  # LIVE's padded rows, each active row's own keys
                rows = np.minimum(float(s.slots), _pow2_at_least(active[chunk_start]))
                keys = keys + active * KERNEL_BLOCK_TOKENS / 2
        compute = cost.seconds_per_row * rows + cost.seconds_per_key * keys
        memory = cost.memory_seconds(rows, keys)
        step = np.maximum(compute, memory) + cost.fixed_seconds + cost.comm_seconds_per_row * rows
        seconds = float(step.sum()) + prefill
        return dict(seconds=seconds, live_row_steps=float(active.sum()), decoded_row_steps=float(rows.sum()),
                    live_key_steps=float(live_keys.sum()), decoded_key_steps=float(keys.sum()),
                    compute_bound_steps=int((compute > memory).sum()))


def _occupied(remaining: np.ndarray) -> np.ndarray:
    """Decode steps a sequence with `remaining` tokens to go holds its slot once admitted: the prefill samples
    its first token, and one that ends there still holds its slot until the chunk after its admission ends."""
    return np.maximum(remaining - 1, 1)


def drawn_groups(lengths: ResponseLengths, group_size: int, *, seed: int = 0) -> Callable[[], np.ndarray]:
    """New groups' response lengths drawn at random from `lengths`' quantiles (deterministic in `seed`)."""
    table, rng = lengths.sample(4096), np.random.default_rng(seed)
    return lambda: rng.choice(table, size=group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialSteadyState:
    """Means per step over the measured steps of `steady_state`."""

    seconds: float
    decode_steps: float
    mean_active: float  # running sequences per decode step
    mean_rows: float  # rows decoded per decode step
    mean_keys: float  # cached keys read per decode step
    mean_live_keys: float  # of them, the running sequences' own contexts
    slot_busy: float  # mean_active / slots
    compute_bound_fraction: float
    decoded_tokens: float
    trained_tokens: float
    carried_sequences: float
    reprefill_tokens: float
    lag_mean: float  # token-weighted weights-version lag of the trained tokens
    lag_max: int
    dropped_groups: float
    finish_fractions: tuple[float, ...]  # of the last measured step


# steps `drawn_steady_state` averages: a step of a replica trains few groups (W-plan 7B on 64 replicas: 8), whose
# longest members set its length, so 8 steps left a sampling error of ~4% of the generate stage (sd over seeds),
# larger than what the planner's slot counts change; 64 steps take it to ~1%
# (`benchmarks/bench_slot_counts.py --seeds 0,1,2,3`)
MEASURED_STEPS = 64


def steady_state(simulation: PartialSimulation, *, warmup: int = 4, measured: int = MEASURED_STEPS) -> PartialSteadyState:
    """Runs `warmup` steps (the pool fills with carried groups), then averages `measured` steps."""
    for _ in range(warmup):
        simulation.step()
    outcomes = [simulation.step() for _ in range(measured)]
    total = lambda name: float(sum(getattr(o, name) for o in outcomes))
    steps = max(total("decode_steps"), 1.0)
    trained = max(total("trained_tokens"), 1.0)
    return PartialSteadyState(
        seconds=total("seconds") / measured, decode_steps=total("decode_steps") / measured,
        mean_active=total("live_row_steps") / steps, mean_rows=total("decoded_row_steps") / steps,
        mean_keys=total("decoded_key_steps") / steps, mean_live_keys=total("live_key_steps") / steps,
        slot_busy=total("live_row_steps") / steps / simulation.schedule.slots,
        compute_bound_fraction=total("compute_bound_steps") / steps, decoded_tokens=total("decoded_tokens") / measured,
        trained_tokens=total("trained_tokens") / measured, carried_sequences=total("carried_sequences") / measured,
        reprefill_tokens=total("reprefill_tokens") / measured, lag_mean=total("lag_token_sum") / trained,
        lag_max=max(o.lag_max for o in outcomes), dropped_groups=total("dropped_groups") / measured,
        finish_fractions=outcomes[-1].finish_fractions)


@functools.lru_cache(maxsize=1024)
def drawn_steady_state(schedule: PartialSchedule, lengths: ResponseLengths, *, kernel: DecodeKernel,
                       cost: DecodeStepCost, prefill: PrefillCost, seed: int = 0,
                       measured: int = MEASURED_STEPS) -> PartialSteadyState:
    """`steady_state` over `measured` steps of a fresh simulation whose new groups are `drawn_groups(lengths,
    schedule.group_size, seed=seed)`: deterministic in its arguments, so remembered (the planner prices the same
    sampler under many training layouts; the simulation is most of a partial plan's prediction)."""
    simulation = PartialSimulation(schedule, drawn_groups(lengths, schedule.group_size, seed=seed), kernel=kernel,
                                   cost=cost, prefill=prefill)
    return steady_state(simulation, measured=measured)


__all__ = ["MEASURED_STEPS", "PartialSchedule", "PartialSimulation", "PartialSteadyState", "PrefillCost", "StepOutcome", "drawn_groups",
           "drawn_steady_state", "steady_state"]
