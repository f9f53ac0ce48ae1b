"""Packed batches as rpegjax's runtime runs them (`Execution.packing`): passes, computed tokens and attention pairs.

The runtime (`rpegjax.learners.packing.plan_packing`) lays sequences first-fit-decreasing into rows of the token
budget B. An update packs each of its M mini-batches (the sequences r with r mod M = j) on its own, gives every
mini-batch the same number of rows R (the most any needs, rounded up to a multiple of the row shards S) and runs
R / S micro-batches of one row per row shard; an inference stage packs each of its pieces the same way (M = 1,
its own R). So, per epoch,

    update passes     = M · ceil(max_j bins_j / S)             inference passes = Σ_pieces ceil(bins_p / S)
    computed tokens   = passes · S · B                         (whole rows: the fill padding is computed too)

The blockwise kernel skips the key blocks before each query block's segment, so a row costs its segments' causal
pairs plus those of its padding tail (one segment of its own, an empty row a whole one); the dense kernel scores
every pair of a row (B² per row). Lengths are the workload's deterministic sample (`ResponseLengths.sample`,
ascending) plus the prompt, dealt to pieces as to mini-batches (i mod pieces).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from rpegjax.perf.model import costs


@dataclasses.dataclass(frozen=True)
class PackedPasses:
    """One epoch of a stage over packed rows, summed over all row shards."""

    passes: int  # forward(/backward) passes: one packed row per row shard each
    tokens: float  # computed tokens, fill padding included (passes x shards x budget)
    pairs: float  # attention (query, key) pairs computed
    rows: int  # packed rows holding at least one sequence


def first_fit_decreasing_fills(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The tokens in each bin after first-fit-decreasing (longest first, each into the first bin with room, ties in
    the items' order), as `rpegjax.learners.packing.first_fit_decreasing` packs them."""
    room = np.zeros(0, np.int64)
    for length in np.sort(np.asarray(lengths, np.int64), kind="stable")[::-1]:
        fits = np.flatnonzero(room >= length)
        if fits.size:
            room[fits[0]] -= length
        else:
            room = np.append(room, capacity - length)
    return capacity - room


@functools.lru_cache(maxsize=256)
def _group_fills(lengths: tuple[int, ...], budget: int, groups: int) -> tuple[np.ndarray, ...]:
    array = np.asarray(lengths, np.int64)
    if array.max() > budget:
        raise ValueError(f"packing: a sequence of {array.max()} tokens does not fit packed rows of {budget} tokens "
                         f"(max_tokens_per_micro_batch; a sequence is never split over rows)")
    return tuple(first_fit_decreasing_fills(array[j::groups], budget) for j in range(groups))


@functools.lru_cache(maxsize=64)
def _lengths(workload) -> tuple[int, ...]:
    return tuple(int(n) for n in workload.prompt_tokens + workload.responses.sample(workload.sequences))


def _pairs(fills: tuple[np.ndarray, ...], rows_each: list[int], budget: int, kernel: costs.AttentionKernel,
           segment_pairs: float) -> float:
    """Pairs over `rows_each[j]` rows of group j: its bins' segments and tails, the rows beyond them empty."""
    if kernel is costs.AttentionKernel.DENSE:
        return float(sum(rows_each)) * budget * budget
    tails = sum(float(costs.attention_pairs(budget - fill, kernel).sum()) for fill in fills)
    empty = sum(rows - fill.size for rows, fill in zip(rows_each, fills)) * float(costs.attention_pairs(budget, kernel))
    return segment_pairs + tails + empty


def update_passes(workload, budget: int, *, minibatches: int, shards: int,
                  kernel: costs.AttentionKernel) -> PackedPasses:
    """One epoch of a packed update: `minibatches` mini-batches of R rows each over `shards` row shards."""
    lengths = _lengths(workload)
    fills = _group_fills(lengths, budget, max(1, minibatches))
    micro = max(1, -(-max(fill.size for fill in fills) // shards))
    rows_each = [micro * shards] * len(fills)
    segment_pairs = float(costs.attention_pairs(np.asarray(lengths), kernel).sum())
    return PackedPasses(passes=len(fills) * micro, tokens=float(sum(rows_each)) * budget,
                        pairs=_pairs(fills, rows_each, budget, kernel, segment_pairs), rows=sum(f.size for f in fills))


def inference_passes(workload, budget: int, *, pieces: int, shards: int, kernel: costs.AttentionKernel) -> PackedPasses:
    """A packed inference stage run in `pieces` pieces, each packed on its own over `shards` row shards."""
    lengths = _lengths(workload)
    fills = _group_fills(lengths, budget, max(1, pieces))
    rows_each = [max(1, -(-fill.size // shards)) * shards for fill in fills]
    segment_pairs = float(costs.attention_pairs(np.asarray(lengths), kernel).sum())
    return PackedPasses(passes=sum(rows_each) // shards, tokens=float(sum(rows_each)) * budget,
                        pairs=_pairs(fills, rows_each, budget, kernel, segment_pairs), rows=sum(f.size for f in fills))


__all__ = ["PackedPasses", "first_fit_decreasing_fills", "inference_passes", "update_passes"]
