"""Inference stages (reference / old log-probs, values) in row micro-batches with a bounded memory budget.

A stage's batch of b rows runs as n micro-batches of m = b / n rows inside one program (`lax.map`: one
dispatch, and only one micro-batch's activations live at a time). Rows are dealt to micro-batches as the
update deals them (`rpegjax.learners.update`): row r = i*n + u goes to micro-batch u, place i, so that with
rows sharded in contiguous blocks every micro-batch stays spread evenly over the same devices and no row
moves; the outputs are put back in row order. Each row's outputs depend on that row alone, so the result
equals the whole-batch computation.

m is `InferenceMicroBatching.rows` (at most), or chosen from `memory_gib`, a per-device budget for the
activations, and `rpegjax.models.memory` (bytes per row + weights gathered whatever the rows); a row that does
not fit is refused before anything compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from rpegjax.learners.update import constrain_micro_batches
from rpegjax.models.config import ModelConfig
from rpegjax.models.memory import forward_bytes_per_row, forward_fixed_bytes

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferenceMicroBatching:
    """`rows`: at most this many rows (of the whole batch, all devices) per inference micro-batch;
    `memory_gib`: per-device budget for one micro-batch's activations, from which the rows are chosen (with
    `rows` too, the rows given must fit it). Neither: the whole batch at once."""

    rows: int | None = None
    memory_gib: float | None = None

    def __post_init__(self) -> None:
        if self.rows is not None and (isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"InferenceMicroBatching.rows must be a positive integer or None, got {self.rows!r}")
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise ValueError(f"InferenceMicroBatching.memory_gib must be positive or None, got {self.memory_gib!r}")

    def micro_batches(self, rows: int, length: int, cfg: ModelConfig, *, logprob_chunk: int, shards: int = 1,
                      tensor: int = 1, where: str = "inference") -> int:
        """How many micro-batches a batch of `rows` rows of `length` tokens runs in: the fewest whose
        micro-batch fits `self.rows` and the budget. `shards`: how many parts the rows are split into over the
        devices (every micro-batch keeps that split); `tensor`: shards of the model's widths."""
        limit = rows if self.rows is None else min(self.rows, rows)
        if self.memory_gib is not None:
            budget = self.memory_gib * GIB
            per_row = forward_bytes_per_row(cfg, length, logprob_chunk=logprob_chunk)
            fixed = forward_fixed_bytes(cfg, tensor=tensor)

            def needs(rows_per_device: int) -> str:
                return (f"an estimated {(fixed + rows_per_device * per_row) / GIB:.3f} GiB per device ({per_row / GIB:.3f} "
                        f"per row + {fixed / GIB:.3f} of gathered weights)")

            if fixed + per_row > budget:
                raise ValueError(f"{where}: one row of {length} tokens needs {needs(1)}, more than the memory budget of "
                                 f"{self.memory_gib} GiB (InferenceMicroBatching.memory_gib)")
            per_device = int((budget - fixed) // per_row)
            if self.rows is not None and -(-self.rows // shards) > per_device:
                raise ValueError(f"{where}: {self.rows} rows per micro-batch ({-(-self.rows // shards)} per device) of "
                                 f"{length} tokens need {needs(-(-self.rows // shards))}, more than the memory budget "
                                 f"of {self.memory_gib} GiB")
            limit = min(limit, per_device * shards)
        # the fewest micro-batches that divide the rows, each micro-batch's rows split evenly over the shards
        # (the sharding rules refuse a row axis the devices do not divide)
        counts = [n for n in range(1, rows + 1) if rows % n == 0 and rows // n <= limit and (rows // n) % shards == 0]
        if not counts:
            raise ValueError(f"{where}: no micro-batch of at most {limit} rows splits {rows} rows into equal parts over "
                             f"{shards} row shards; give InferenceMicroBatching.rows as a multiple of {shards}")
        return counts[0]


def map_micro_batches(function: Callable[..., Any], micro_batches: int, *rows_arrays: jax.Array,
                      sharding: NamedSharding | None = None) -> Any:
    """function(*rows_arrays) computed in `micro_batches` row micro-batches (module docstring); `function`
    maps [m, ...] arrays to a pytree of [m, ...] arrays, one result per row."""
    if micro_batches == 1:
        return function(*rows_arrays)
    n = micro_batches

    def split(x: jax.Array) -> jax.Array:  # [b, ...] -> [n, b / n, ...], row i*n + u at [u, i]
        return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

    def merge(x: jax.Array) -> jax.Array:
        return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])

    pieces = tuple(split(x) for x in rows_arrays)
    if sharding is not None:
        pieces = constrain_micro_batches(pieces, sharding)
    outputs = jax.lax.map(lambda xs: function(*xs), pieces)
    return jax.tree.map(merge, outputs)

