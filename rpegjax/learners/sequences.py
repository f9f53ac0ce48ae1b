"""The sequences of a batch for sequence-level loss terms: one per row, or one per segment of a packed row.

An unpacked batch holds one sequence per row. A packed batch (`rpegjax.learners.packing`) holds several, told
apart by `segment_ids` [b, t] (1, 2, ... per row; 0 at padding). Sequence-level terms (seq-mean aggregations,
GSPO's ratio, sequence-level rollout corrections) reduce per-token values to per-sequence sums laid out
[b, s]: s = 1 (the row) without segment ids, s = t + 1 (segment id k of row i at [i, k]) with them. A slot that
holds no sequence sums to 0, so sums over all slots are sums over sequences, and counting the slots with a
positive token count counts the sequences that have tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def sequence_sums(values: Float[Array, "b t"], segment_ids: Int[Array, "b t"] | None) -> Float[Array, "b s"]:
    """sum_t values[i, t] over each sequence: [b, 1] per row, or [b, t + 1] per row and segment id."""
    if segment_ids is None:
        return jnp.sum(values, axis=-1, keepdims=True)
    slots = values.shape[1] + 1
    return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=slots))(values, segment_ids)


def to_tokens(per_sequence: Float[Array, "b s"], segment_ids: Int[Array, "b t"] | None, shape: tuple[int, int]
              ) -> Float[Array, "b t"]:
    """Each token's entry of a per-sequence array laid out as `sequence_sums` returns it."""
    if segment_ids is None:
        return jnp.broadcast_to(per_sequence[:, :1], shape)
    return jnp.take_along_axis(per_sequence, segment_ids, axis=1)
