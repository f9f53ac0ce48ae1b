"""Sequence packing: a rollout's sequences laid end to end in rows of a token budget, micro-batched by tokens.

A `TrainBatch` holds one sequence per row, left-aligned and right-padded to the longest (or the step's maximum).
Packing moves the real tokens of those n sequences into r rows of `row_tokens` columns each (the token budget
of one micro-batch row, `max_tokens_per_micro_batch`), sequences placed whole by first-fit-decreasing:

    segment_ids [r, c]   sequence k of packed row i has id k (1, 2, ...); padding 0

The model masks attention per segment and restarts positions per segment (`rpegjax.models.attention`,
`transformer.packed_positions`), so every token's log-prob, entropy and value is the one the unpacked row gives;
per-token fields move with their tokens, a per-row advantage becomes per-token, and the losses' sequence-level
terms read the segments (`rpegjax.learners.sequences`). Unpacking gathers per-token outputs back to the
unpacked layout.

Micro-batches by tokens: the update's mini-batch j takes the sequences r with r mod M = j (as the unpacked
update with one micro-batch deals rows), packed on their own; every mini-batch gets the same number of packed
rows R (a multiple of the row shards, padded with empty rows), and each micro-batch is one packed row per row
shard. Packed rows are ordered so that `rpegjax.learners.update.split_rows` with U = R / shards micro-batches
deals them so: mini-batch j, micro-batch u, shard i at row i*(M*U) + j*U + u (every micro-batch spread over
the same devices). The number of rows follows the rollout's tokens, not its longest sequence: a step compiles
once per distinct R.

Narrower rows (`width_bucket`, the learners' `length_bucket` under packing): a batch of 1,030 tokens in rows of
1,024 pads to 2 x 1,024; with a bucket of 128 it may pack into 3 rows of 384 (1,152 tokens), if its sequences fit.
The plan takes the width, a multiple of the bucket, that pads the fewest tokens; a step then compiles once per
distinct (R, width), and the longest case (every row at the budget) stays what a lowering ahead of time sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from rpegjax.learners.batch import TrainBatch

_PER_TOKEN = ("tokens", "token_mask", "response_mask", "behaviour_logprobs", "old_logprobs", "ref_logprobs", "values",
              "returns")


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin of each item: longest first, each into the first bin with room (a new bin when none has); ties keep
    the items' order. Every length must be at most `capacity`."""
    lengths = np.asarray(lengths, np.int64)
    bins = np.full(len(lengths), -1, np.int64)
    room = np.zeros(0, np.int64)
    for item in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(room >= lengths[item])
        if fits.size:
            bins[item] = fits[0]
            room[fits[0]] -= lengths[item]
        else:
            bins[item] = room.size
            room = np.append(room, capacity - lengths[item])
    return bins


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """Where each of n sequences goes: packed row `rows[k]`, columns `offsets[k]` .. + `lengths[k]`."""

    rows: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    num_rows: int
    row_tokens: int

    def sources(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each packed position [r, c]: the sequence it holds, the column there, whether it holds one."""
        sequence = np.zeros((self.num_rows, self.row_tokens), np.int32)
        column = np.zeros((self.num_rows, self.row_tokens), np.int32)
        real = np.zeros((self.num_rows, self.row_tokens), bool)
        for k, (row, offset, length) in enumerate(zip(self.rows, self.offsets, self.lengths)):
            sequence[row, offset:offset + length] = k
            column[row, offset:offset + length] = np.arange(length)
            real[row, offset:offset + length] = True
        return sequence, column, real

    def segment_ids(self) -> np.ndarray:
        """[r, c] int32: 1, 2, ... per sequence in each packed row (in column order), 0 at padding."""
        ids = np.zeros((self.num_rows, self.row_tokens), np.int32)
        for row in range(self.num_rows):
            mine = np.flatnonzero(self.rows == row)
            for segment, k in enumerate(mine[np.argsort(self.offsets[mine])], start=1):
                ids[row, self.offsets[k]:self.offsets[k] + self.lengths[k]] = segment
        return ids

    def destinations(self, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each unpacked position [k, c] (c < `length`): its packed row and column, whether it is a real token."""
        column = np.arange(length)[None, :]
        real = column < self.lengths[:, None]
        rows = np.where(real, self.rows[:, None], 0).astype(np.int32)
        columns = np.where(real, self.offsets[:, None] + column, 0).astype(np.int32)
        return rows, columns, real


def plan_packing(lengths: np.ndarray, row_tokens: int, *, minibatches: int = 1, shards: int = 1,
                 width_bucket: int | None = None, where: str = "packing") -> PackingPlan:
    """Packs sequences of `lengths` tokens into rows of `row_tokens`, mini-batch by mini-batch (module docstring).

    With `width_bucket`, the rows may be narrower: of the widths that are multiples of it (and `row_tokens`
    itself), the one whose plan pads the fewest tokens (rows x width; a tie keeps the wider, fewer rows)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError(f"{where}: needs a non-empty vector of sequence lengths, got shape {lengths.shape}")
    if lengths.max() > row_tokens:
        k = int(np.argmax(lengths))
        raise ValueError(f"{where}: sequence {k} has {lengths[k]} tokens, more than max_tokens_per_micro_batch="
                         f"{row_tokens} (a sequence is never split over rows; raise the budget)")
    members = [np.flatnonzero(np.arange(lengths.size) % minibatches == j) for j in range(minibatches)]
    best = _plan_at_width(lengths, members, row_tokens, shards)
    if width_bucket is None:
        return best
    most = max(int(lengths[mine].sum()) for mine in members)  # the fullest mini-batch's tokens
    first = -(-int(lengths.max()) // width_bucket) * width_bucket
    for width in range(first, row_tokens, width_bucket)[::-1]:
        needed = -(-most // width)  # rows the fullest mini-batch needs at least
        fewest_rows = minibatches * -(-needed // shards) * shards
        if fewest_rows * width >= best.num_rows * best.row_tokens:
            continue  # it cannot pad fewer tokens
        plan = _plan_at_width(lengths, members, width, shards)
        if plan.num_rows * width < best.num_rows * best.row_tokens:
            best = plan
    return best


def _plan_at_width(lengths: np.ndarray, members: list[np.ndarray], width: int, shards: int) -> PackingPlan:
    """Each mini-batch's sequences (`members`) first-fit-decreasing into rows of `width`, every mini-batch padded
    to the same number of rows, a multiple of `shards`, laid out as the module docstring says."""
    minibatches = len(members)
    bins = [first_fit_decreasing(lengths[mine], width) for mine in members]
    used = max([int(bin_of.max()) + 1 for bin_of in bins if bin_of.size] + [1])
    per_minibatch = -(-used // shards) * shards
    micro = per_minibatch // shards
    rows = np.zeros(lengths.size, np.int64)
    offsets = np.zeros(lengths.size, np.int64)
    for j, (mine, bin_of) in enumerate(zip(members, bins)):
        filled = np.zeros(per_minibatch, np.int64)
        for k, b in zip(mine, bin_of):
            u, i = divmod(int(b), shards)
            rows[k] = i * (minibatches * micro) + j * micro + u
            offsets[k] = filled[b]
            filled[b] += lengths[k]
    return PackingPlan(rows=rows, offsets=offsets, lengths=lengths, num_rows=minibatches * per_minibatch,
                       row_tokens=width)


def sequence_lengths(token_mask: Bool[Array, "b t"] | np.ndarray, where: str = "packing") -> np.ndarray:
    """Real tokens of each row (on the host); refuses rows that are not left-aligned (a real token after padding)."""
    if isinstance(token_mask, jax.Array):
        lengths = jnp.sum(token_mask, axis=-1)
        aligned = jnp.all(token_mask == (jnp.arange(token_mask.shape[1])[None, :] < lengths[:, None]))
        lengths, aligned = np.asarray(lengths), bool(aligned)
    else:
        mask = np.asarray(token_mask, bool)
        lengths = mask.sum(axis=-1)
        aligned = bool(np.all(mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])))
    if not aligned:
        raise ValueError(f"{where}: packing needs left-aligned rows (real tokens first, then padding), as "
                         "pack_rollouts lays them out")
    return lengths.astype(np.int64)


def pack_tokens(values: Any, rows: np.ndarray, columns: np.ndarray, real: np.ndarray, fill: int = 0) -> Any:
    """values[rows, columns] where `real`, `fill` (zero, False) elsewhere (a `PackingPlan`'s `sources` or
    `destinations`); values [b, t, ...] keep their trailing axes (a token's routing). numpy stays on the host, jax
    arrays on devices."""
    xp = np if isinstance(values, np.ndarray) else jnp
    real = real.reshape(real.shape + (1,) * (values.ndim - 2))
    return xp.where(real, values[rows, columns], xp.full((), fill, values.dtype))


def pack_batch(batch: TrainBatch, plan: PackingPlan) -> TrainBatch:
    """`batch` (one sequence per row) packed as `plan` says: per-token fields moved with their tokens, a per-row
    advantage broadcast to its tokens, `segment_ids` set; per-row rewards are dropped (the update reads none)."""
    sequence, column, real = plan.sources()
    changes: dict[str, Any] = {}
    for name in _PER_TOKEN:
        value = getattr(batch, name)
        changes[name] = None if value is None else pack_tokens(value, sequence, column, real)
    advantages = batch.advantages
    if advantages is not None:
        if np.ndim(advantages) == 1:
            advantages = (np.broadcast_to(advantages[:, None], batch.tokens.shape) if isinstance(advantages, np.ndarray)
                          else jnp.broadcast_to(advantages[:, None], batch.tokens.shape))
        advantages = pack_tokens(advantages, sequence, column, real)
    # each segment carries its sequence's recorded routing (router replay); -1 (none) at padding
    expert_ids = None if batch.expert_ids is None else pack_tokens(batch.expert_ids, sequence, column, real, fill=-1)
    return TrainBatch(**changes, advantages=advantages, rewards=None, expert_ids=expert_ids,
                      segment_ids=plan.segment_ids())


def unpack_tokens(packed: Any, plan: PackingPlan, length: int) -> Any:
    """[r, c] per-token values of packed rows back to [n, length] (0 past each sequence's tokens)."""
    return pack_tokens(packed, *plan.destinations(length))


def abstract_packed_batch(batch: TrainBatch, row_tokens: int, *, minibatches: int = 1, shards: int = 1) -> TrainBatch:
    """What `pack_batch` makes of an abstract batch (`jax.ShapeDtypeStruct`s, lowering ahead of time) whose
    sequences all fill their rows: as many packed rows as that longest case needs, each of `row_tokens`."""
    rows, length = batch.tokens.shape
    if length > row_tokens:
        raise ValueError(f"packing: rows of {length} tokens do not fit max_tokens_per_micro_batch={row_tokens} (a "
                         f"sequence is never split over rows; raise the budget to at least {length})")
    per_minibatch = -(-rows // minibatches)
    packed_rows = -(-per_minibatch // (row_tokens // length))
    packed_rows = minibatches * -(-packed_rows // shards) * shards

    def packed(value: Any, dtype: Any = None) -> Any:
        if value is None:
            return None
        return jax.ShapeDtypeStruct((packed_rows, row_tokens), dtype or value.dtype, sharding=value.sharding)

    fields = {name: packed(getattr(batch, name)) for name in _PER_TOKEN}
    routing = batch.expert_ids
    if routing is not None:
        routing = jax.ShapeDtypeStruct((packed_rows, row_tokens, *routing.shape[2:]), routing.dtype,
                                       sharding=routing.sharding)
    return TrainBatch(**fields, advantages=packed(batch.advantages, jnp.float32), rewards=None, expert_ids=routing,
                      segment_ids=packed(batch.tokens, jnp.int32))
