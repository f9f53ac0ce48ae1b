"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): train only on groups whose
rewards differ.

A group whose G samples all scored the same has zero advantage under every group-baseline estimator
(GRPO, Dr.GRPO, RLOO, REINFORCE++ with the group baseline), so it adds nothing to the policy gradient but
still dilutes a token-mean loss. Dynamic sampling drops such groups and samples further prompts until the
training batch holds `target` informative groups:

    keep group i  iff  max_g r_ig > min_g r_ig

`GroupBatchFiller` is the host-side bookkeeping of that loop, independent of who generates: feed it each
round's rewards and per-group items (completions, row indices, anything) until `needs_more` is False, then
`finish()` gives the batch. Rounds past the first are capped (`max_extra_rounds`); a batch still short
then is either trained on as it is, the missing groups filled with dropped ones that the caller masks out
of the loss (`FilledBatch.trained`), or refused with `DynamicSamplingError`. Informative groups sampled
beyond the target are discarded, not carried into the next step: they would be a version older than the
next step's asynchrony bound allows.

    filler = GroupBatchFiller(target_groups=32, group_size=8, config=DynamicSamplingConfig())
    while filler.needs_more:
        completions = sampler.generate(params, prompts(data.next_batch()), sampling, group_size=8, ...)
        rewards = score(completions)                                      # [32 * 8]
        filler.add_round(rewards, [completions[i * 8:(i + 1) * 8] for i in range(32)])
    filled = filler.finish()   # filled.groups: 32 groups, filled.trained[i] False for filler groups
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np
from jaxtyping import Bool, Float

Group = TypeVar("Group")


class SamplingCapAction(enum.StrEnum):
    TRAIN = "train"  # train on the informative groups found; the missing ones are filler, masked out of the loss
    ERROR = "error"  # stop with DynamicSamplingError


class DynamicSamplingError(ValueError):
    """The extra-round cap was reached with fewer informative groups than the batch needs (on_cap='error')."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """`max_extra_rounds`: generation rounds allowed after the first, each of one more batch of prompts;
    `on_cap`: what happens when they are spent and the batch is still short."""

    max_extra_rounds: int = 4
    on_cap: SamplingCapAction = SamplingCapAction.TRAIN

    def __post_init__(self) -> None:
        if isinstance(self.max_extra_rounds, bool) or not isinstance(self.max_extra_rounds, int) \
                or self.max_extra_rounds < 0:
            raise ValueError(f"DynamicSamplingConfig.max_extra_rounds must be an integer >= 0, "
                             f"got {self.max_extra_rounds!r}")
        try:
            object.__setattr__(self, "on_cap", SamplingCapAction(self.on_cap))
        except ValueError:
            raise ValueError(f"DynamicSamplingConfig.on_cap must be one of {[a.value for a in SamplingCapAction]}, "
                             f"got {self.on_cap!r}") from None


def informative_groups(rewards: Float[np.ndarray, " b"], group_size: int) -> Bool[np.ndarray, " n"]:
    """True for each group of `group_size` consecutive rewards (rows group-contiguous) whose rewards are not all
    equal, i.e. whose group-baseline advantages are not all zero."""
    rewards = np.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"informative_groups: rewards must be one value per sequence [b], got shape {rewards.shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"informative_groups: group_size must be a positive integer, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"informative_groups: {rewards.shape[0]} rewards do not split into groups of {group_size}")
    if not np.isfinite(rewards).all():
        raise ValueError("informative_groups: rewards hold NaN or inf; score failures must be finite (e.g. 0)")
    groups = rewards.reshape(-1, group_size)
    return groups.max(axis=1) > groups.min(axis=1)


@dataclasses.dataclass(frozen=True)
class FilledBatch(Generic[Group]):
    """`groups`: exactly the target number, informative ones first in sampling order, then filler groups
    (dropped ones, only when the cap was reached with on_cap='train'); `trained[i]` is False for filler, whose
    rows the caller must mask out of the loss; `metrics`: `dynamic_sampling/*` counts of this batch."""

    groups: list[Group]
    trained: Bool[np.ndarray, " n"]
    metrics: dict[str, float]


class GroupBatchFiller(Generic[Group]):
    """Collects informative groups over generation rounds until `target_groups` are found or the cap is hit."""

    def __init__(self, target_groups: int, group_size: int, config: DynamicSamplingConfig, *, where: str = ""):
        if isinstance(target_groups, bool) or not isinstance(target_groups, int) or target_groups < 1:
            raise ValueError(f"GroupBatchFiller.target_groups must be a positive integer, got {target_groups!r}")
        self.target_groups, self.group_size, self.config = target_groups, group_size, config
        self.where = where
        self.rounds = 0
        self.kept: list[Group] = []
        self.dropped: list[Group] = []
        self.surplus = 0  # informative groups beyond the target, discarded

    def add_round(self, rewards: Float[np.ndarray, " b"], groups: Sequence[Group]) -> None:
        """One generation round: `rewards` of its rows (group-contiguous) and one item per group."""
        mask = informative_groups(rewards, self.group_size)
        if len(groups) != mask.shape[0]:
            raise ValueError(f"GroupBatchFiller.add_round: {mask.shape[0]} groups of rewards but {len(groups)} items")
        self.rounds += 1
        for informative, group in zip(mask, groups):
            if not informative:
                self.dropped.append(group)
            elif len(self.kept) < self.target_groups:
                self.kept.append(group)
            else:
                self.surplus += 1

    @property
    def full(self) -> bool:
        return len(self.kept) == self.target_groups

    @property
    def needs_more(self) -> bool:
        """Whether another round should be generated: the batch is short and the cap allows one."""
        return not self.full and self.rounds < 1 + self.config.max_extra_rounds

    def finish(self) -> FilledBatch[Group]:
        """The batch; raises `DynamicSamplingError` if it is short and on_cap='error'."""
        if self.rounds == 0:
            raise ValueError("GroupBatchFiller.finish: no round was added")
        if self.needs_more:
            raise ValueError("GroupBatchFiller.finish: the batch is short and the cap allows more rounds")
        missing = self.target_groups - len(self.kept)
        if missing and self.config.on_cap == SamplingCapAction.ERROR:
            raise DynamicSamplingError(
                f"{self.where}dynamic sampling found {len(self.kept)} of {self.target_groups} groups with differing "
                f"rewards in {self.rounds} rounds ({len(self.dropped)} groups dropped: every sample scored the same); "
                f"the cap max_extra_rounds={self.config.max_extra_rounds} is reached. Raise it, or set "
                "on_sampling_cap=train to train on the groups found")
        groups = self.kept + self.dropped[:missing]
        trained = np.arange(self.target_groups) < len(self.kept)
        metrics = {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/extra_rounds": float(self.rounds - 1),
            "dynamic_sampling/sampled_groups": float(len(self.kept) + len(self.dropped) + self.surplus),
            "dynamic_sampling/dropped_groups": float(len(self.dropped)),
            "dynamic_sampling/kept_groups": float(len(self.kept)),
            "dynamic_sampling/surplus_groups": float(self.surplus),
            "dynamic_sampling/filler_groups": float(missing),
            "dynamic_sampling/cap_hit": float(missing > 0),
        }
        return FilledBatch(groups=groups, trained=trained, metrics=metrics)
