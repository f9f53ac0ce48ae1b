"""Length bucketing: a batch runs trimmed to its longest real row, rounded up to a bucket, not padded to the maximum.

Rows are right-padded to the step's maximum length (prompt + max new tokens), but responses are usually
much shorter. Causal attention never lets a token see the ones after it, and padding is masked, so cutting
every row at L >= the longest real length changes no log-prob, value or loss term of a real token; the
columns cut off are padding, whose per-token outputs are 0 (`rpegjax.learners.batch`). Rounding L up to a
multiple of the bucket bounds how many shapes (compilations) a run sees: at most max_length / bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from rpegjax.learners.batch import TrainBatch

_PER_TOKEN = ("token_mask", "response_mask", "behaviour_logprobs", "old_logprobs", "ref_logprobs", "values", "returns",
              "expert_ids")  # a recorded routing [b t s k] is cut on its token axis too


def longest_row(token_mask: Bool[Array, "b t"] | np.ndarray) -> int:
    """The length up to the last real token of the longest row (rows are left-aligned)."""
    positions = np.arange(1, token_mask.shape[1] + 1)
    if isinstance(token_mask, jax.Array):  # on devices (maybe of several processes): reduce there, fetch a scalar
        return int(jnp.max(jnp.where(token_mask, jnp.asarray(positions), 0)))
    return int(np.max(np.where(np.asarray(token_mask, bool), positions, 0)))


def bucket_length(longest: int, full: int, bucket: int | None) -> int:
    """`longest` rounded up to a multiple of `bucket`, at most `full` (None: no bucketing, `full`)."""
    if bucket is None:
        return full
    return min(full, max(bucket, -(-longest // bucket) * bucket))


def trim_batch(batch: TrainBatch, length: int) -> TrainBatch:
    """`batch` with its per-token fields cut to the first `length` columns (per-row fields unchanged)."""
    if length == batch.length:
        return batch
    changes: dict[str, Any] = {"tokens": batch.tokens[:, :length]}
    for name in _PER_TOKEN:
        value = getattr(batch, name)
        if value is not None:
            changes[name] = value[:, :length]
    if batch.advantages is not None and np.ndim(batch.advantages) == 2:
        changes["advantages"] = batch.advantages[:, :length]
    return dataclasses.replace(batch, **changes)


def pad_columns(values: Array, length: int) -> Array:
    """[b, l] per-token values padded with zeros (the value of padding) to [b, length]."""
    return jnp.pad(values, ((0, 0), (0, length - values.shape[1])))
