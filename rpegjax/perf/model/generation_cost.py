"""Response lengths with a long tail, and the time of a decode loop over them with a KV-capacity-limited slot count.

The decode loop is simulated step by step on one data-parallel replica (vectorised with numpy): a step's time
is the larger of its compute time and its memory time (roofline) plus a fixed part (kernel launches, tensor-
parallel latency), with

    compute(a, K) = flops_per_row · a + flops_per_key · K      (seconds, a rows, K attended keys in total)
    memory(a, K)  = bytes_fixed + bytes_per_row · a + bytes_per_key · K

where a and K depend on the decode kernel: STATIC processes every slot over the whole capacity each step,
PAGED only the active sequences and their written keys, LIVE (rpegjax's sampler with live buckets) the active
sequences padded to a power of two, each over a window of the longest active sequence's length rounded up to a
power of two (at most the capacity), LIVE_PAGED (live buckets, the Pallas paged kernel) LIVE's rows and each active
row's own keys, rounded up to the kernel's block of `KERNEL_BLOCK_TOKENS` (half a block per row on average; padding
rows read none). Sequences enter free slots in queue order
(continuous batching) or in fixed batches of `slots` that end with their longest member (static batching).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import heapq
import math
from statistics import NormalDist

import numpy as np

from rpegjax.perf.model.costs import DecodeKernel

# keys the Pallas paged kernel loads per inner iteration (`generate.paged_attention.PAGES_PER_BLOCK` pages of the
# default 16 tokens): a row's reads are its length rounded up to it
KERNEL_BLOCK_TOKENS = 128


class LengthDistribution(enum.StrEnum):
    FIXED = "fixed"  # every response has `max` tokens (EOS ignored), as in W-small
    LOGNORMAL = "lognormal"  # log-normal with the given mean, clipped to `max`


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResponseLengths:
    """New tokens per response. LOGNORMAL: log-normal with shape `sigma`, clipped to [1, max], whose clipped mean
    is `mean` (sigma 1.0 is an assumption: a long tail where ~3% of responses of mean 4k reach 16k)."""

    max: int
    mean: float | None = None
    distribution: LengthDistribution = LengthDistribution.FIXED
    sigma: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "distribution", LengthDistribution(self.distribution))
        if not isinstance(self.max, int) or self.max < 1:
            raise ValueError(f"ResponseLengths.max must be a positive integer, got {self.max!r}")
        if self.distribution is LengthDistribution.LOGNORMAL:
            if self.mean is None or not 1 <= self.mean < self.max:
                raise ValueError(f"ResponseLengths.mean must be in [1, max={self.max}) for a log-normal, got {self.mean!r}")
            if self.sigma <= 0:
                raise ValueError(f"ResponseLengths.sigma must be positive, got {self.sigma!r}")

    @classmethod
    def fixed(cls, tokens: int) -> ResponseLengths:
        return cls(max=tokens, mean=float(tokens), distribution=LengthDistribution.FIXED)

    @classmethod
    def lognormal(cls, mean: float, max_tokens: int, sigma: float = 1.0) -> ResponseLengths:
        return cls(max=max_tokens, mean=mean, distribution=LengthDistribution.LOGNORMAL, sigma=sigma)

    def sample(self, count: int) -> np.ndarray:
        """`count` lengths at the distribution's quantiles (i + 0.5)/count, ascending (deterministic)."""
        if count < 1:
            raise ValueError(f"ResponseLengths.sample: count must be >= 1, got {count!r}")
        return _quantile_lengths(self, count).copy()

    def expected_mean(self, count: int = 4096) -> float:
        return float(self.sample(count).mean())


