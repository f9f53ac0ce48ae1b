"""Decode only the live rows: a chunk runs on a compact bucket of the running slots, not on every slot.

Once most sequences of a replica have finished, decoding every slot still pays every slot's matmul rows, logits
and attention each step. Before each chunk the host lists the running slots of each slot replica and pads them,
with free slots, to a power of two per replica (`live_rows`: at most 1 + log2(slots per replica) bucket sizes,
so few decode programs compile); the compiled chunk gathers those rows of the decode state (`take_live`), runs
its steps on them, and scatters them back (`put_live`). Free slots in a bucket are done rows: they write nothing.

Rows keep their replica: bucket row i of replica r is one of r's own slots, so the gathers and scatters stay on
that replica's devices (the paged cache's page ids are replica-local) and the bucket splits over the batch axes
like the slots do. A row's tokens do not depend on which rows share its bucket: its key is a function of its
(prompt, sample, step), and no op mixes rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jaxtyping import Array, Int

from rpegjax.generate.paged_cache import pow2_at_least

# DecodeState fields with one row per slot (the cache is gathered by the layout's own `take_cache`)
ROW_FIELDS = ("last_token", "num_generated", "budget", "done", "finish", "prompt_index", "sample_index", "tokens",
              "logprobs")


def live_rows(running: Sequence[int], *, num_slots: int, replicas: int, compact: bool = True) -> np.ndarray:
    """[r q] replica-local slot indices a chunk decodes: each replica's running slots, in slot order, then its free
    slots up to q = the power of two at least the most running slots of one replica, at most its slots. A full
    bucket (q = slots per replica; always when not `compact`: the sampler without live buckets) lists every slot in
    slot order, the form `take_rows` and `put_rows` take without a gather or scatter."""
    per = num_slots // replicas
    blocks = [[slot - replica * per for slot in running if slot // per == replica] for replica in range(replicas)]
    q = pow2_at_least(max(map(len, blocks)), per) if compact else per
    if q == per:  # every slot: in slot order, which `take_rows` / `put_rows` read as a slice (no gather)
        return np.tile(np.arange(per, dtype=np.int32), (replicas, 1))
    rows = np.empty((replicas, q), np.int32)
    for replica, block in enumerate(blocks):
        taken = set(block)
        rows[replica] = (block + [slot for slot in range(per) if slot not in taken])[:q]
    return rows


def padded_rows(slots: Sequence[int], num_slots: int) -> np.ndarray:
    """`slots` padded with its first to a power of two rows (at most `num_slots`): few compiled `finished_rows`."""
    rows = np.full((pow2_at_least(len(slots), num_slots),), slots[0], np.int32)
    rows[: len(slots)] = slots
    return rows


def finished_rows(tokens: Int[Array, "n c"], logprobs: Array, routing: Int[Array, "n c s k"] | None,
                  rows: Int[Array, " m"]) -> tuple[Array, Array, Array | None]:
    """The decode state's rows `rows` of the tokens [m c], log-probs [m c] and recorded routing [m c s k] (None when
    not recorded): what finished sequences hand out, in one program (one dispatch, one transfer)."""
    return tokens[rows], logprobs[rows], None if routing is None else routing[rows]


def least_busy_first(free: Sequence[int], running: Sequence[int], *, num_slots: int, replicas: int) -> list[int]:
    """`free` slots in the order admission should fill them: each next one on the replica with the fewest running
    slots so far (then the lower replica, then slot order), so the replicas' running counts, and with them the
    live bucket every replica decodes (the busiest one's), stay even."""
    per = num_slots // replicas
    load = [0] * replicas
    for slot in running:
        load[slot // per] += 1
    queues = [[slot for slot in free if slot // per == replica] for replica in range(replicas)]
    order = []
    while any(queues):
        replica = min((r for r in range(replicas) if queues[r]), key=lambda r: (load[r], r))
        order.append(queues[replica].pop(0))
        load[replica] += 1
    return order


def first_positions(positions: int, count: int | None) -> tuple[slice, ...]:
    """The index, after a leading row index, of the first `count` entries of axis `positions` (all of the axes
    between): `x.at[(rows, *first_positions(3, n))]` is `x.at[rows, :, :, :n]`."""
    return (slice(None),) * (positions - 1) + (slice(None, count),)


def take_rows(x: Array, live: Int[Array, "r q"], window: int | None = None, positions: int = 2) -> Array:
    """Rows `live` of x [b ...] (b split into r replica blocks; live holds indices within a block) -> [r*q ...];
    with `window`, only the first `window` entries of axis `positions` (a contiguous cache's positions). A full
    bucket (q = b / r) must list every slot in slot order, as `live_rows` gives it: x is then sliced, not gathered
    (XLA:CPU's gather of a whole cache window per chunk cost more than the chunk's attention:
    `benchmarks/bench_fused_ops.py --parts bucket`)."""
    r, q = live.shape
    if q * r == x.shape[0]:  # a full bucket is every slot in slot order (`live_rows`): a slice, not a gather
        return x if window is None else jax.lax.slice_in_dim(x, 0, window, axis=positions)
    blocks = x.reshape(r, x.shape[0] // r, *x.shape[1:])
    if window is not None:
        blocks = jax.lax.slice_in_dim(blocks, 0, window, axis=positions + 1)
    taken = jax.vmap(lambda block, rows: block[rows])(blocks, live)
    return taken.reshape(r * q, *taken.shape[2:])


def put_rows(x: Array, live: Int[Array, "r q"], new: Array, window: int | None = None, positions: int = 2) -> Array:
    """x with rows `live` replaced by `new` [r*q ...] (the inverse of `take_rows`; with `window`, the first
    `window` entries of axis `positions` only; a full bucket in slot order, as in `take_rows`)."""
    r, q = live.shape
    if q * r == x.shape[0]:  # a full bucket, every slot in slot order: written in place, no scatter
        return new if window is None else jax.lax.dynamic_update_slice(x, new, (0,) * x.ndim)
    blocks = x.reshape(r, x.shape[0] // r, *x.shape[1:])
    parts = new.reshape(r, q, *new.shape[1:])

    def put(block, rows, part):
        if window is None:
            return block.at[rows].set(part)
        return block.at[(rows, *first_positions(positions, window))].set(part)

    return jax.vmap(put)(blocks, live, parts).reshape(x.shape)


def decode_live(run: Callable, state, live: Int[Array, "r q"], take_cache: Callable, put_cache: Callable):
    """`run(compact state) -> (compact state, steps)` on the rows `live` of `state`; returns the whole state with
    those rows written back, and the steps. `take_cache(cache)` gives the bucket's cache, `put_cache(cache,
    compact cache)` writes it back."""
    fields = ROW_FIELDS + (() if getattr(state, "routing", None) is None else ("routing",))  # recorded routing
    compact = state.replace(cache=take_cache(state.cache),
                            **{field: take_rows(getattr(state, field), live) for field in fields})
    compact, steps = run(compact)
    return state.replace(cache=put_cache(state.cache, compact.cache),
                         **{field: put_rows(getattr(state, field), live, getattr(compact, field))
                            for field in fields}), steps
