"""The step executor: every execution unit of the graph but generation and reward, in graph order, on one
step's rollout.

- Inference units (`ref_logprob`, `old_logprob`, `critic_value`; a fused group is one program) with as many
  micro-batches as the generate stage run piece by piece as the rollout's pieces arrive, so they start while the
  tail of the rollout still decodes; otherwise they run on the assembled batch, in their own micro-batches.
- The advantage unit reads the rollout's scores (`rpegjax.runtime.scoring`) and computes the advantages.
- Update units run the learner's update (one program for actor and critic).
- The weight-sync unit copies the actor into the generation layout and publishes it as version t + 1
  (`rpegjax.runtime.publishing`).

Every unit's execution is a `Trace` span (stage, step, weights version, placement); device stages block on their
outputs inside the span, so the measured timeline is honest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rpegjax.data.example import Example
from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Graph, GraphError, StageKind
from rpegjax.graph.trace import Trace
from rpegjax.learners.batch import TrainBatch
from rpegjax.runtime.programs import StagePrograms, concatenate_pieces
from rpegjax.runtime.publishing import WeightPublisher
from rpegjax.runtime.rollout_stage import Rollout
from rpegjax.runtime.scoring import Scorer


@dataclasses.dataclass(frozen=True)
class StepResult:
    step: int
    version: int  # weights version the rollout was generated with
    metrics: dict[str, float]
    data_state: dict[str, Any]
    completions: list[Any]
    examples: list[Example] = dataclasses.field(default_factory=list)  # the step's prompts (Completion.prompt_index)
    rewards: np.ndarray | None = None  # float32 [completions], in the order of `completions`
    carry: dict[str, Any] | None = None  # partial rollouts: the groups in flight after the step (`Rollout.carry`)


def unit_kinds(graph: Graph, unit: Sequence[str]) -> tuple[StageKind, ...]:
    """The stage kinds of an execution unit, in order, each once."""
    kinds: list[StageKind] = []
    for name in unit:
        for kind in graph.stage(name).kinds:
            if kind not in kinds:
                kinds.append(kind)
    return tuple(kinds)


@dataclasses.dataclass
class _Step:
    """What one step's units read and write: the training state, the batch once assembled, per-piece inference
    outputs before that, and the metrics."""

    state: Any
    rollout: Rollout
    piece_outputs: list[dict[str, jax.Array]]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    batch: TrainBatch | None = None
    rewards: np.ndarray | None = None


class StepExecutor:
    """Runs the training units of `graph` (its execution units minus generate and reward) on each step's rollout.

    Programs used: `programs.infer`, `programs.advantages`, `programs.update` and `programs.dispatches` (device
    programs launched, counted per step in `dispatches_per_step`), `programs.episodes` (multi-turn metrics); the
    weight-sync unit goes through `publisher`. `stage_meshes`: the inference stages with a layout of their own."""

    def __init__(self, graph: Graph, programs: StagePrograms, *, scorer: Scorer, publisher: WeightPublisher,
                 trace: Trace, stage_meshes: dict[str, Any], pieces: int):
        self.graph = graph
        self.programs = programs
        self.scorer = scorer
        self.publisher = publisher
        self.trace = trace
        self.stage_meshes = stage_meshes
        self.pieces = pieces
        rollout_kinds = {StageKind.GENERATE, StageKind.REWARD}
        self.units = [unit for unit in graph.execution_units() if not set(unit_kinds(graph, unit)) <= rollout_kinds]
        self.dispatches_per_step: list[int] = []

    def sync_unit(self) -> tuple[str, ...]:
        for unit in self.units:
            if StageKind.WEIGHT_SYNC in unit_kinds(self.graph, unit):
                return unit
        raise GraphError("the graph has no weight_sync stage; generation could never see new weights")

    def publish_initial(self, state: Any, step: int, history: Sequence[tuple[int, Any]]) -> None:
        """Publishes the older versions of `history` (generation copies that pending rollouts may read after a
        resume) and, as the weight-sync stage of the step before `step`, the weights of `state` as version `step`."""
        for version, params in history:
            self.publisher.publish(version, params)
        unit = self.sync_unit()
        with self.trace.span(self.graph.stage(unit[0]).name, step, step, self.graph.stage(unit[0]).placement):
            self.publisher.publish(step, jax.block_until_ready(self.publisher.copy(state)))

    def run(self, state: Any, rollout: Rollout) -> tuple[Any, StepResult]:
        """Step `rollout.step`: every training unit in graph order; returns the new state and the step's result."""
        dispatches_before = self.programs.dispatches
        step = _Step(state=state, rollout=rollout, piece_outputs=[dict() for _ in range(self.pieces)])
        for unit in self.units:
            kinds = unit_kinds(self.graph, unit)
            if set(kinds) <= INFERENCE_KINDS:
                self._infer(unit, kinds, step)
            elif StageKind.ADVANTAGE in kinds:
                self._advantages(unit, step)
            elif set(kinds) & UPDATE_KINDS:
                self._update(unit, kinds, step)
            elif StageKind.WEIGHT_SYNC in kinds:
                self._sync(unit, step)
            else:
                raise GraphError(f"the runtime cannot execute stage kinds {[k.value for k in kinds]} of {unit}",
                                 stage=unit[0])
        self.dispatches_per_step.append(self.programs.dispatches - dispatches_before)
        return step.state, self._result(step)

    # ---- units ---------------------------------------------------------------------------------
    def _span(self, unit: Sequence[str], step: _Step, version: int | None = None, **fields):
        rollout_step = step.rollout.step
        return self.trace.span("+".join(unit), rollout_step, rollout_step if version is None else version,
                               self.graph.stage(unit[0]).placement, **fields)

    def _infer(self, unit: Sequence[str], kinds: tuple[StageKind, ...], step: _Step) -> None:
        microbatches = self.graph.stage(unit[0]).microbatches
        mesh = self.stage_meshes.get(unit[0])
        if microbatches == self.pieces:  # piece by piece, as the rollout finishes
            for index, future in enumerate(step.rollout.pieces):
                piece = future.result()
                with self._span(unit, step, microbatch=index if self.pieces > 1 else None):
                    outputs = self.programs.infer(kinds, step.state, piece.batch, mesh)
                    step.piece_outputs[index].update(jax.block_until_ready(outputs))
            return
        batch = self._batch(step)
        with self._span(unit, step):
            outputs = [self.programs.infer(kinds, step.state, chunk, mesh) for chunk in _split_rows(batch, microbatches)]
            merged = {k: jnp.concatenate([o[k] for o in outputs]) for k in outputs[0]}
            step.batch = batch.replace(**jax.block_until_ready(merged))

    def _advantages(self, unit: Sequence[str], step: _Step) -> None:
        scores = self.scorer.scores(step.rollout)
        batch = self._batch(step).replace(rewards=scores.rewards)
        step.rewards = batch.rewards
        step.metrics.update(scores.metrics)
        with self._span(unit, step):
            step.batch, advantage_metrics = self.programs.advantages(batch)
            jax.block_until_ready(step.batch.advantages)
        _merge_metrics(step.metrics, advantage_metrics, "advantage/")

    def _update(self, unit: Sequence[str], kinds: tuple[StageKind, ...], step: _Step) -> None:
        if step.batch is None:
            raise GraphError(f"stage {unit[0]!r} runs before the advantage stage", stage=unit[0])
        with self._span(unit, step):
            step.state, update_metrics = self.programs.update(kinds, step.state, step.batch)
            update_metrics = jax.device_get(update_metrics)
        _merge_metrics(step.metrics, update_metrics)

    def _sync(self, unit: Sequence[str], step: _Step) -> None:
        version = step.rollout.step + 1
        with self._span(unit, step, version):
            self.publisher.publish(version, jax.block_until_ready(self.publisher.copy(step.state)))

    # ---- the batch and the result --------------------------------------------------------------
    def _batch(self, step: _Step) -> TrainBatch:
        """The step's whole batch, with the outputs of the inference units that ran piece by piece."""
        if step.batch is None:
            batch = concatenate_pieces([future.result() for future in step.rollout.pieces])
            outputs = step.piece_outputs
            if outputs[0]:
                batch = batch.replace(**{key: jnp.concatenate([o[key] for o in outputs]) for key in outputs[0]})
            step.batch = batch
        return step.batch

    def _result(self, step: _Step) -> StepResult:
        rollout = step.rollout
        completions = [c for future in rollout.pieces for c in future.result().completions]
        lengths = np.array([c.length for c in completions])
        metrics = step.metrics
        metrics.update(rollout.metrics)
        metrics.update(_version_lag(rollout.step, completions))
        metrics.update({
            "staleness": float(rollout.step - rollout.version),
            "weights_version": float(rollout.version),
            "response_length": float(lengths.mean()),
            "tokens": float(lengths.sum()),
            "dispatches": float(self.dispatches_per_step[-1]),
        })
        if self.programs.episodes is not None:  # multi-turn: tool-output tokens per sequence (in `tokens`, no loss)
            metrics["tool_tokens"] = float(np.mean([np.count_nonzero(~c.loss_mask) for c in completions]))
        return StepResult(step=rollout.step, version=rollout.version, metrics=metrics, data_state=rollout.data_state,
                          completions=completions, examples=rollout.examples, rewards=step.rewards,
                          carry=rollout.carry)


def _version_lag(step: int, completions: Sequence[Any]) -> dict[str, float]:
    """The spread of the trained tokens' weights versions: how many versions each lags the trainer at `step`."""
    versions = np.concatenate([c.versions() for c in completions])
    if not len(versions) or (versions < 0).any():  # no token, or a version unknown
        return {}
    lag = step - versions
    return {"version_lag/min": float(lag.min()), "version_lag/max": float(lag.max()), "version_lag/mean": float(lag.mean())}


def _merge_metrics(target: dict[str, float], metrics: dict[str, Any], prefix: str = "") -> None:
    for key, value in metrics.items():
        array = np.asarray(value)
        if array.size == 1:
            target[prefix + key] = float(array)


def _split_rows(batch: TrainBatch, pieces: int) -> list[TrainBatch]:
    if pieces == 1:
        return [batch]
    rows = batch.batch_size
    if rows % pieces:
        raise GraphError(f"{rows} rows cannot be split into {pieces} micro-batches")
    size = rows // pieces
    return [jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch) for i in range(pieces)]