@functools.lru_cache(maxsize=256)
def _quantile_lengths(lengths: ResponseLengths, count: int) -> np.ndarray:
    if lengths.distribution is LengthDistribution.FIXED:
        return np.full(count, lengths.max, dtype=np.int64)
    normal = NormalDist()
    z = np.array([normal.inv_cdf((i + 0.5) / count) for i in range(count)])

    def clipped(mu: float) -> np.ndarray:
        return np.clip(np.exp(mu + lengths.sigma * z), 1, lengths.max)

    low, high = -10.0, math.log(lengths.max) + 10.0  # the clipped mean increases with mu: bisect for `mean`
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if clipped(mid).mean() < lengths.mean else (low, mid)
    return np.maximum(np.rint(clipped(0.5 * (low + high))), 1).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeStepCost:
    """Coefficients of one decode step's roofline on one replica (seconds and bytes/seconds folded in)."""

    seconds_per_row: float  # compute seconds per processed row (matmuls + logits)
    seconds_per_key: float  # compute seconds per attended key
    memory_seconds_fixed: float  # reading the weights
    memory_seconds_per_row: float
    memory_seconds_per_key: float  # reading one key/value from the cache
    fixed_seconds: float  # kernel launches and collective latency per step
    prefill_seconds: float  # prefill of one prompt
    # a mixture-of-experts model's expert weights: reading all of a device's local experts once, and the chance
    # that one row leaves a given expert unpicked; a step of r rows reads the (1 - miss^r) share its rows hit
    expert_memory_seconds: float = 0.0
    expert_miss: float = 1.0
    # collectives' bytes per processed row (tensor all-reduces of the rows' activations, a MoE model's expert
    # dispatch and combine), after the roofline
    comm_seconds_per_row: float = 0.0

    def memory_seconds(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Memory time of decode steps of `rows` processed rows attending to `keys` keys."""
        experts = self.expert_memory_seconds * (1.0 - self.expert_miss ** np.asarray(rows, dtype=np.float64))
        return self.memory_seconds_fixed + experts + self.memory_seconds_per_row * rows + self.memory_seconds_per_key * keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeTimeline:
    """Result of simulating one replica's decode loop."""

    seconds: float  # whole loop, prefills included
    finish_seconds: np.ndarray  # per sequence, in queue order
    steps: int
    mean_active: float  # average active sequences per step
    mean_rows: float  # average rows the kernel processes per step (active or not)
    mean_keys: float  # average cached keys the kernel reads per step (of padding rows and windows too)
    mean_live_keys: float  # average keys of the active rows' own contexts per step (what decoding needs)
    slots: int  # the replica's slots (`mean_active / slots`: how busy they are)
    compute_bound_fraction: float  # share of steps whose compute time exceeds memory time


def _schedule(lengths: np.ndarray, slots: int, continuous: bool) -> tuple[np.ndarray, np.ndarray]:
    starts = np.zeros(len(lengths), dtype=np.int64)
    if continuous:
        free = [0] * min(slots, len(lengths))
        heapq.heapify(free)
        for i, length in enumerate(lengths):
            starts[i] = heapq.heappop(free)
            heapq.heappush(free, int(starts[i] + length))
    else:
        start = 0
        for first in range(0, len(lengths), slots):
            batch = slice(first, first + slots)
            starts[batch] = start
            start += int(lengths[batch].max())
    return starts, starts + lengths


def running_sums(starts: np.ndarray, ends: np.ndarray, values: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """For each step t < `steps`: how many intervals [start, end) hold t, and the sum of their `values`."""
    active, total = np.zeros(steps + 1), np.zeros(steps + 1)
    np.add.at(active, starts, 1.0)
    np.add.at(active, ends, -1.0)
    np.add.at(total, starts, values.astype(np.float64))
    np.add.at(total, ends, -values.astype(np.float64))
    return np.cumsum(active)[:steps], np.cumsum(total)[:steps]


def simulate_decode(lengths: np.ndarray, *, slots: int, prompt: int, capacity: int, kernel: DecodeKernel | str,
                    continuous: bool, cost: DecodeStepCost) -> DecodeTimeline:
    """Time of decoding `lengths` (queue order) through `slots` KV-cache slots of `capacity` tokens each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if slots < 1:
        raise ValueError(f"simulate_decode: slots must be >= 1 (KV cache holds no sequence), got {slots!r}")
    starts, ends = _schedule(lengths, slots, continuous)
    steps = int(ends.max())
    active, start_sum = running_sums(starts, ends, starts, steps)
    t = np.arange(steps, dtype=np.float64)
    live_keys = active * (prompt + t + 1) - start_sum  # each active row attends to its prompt and tokens so far
    kernel = DecodeKernel(kernel)
    if kernel is DecodeKernel.STATIC:
        busy_slots = min(slots, len(lengths))
        rows = np.full(steps, float(busy_slots))
        keys = rows * capacity
    elif kernel is DecodeKernel.LIVE:
        rows = np.minimum(float(min(slots, len(lengths))), _pow2_at_least(active))
        keys = rows * np.minimum(float(capacity), _pow2_at_least(prompt + t + 1 - _oldest_active_start(starts, ends)))
    else:
        rows, keys = active, live_keys
        if kernel is DecodeKernel.LIVE_PAGED:
            rows = np.minimum(float(min(slots, len(lengths))), _pow2_at_least(active))
            keys = keys + active * KERNEL_BLOCK_TOKENS / 2
    compute = cost.seconds_per_row * rows + cost.seconds_per_key * keys
    memory = cost.memory_seconds(rows, keys)
    step_seconds = np.maximum(compute, memory) + cost.fixed_seconds + cost.comm_seconds_per_row * rows
    prefill = np.zeros(steps)
    np.add.at(prefill, starts, cost.prefill_seconds)
    elapsed = np.cumsum(step_seconds + prefill)
    return DecodeTimeline(seconds=float(elapsed[-1]), finish_seconds=elapsed[ends - 1], steps=steps,
                          mean_active=float(active.mean()), mean_rows=float(rows.mean()), mean_keys=float(keys.mean()),
                          mean_live_keys=float(live_keys.mean()), slots=min(slots, len(lengths)),
                          compute_bound_fraction=float(np.mean(compute > memory)))


def _pow2_at_least(x: np.ndarray) -> np.ndarray:
    return np.exp2(np.ceil(np.log2(np.maximum(x, 1.0))))


def _oldest_active_start(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per step t, the earliest start of a sequence active at t. Starts are non-decreasing in queue order (both
    schedules), so it is the start of the first sequence not yet ended: the first whose running maximum of ends
    exceeds t (no gaps: some sequence is active at every step before the last end)."""
    steps = int(ends.max())
    first = np.searchsorted(np.maximum.accumulate(ends), np.arange(steps), side="right")
    return starts[first].astype(np.float64)


def replica_lengths(lengths: ResponseLengths, total: int, replicas: int, *, seed: int = 0) -> np.ndarray:
    """The queue of the slowest replica: a stratified 1/replicas share of `total` quantile lengths that holds the
    longest response, in a fixed pseudo-random order (the order requests arrive in)."""
    if replicas < 1 or total < 1:
        raise ValueError(f"replica_lengths: total ({total!r}) and replicas ({replicas!r}) must be >= 1")
    every = lengths.sample(total)
    share = every[::-1][::replicas]  # every replicas-th from the longest down
    return np.random.default_rng(seed).permutation(share)
