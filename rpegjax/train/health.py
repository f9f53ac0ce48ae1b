"""Non-finite values in a run: weights that hold NaN or inf, and steps whose loss, gradient norm or rewards
are not finite. A run tolerates a configured number of such steps, then stops with an error that says what
was seen where; it never writes a checkpoint from non-finite weights."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


class TrainingError(RuntimeError):
    """The run itself went wrong (not its input): e.g. non-finite values past the tolerated number."""


def nonfinite_leaves(tree: Any, *, limit: int = 3) -> list[str]:
    """Paths of (up to `limit`) arrays of `tree` holding NaN or inf in the shards this process holds (read to
    the host; not a collective: for a verdict every process agrees on use a collective checksum first)."""
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shards = [s.data for s in leaf.addressable_shards] if isinstance(leaf, jax.Array) else [leaf]
        arrays = [np.asarray(shard) for shard in shards]
        if any(np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all() for a in arrays):
            found.append(jax.tree_util.keystr(path))
            if len(found) == limit:
                break
    return found


def _watched(key: str) -> bool:
    # losses, gradient norms and the mean reward: NaN in any of them reaches (or came from) the weights;
    # other diagnostics may be undefined on a step without meaning harm
    return key == "reward" or key.endswith(("loss", "grad_norm"))


def nonfinite_metrics(metrics: Mapping[str, Any]) -> list[str]:
    """Names of the watched metrics (losses, gradient norms, mean reward) that are NaN or inf, plus
    `reward/nonfinite` when a reward function returned non-finite values (scored 0 by the runner)."""
    bad = []
    for key, value in metrics.items():
        if isinstance(value, str) or not (_watched(key) or key == "reward/nonfinite"):
            continue
        try:
            number = float(np.asarray(value))
        except (TypeError, ValueError):
            continue
        if not math.isfinite(number) or (key == "reward/nonfinite" and number > 0):
            bad.append(key)
    return bad


class NonFiniteGuard:
    """Counts steps with non-finite metrics; `observe` raises TrainingError once more than `tolerated` were seen."""

    def __init__(self, tolerated: int) -> None:
        if isinstance(tolerated, bool) or not isinstance(tolerated, int) or tolerated < 0:
            raise ValueError(f"NonFiniteGuard.tolerated must be an integer >= 0, got {tolerated!r}")
        self.tolerated = tolerated
        self.count = 0

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[str]:
        """The non-finite metric names of `step` (empty when all are finite); counts the step if any."""
        bad = nonfinite_metrics(metrics)
        if bad:
            self.count += 1
            if self.count > self.tolerated:
                raise TrainingError(
                    f"step {step}: non-finite {', '.join(bad)}; {self.count} steps with non-finite values, more "
                    f"than train.max_nonfinite_steps={self.tolerated} (lower the learning rate, check the rewards; "
                    "the checkpoints written so far hold finite weights and can be resumed)")
        return bad
