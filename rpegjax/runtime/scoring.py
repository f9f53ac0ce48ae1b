"""The reward side of a step: task rewards gathered over processes, reward shaping, and the step's reward metrics.

Reward shaping (e.g. DAPO's overlong penalty) is an additive term of the response lengths: advantages and dynamic
sampling read task reward + shaping; the `reward` and `accuracy` metrics are the task's, over every sequence
sampled in the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rpegjax.rewards.runner import RewardStats, term_metrics
from rpegjax.runtime.programs import Piece

if TYPE_CHECKING:
    from rpegjax.runtime.rollout_stage import Rollout


@dataclasses.dataclass(frozen=True)
class RolloutScores:
    """What the advantage stage reads, per row of the step's batch, and the step's reward metrics."""

    task: np.ndarray  # float32 [rows]: the task's rewards
    shaping: np.ndarray  # float32 [rows]: the additive shaping term (zeros without shaping)
    metrics: dict[str, float]

    @property
    def rewards(self) -> np.ndarray:
        """float32 [rows]: what the advantages read, task reward + shaping."""
        return (self.task + self.shaping).astype(np.float32)


class Scorer:
    """Scores rollouts: every row's task reward (`collect(piece) -> (rewards [rows], stats)`; with several processes
    a collective, called for the same pieces in the same order everywhere), plus `reward_shaping(lengths) -> term`
    (int [rows] -> float [rows]; None: no shaping). `last_reward_error` is the last reward failure's message."""

    def __init__(self, collect: Callable[[Piece], tuple[np.ndarray, RewardStats]],
                 reward_shaping: Callable[[np.ndarray], np.ndarray] | None = None):
        self.collect = collect
        self.reward_shaping = reward_shaping
        self.last_reward_error = ""

    def shaping(self, completions: Sequence[Any]) -> np.ndarray:
        """float32 [rows]: the shaping term of each completion (zeros without shaping)."""
        if self.reward_shaping is None:
            return np.zeros(len(completions), np.float32)
        term = np.asarray(self.reward_shaping(np.array([c.length for c in completions], np.int64)), np.float32)
        if term.shape != (len(completions),) or not np.isfinite(term).all():
            raise ValueError(f"reward_shaping must return one finite value per sequence ({len(completions)}), got "
                             f"{term!r}")
        return term

    def scores(self, rollout: Rollout) -> RolloutScores:
        """The scores of `rollout`, computed once (a rollout of dynamic sampling was scored by the rollout stage)."""
        if rollout.scores is None:
            task, shaping, stats = [], [], []
            for future in rollout.pieces:  # in piece order in every process: gathering rewards is a collective
                piece = future.result()
                piece_rewards, piece_stats = self.collect(piece)
                task.append(piece_rewards)
                shaping.append(self.shaping(piece.completions))
                stats.append(piece_stats)
            task, shaping = np.concatenate(task).astype(np.float32), np.concatenate(shaping)
            rollout.scores = RolloutScores(task=task, shaping=shaping, metrics=self.metrics(task, shaping, stats))
        return rollout.scores

    def metrics(self, task: np.ndarray, shaping: np.ndarray, stats: Sequence[RewardStats]) -> dict[str, float]:
        """Metrics of the task rewards and shaping terms of every sequence sampled in a step."""
        errors, timeouts = sum(s.errors for s in stats), sum(s.timeouts for s in stats)
        # accuracy: rewards are correctness (1) plus at most a format bonus below 1
        metrics = {"reward": float(task.mean()), "accuracy": float((task >= 1.0).mean()),
                   "reward/errors": float(errors), "reward/timeouts": float(timeouts),
                   "reward/nonfinite": float(sum(s.nonfinite for s in stats)),
                   "reward/seconds": float(sum(s.seconds for s in stats))}
        if self.reward_shaping is not None:
            metrics["reward/shaping"] = float(shaping.mean())
        metrics.update(term_metrics(stats))  # each term of a user's weighted sum: reward/<name>, .../errors
        first_error = next((s.first_error for s in stats if s.first_error), "")
        if first_error:
            self.last_reward_error = first_error
        return metrics
