"""What each stage kind computes: the bridge from RPEG stages to the sampler, rewards and learners.

The runtime decides *when* and *with which weights* a stage runs; a `StagePrograms` object knows *what* it
runs, from three parts along the data flow: the rollout (`rollout_programs`: generation, packing, rewards), the
training programs (`training_programs`: inference stages, advantages, the update) and the weight-sync copies
(`weight_sync`). Each compiled program can be lowered by its owner for abstract inputs, which is how the dry run
(`rpegjax.train.dry_run`) compiles exactly what a run launches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rpegjax.data.example import Example
from rpegjax.envs.rollout import EpisodeRunner
from rpegjax.generate.sampler import Sampler, SamplerStats
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph.ir import StageKind
from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.protocol import Learner
from rpegjax.rewards.runner import RewardFn, RewardRunner, RewardStats
from rpegjax.runtime.rollout_programs import Piece, RolloutPrograms, concatenate_pieces
from rpegjax.runtime.training_programs import INFERENCE_FIELDS, StageLayout, TrainingPrograms
from rpegjax.runtime.weight_sync import WeightSyncPrograms

__all__ = ["INFERENCE_FIELDS", "Piece", "StageLayout", "StagePrograms", "concatenate_pieces"]


class StagePrograms:
    """Stage computations for one run, built from a `Learner` (`rpegjax.learners.protocol`) and a sampler:
    `rollout` (`RolloutPrograms`), `training` (`TrainingPrograms`) and `weights` (`WeightSyncPrograms`), with
    the methods the controller calls on them. Generation runs on the sampler's mesh, every other device stage on
    the learner's (`learner.placement.mesh`; None: the default device); the two may be disjoint device sets.
    See the parts for `rewards`, `episodes`, `reference_params`, `generation_dtype` and `offload_optimizer`."""

    def __init__(
        self,
        *,
        learner: Learner,
        sampler: Sampler,
        sampling: SamplingConfig,
        group_size: int,
        rewards: RewardRunner | RewardFn | None,
        decode: Callable[[Sequence[int]], str],
        pad_id: int,
        reference_params: Any = None,
        generation_dtype: str | None = None,
        episodes: EpisodeRunner | None = None,
        offload_optimizer: bool = False,
    ):
        self.rollout = RolloutPrograms(sampler=sampler, sampling=sampling, group_size=group_size, rewards=rewards,
                                       decode=decode, pad_id=pad_id, episodes=episodes)
        self.training = TrainingPrograms(learner, reference_params, offload_optimizer=offload_optimizer)
        self.weights = WeightSyncPrograms(learner, sampler, generation_dtype)
        self.learner = learner
        self.sampler = sampler
        self.group_size = group_size
        self.sequence_length = self.rollout.sequence_length
        self.episodes = episodes
        self.train_mesh = learner.placement.mesh

    @property
    def dispatches(self) -> int:
        """Device programs launched by inference, advantage, update and sync stages."""
        return self.training.dispatches + self.weights.dispatches

    @property
    def reward_processes(self) -> Sequence[int] | None:
        """Who scores a piece's rows (None: every process)."""
        return self.rollout.reward_processes

    @reward_processes.setter
    def reward_processes(self, processes: Sequence[int] | None) -> None:
        self.rollout.reward_processes = processes

    def close(self) -> None:
        self.rollout.close()

    def mesh_of(self, kind: StageKind) -> Mesh | None:
        """The mesh the program of a device stage of `kind` runs on (None: the default device)."""
        return self.sampler.mesh if kind == StageKind.GENERATE else self.train_mesh

    # ---- rollout ---------------------------------------------------------------------------------
    def generate(self, params: Any, examples: Sequence[Example], prompt_ids: Sequence[Sequence[int]], *,
                 key: jax.Array, version: int, pieces: int, stats: SamplerStats | None = None) -> Iterator[Piece]:
        return self.rollout.generate(params, examples, prompt_ids, key=key, version=version, pieces=pieces,
                                     stats=stats)

    def collect_rewards(self, piece: Piece) -> tuple[np.ndarray, RewardStats]:
        return self.rollout.collect_rewards(piece)

    # ---- training ----------------------------------------------------------------------------------
    def infer(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch, mesh: Mesh | None = None
              ) -> dict[str, jax.Array]:
        return self.training.infer(kinds, state, batch, mesh)

    def advantages(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, Any]]:
        return self.training.advantages(batch)

    def update(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch) -> tuple[Any, dict[str, Any]]:
        return self.training.update(kinds, state, batch)

    def at_rest(self, state: Any) -> Any:
        return self.training.at_rest(state)

    # ---- weight sync -------------------------------------------------------------------------------
    def sync(self, state: Any) -> Any:
        return self.weights.sync(state)

    def staged_sync(self, state: Any) -> Any:
        return self.weights.staged_sync(state)

    def staging_shardings(self) -> Any:
        return self.weights.staging_shardings()

    def generation_shapes(self) -> Any:
        return self.weights.generation_shapes()

    def copy_actor(self, state: Any, shardings: Any) -> Any:
        return self.weights.copy_actor(state, shardings)

    def actor_params_of(self, state: Any) -> Any:
        return self.weights.actor_params_of(state)
