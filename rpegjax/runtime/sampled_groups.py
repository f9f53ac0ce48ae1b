"""Groups of a dynamically sampled rollout (`rpegjax.runtime.rollout_stage`, DAPO's dynamic sampling): a generated
piece split into its prompts' groups, and the pieces of the step's batch assembled from the groups kept."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rpegjax.rewards.runner import RewardStats
from rpegjax.runtime.programs import Piece


@dataclasses.dataclass(frozen=True)
class SampledGroup:
    """One prompt's group of samples in a generated piece, with its scores."""

    piece: Piece
    rows: slice
    task: np.ndarray
    shaping: np.ndarray


def split_groups(piece: Piece, task: np.ndarray, shaping: np.ndarray, group_size: int) -> list[SampledGroup]:
    """The groups of `piece` (rows group-contiguous) with their task rewards and shaping terms."""
    return [SampledGroup(piece, slice(row, row + group_size), task[row:row + group_size], shaping[row:row + group_size])
            for row in range(0, len(task), group_size)]


def group_piece(index: int, groups: Sequence[SampledGroup], trained: np.ndarray,
                own_rows: Callable[[int], slice]) -> Piece:
    """Piece `index` of a dynamically sampled batch: the rows of `groups` in order. Rows of groups that are not
    `trained` (filler when the extra-round cap was reached) get an empty response mask: no loss, no gradient.
    `own_rows(rows)`: this process's block of the rows, whose task rewards the piece's rewards future holds."""
    batch = jax.tree.map(lambda *rows: np.concatenate(rows),
                         *[jax.tree.map(lambda x, g=g: np.asarray(x)[g.rows], g.piece.batch) for g in groups])
    untrained = ~np.repeat(np.asarray(trained, bool), [g.rows.stop - g.rows.start for g in groups])
    if untrained.any():
        mask = np.array(batch.response_mask, copy=True)
        mask[untrained] = False
        batch = batch.replace(response_mask=mask)
    examples = [e for g in groups for e in g.piece.examples[g.rows]]
    task = np.concatenate([g.task for g in groups])
    # scored by the rollout stage (`Rollout.scores`, with the failures of every round): the future holds this
    # process's rows, as a generated piece's does
    local = task[own_rows(len(task))]
    rewards: concurrent.futures.Future = concurrent.futures.Future()
    rewards.set_result((local, RewardStats(count=len(local), errors=0, timeouts=0, seconds=0.0,
                                           mean_reward=float(local.mean()) if len(local) else 0.0)))
    return Piece(index=index, examples=examples, completions=[c for g in groups for c in g.piece.completions[g.rows]],
                 batch=batch, rewards=rewards)
