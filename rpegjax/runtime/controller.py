"""The single controller: executes an RPEG step after step.

Two threads share the work. The *rollout worker* runs the generation stage (and, through the host
reward pool, the reward stage) of step t as soon as the weights it may read exist: version
`t - k` under asynchrony bound k (read off the graph's generate edge). The *trainer* (the calling
thread) runs every other execution unit of the graph in order — fused groups as one program — and
publishes the next weights version through the weight-sync stage. So with k = 0 the two alternate
exactly (synchronous on-policy RL), and with k >= 1 generation of the next k steps overlaps training.

Fine-grained scheduling: when the generate stage has n micro-batches, its rollout is handed over in
n pieces of whole prompt groups as they finish (continuous batching), reward scoring of a piece starts
on the host at once, and inference stages with the same micro-batch count run on each piece while
the tail of the rollout is still decoding.

Dynamic sampling (DAPO; `rpegjax.learners.group_filter`) is part of the rollout stage: with it, the
stage waits for each round's rewards, keeps the groups whose rewards differ and generates further rounds of
prompts, with the same weights version, until the step's batch holds as many groups as prompts per step
(or the extra-round cap is reached). The trainer receives a batch of the usual shape, every row generated
with version t - k, so the asynchrony bound and the version bookkeeping are those of a plain rollout. Pieces
of the batch are handed over as soon as their groups are kept, the last one when the stage ends.

Reward shaping (e.g. DAPO's overlong penalty) is an additive term of the response lengths: advantages and
dynamic sampling read task reward + shaping; the `reward` and `accuracy` metrics are the task's, over every
sequence sampled in the step.

Placement: generation runs where the graph places it (the sampler's mesh), every other device stage on the
training devices (the learner's mesh); `check_placements` refuses programs built elsewhere. When the two are
disjoint device sets (a disaggregated graph) the rollout worker's and the trainer's device work run on separate
devices, and the weight-sync stage moves the weights across. An inference stage may ask for a layout of its own
on the training devices; it then runs on weights re-sharded to it (`StagePrograms.infer`).

Several processes on one mesh (`rpegjax.distributed`) must launch the same device programs in the
same order, which two threads cannot promise; there the runtime runs with `concurrent_rollout=False`:
step t's rollout is generated in the calling thread right before step t trains. The weights each
rollout reads, and so every result, are the same as with the worker thread; only the overlap is lost.

When generation and training are placed on disjoint groups of processes (`rpegjax.runtime.roles`), each process
takes the role of the devices it owns: a generation process runs the rollout loop alone (its worker thread; `run`
returns once the training processes say the run ended), a training process every other stage. Weights version v
and each rollout piece cross between the groups through `jax.experimental.transfer` (`RoleLinks`), never through
a collective spanning both groups; the staleness bound and every number are those of the one-process run.

Every stage execution is recorded in a `Trace` (stage, step, weights version, placement, start, end);
device stages block on their outputs inside the span so the measured timeline is honest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator
from rpegjax.graph.ir import (
    INFERENCE_KINDS,
    UPDATE_KINDS,
    Graph,
    GraphError,
    Payload,
    StageKind,
)
from rpegjax.graph.trace import Trace
from rpegjax.learners.group_filter import DynamicSamplingConfig, GroupBatchFiller
from rpegjax.rewards.runner import RewardStats, term_metrics
from rpegjax.runtime.meshes import device_ids, same_layout, stage_mesh
from rpegjax.runtime.programs import Piece, StagePrograms, concatenate_pieces
from rpegjax.runtime.roles import Role, RoleLinks, process_groups
from rpegjax.runtime.sampled_groups import SampledGroup, group_piece, split_groups
from rpegjax.runtime.versions import ParameterStore, RuntimeStopped, generation_version


@dataclasses.dataclass(frozen=True)
class RolloutScores:
    """What the advantage stage reads, per row of the step's batch, and the step's reward metrics."""

    task: np.ndarray  # float32 [rows]: the task's rewards
    shaping: np.ndarray  # float32 [rows]: the additive shaping term (zeros without shaping)
    metrics: dict[str, float]


@dataclasses.dataclass
class Rollout:
    """One step's rollout as the trainer receives it; pieces are filled in by the worker as they finish.
    With dynamic sampling the rollout stage also sets `scores` and the final `data_state` before it hands
    over the last piece."""

    step: int
    version: int
    examples: list[Example]
    pieces: list[concurrent.futures.Future]
    data_state: dict[str, Any]  # the data iterator's position after this step's batch (and extra rounds)
    scores: RolloutScores | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    step: int
    version: int  # weights version the rollout was generated with
    metrics: dict[str, float]
    data_state: dict[str, Any]
    completions: list[Any]
    examples: list[Example] = dataclasses.field(default_factory=list)  # the step's prompts (Completion.prompt_index)
    rewards: np.ndarray | None = None  # float32 [completions], in the order of `completions`


def _block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def _merge_metrics(target: dict[str, float], metrics: dict[str, Any], prefix: str = "") -> None:
    for key, value in metrics.items():
        array = np.asarray(value)
        if array.size == 1:
            target[prefix + key] = float(array)


class Runtime:
    """Executes `graph` with `programs`; owns the parameter store, the rollout worker and the trace.

    `prompt_ids(examples) -> list[list[int]]` tokenises a batch of examples (host work, done by the
    worker). `key` seeds generation: step t samples with `fold_in(key, t)`, so runs are reproducible
    whatever the thread timing. `concurrent_rollout=False` generates in the calling thread instead of a
    worker thread (the same results, without overlap; required with several processes, see above).
    `dynamic_sampling`: keep only groups whose rewards differ, sampling more rounds of prompts (see above);
    extra round r of step t samples with `fold_in(fold_in(key, t), r)`. `reward_shaping(lengths) -> term`:
    an additive reward term from the response lengths (int [rows] -> float [rows]).
    """

    def __init__(
        self,
        graph: Graph,
        programs: StagePrograms,
        data: DataIterator,
        *,
        prompt_ids: Callable[[Sequence[Example]], list[list[int]]],
        key: jax.Array,
        trace: Trace | None = None,
        concurrent_rollout: bool = True,
        dynamic_sampling: DynamicSamplingConfig | None = None,
        reward_shaping: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        graph.validate()
        self.concurrent_rollout = concurrent_rollout
        if dynamic_sampling is not None and programs.group_size < 2:  # a group of one never has differing rewards
            raise ValueError(f"dynamic sampling needs groups of at least 2 samples, got group_size={programs.group_size}")
        self.dynamic_sampling = dynamic_sampling
        self.reward_shaping = reward_shaping
        self.graph = graph
        self.programs = programs
        self.data = data
        self.prompt_ids = prompt_ids
        self.key = key
        self.trace = trace if trace is not None else Trace(graph.name)
        self.store = ParameterStore()
        generates = graph.stages_of_kind(StageKind.GENERATE)
        if len(generates) != 1:
            raise GraphError(f"the runtime needs exactly one generate stage, found {len(generates)}")
        self.generate_stage = generates[0]
        weight_edges = [e for e in graph.in_edges(self.generate_stage.name) if e.payload == Payload.ACTOR_GENERATE_PARAMS]
        if len(weight_edges) != 1:
            raise GraphError(f"stage {self.generate_stage.name!r} must read {Payload.ACTOR_GENERATE_PARAMS} over one edge",
                             stage=self.generate_stage.name)
        self.weight_edge = weight_edges[0]
        self.async_bound = self.weight_edge.version_offset - 1
        rollout_kinds = {StageKind.GENERATE, StageKind.REWARD}
        self.stage_meshes = check_placements(graph, programs)
        self.train_units = [unit for unit in graph.execution_units()
                            if not set(self._kinds(unit)) <= rollout_kinds]
        self.pieces = self.generate_stage.microbatches
        self.dispatches_per_step: list[int] = []
        self.last_reward_error = ""
        self._read_versions: set[int] | None = None  # weights versions the run's rollouts read (set by `run`)
        self.groups = process_groups(graph)
        self.links: RoleLinks | None = None
        if self.groups is not None:
            self.links = self._link_groups(data)

    @property
    def role(self) -> Role | None:
        """This process's role in a run over process groups (None: every process runs every stage)."""
        return None if self.groups is None else self.groups.role

    def _link_groups(self, data: DataIterator) -> RoleLinks:
        """The transfers between the generation and the training processes (a collective of every process)."""
        if self.dynamic_sampling is not None:
            raise ValueError("dynamic sampling decides on every round's rewards gathered over the generation "
                             "processes; over separate process groups it is not supported yet")
        if data.batch_size % self.pieces:
            raise GraphError(f"stage {self.generate_stage.name!r}: {data.batch_size} prompts per step cannot be "
                             f"split into {self.pieces} micro-batches", stage=self.generate_stage.name)
        self.programs.reward_processes = self.groups.generation
        return RoleLinks(self.graph, self.groups, weights_like=self.programs.generation_shapes(),
                         weights_staging=self.programs.staging_shardings(),
                         weights_targets=self.programs.sampler.params_sharding,
                         rows=data.batch_size // self.pieces * self.programs.group_size,
                         length=self.programs.sequence_length, examples=data.examples)

    # ---- helpers -------------------------------------------------------------------------------
    def _kinds(self, unit: Sequence[str]) -> tuple[StageKind, ...]:
        kinds: list[StageKind] = []
        for name in unit:
            for kind in self.graph.stage(name).kinds:
                if kind not in kinds:
                    kinds.append(kind)
        return tuple(kinds)

    def _devices(self, unit: Sequence[str]) -> str:
        return self.graph.stage(unit[0]).placement

    def _unit_name(self, unit: Sequence[str]) -> str:
        return "+".join(unit)

    # ---- rollout worker ------------------------------------------------------------------------
    def _rollout_loop(self, start: int, end: int, out: queue.Queue) -> None:
        try:
            for step in range(start, end):
                rollout, params = self._start_rollout(step)
                out.put(rollout)
                self._generate(rollout, params)
        except RuntimeStopped:
            return
        except BaseException as error:  # handed to the trainer, which raises it
            out.put(error)

    def _start_rollout(self, step: int) -> tuple[Rollout, Any]:
        """Step `step`'s rollout with its pieces pending, and the weights it reads (waits for them)."""
        version = self.weight_edge.read_version(step)
        assert version == generation_version(step, self.async_bound)
        params = self.store.get(version)
        examples = self.data.next_batch()
        if len(examples) % self.pieces:
            raise GraphError(f"stage {self.generate_stage.name!r}: {len(examples)} prompts per step cannot be "
                             f"split into {self.pieces} micro-batches", stage=self.generate_stage.name)
        rollout = Rollout(step=step, version=version, examples=examples,
                          pieces=[concurrent.futures.Future() for _ in range(self.pieces)],
                          data_state=self.data.state())
        return rollout, params

    def _generate(self, rollout: Rollout, params: Any) -> None:
        """Runs the generate stage of `rollout`, completing its pieces as they finish."""
        step, version = rollout.step, rollout.version
        try:
            with self.trace.span(self.generate_stage.name, step, version, self.generate_stage.placement):
                if self.dynamic_sampling is not None:
                    self._generate_filled(rollout, params)
                    return
                prompts, key = self.prompt_ids(rollout.examples), jax.random.fold_in(self.key, step)
                for piece in self.programs.generate(params, rollout.examples, prompts, key=key, version=version,
                                                    pieces=self.pieces):
                    self._trace_reward(piece, step)
                    rollout.pieces[piece.index].set_result(piece)
        except BaseException as error:
            for future in rollout.pieces:
                if not future.done():
                    future.set_exception(error)
            raise

    def _generate_filled(self, rollout: Rollout, params: Any) -> None:
        """Dynamic sampling: rounds of generation with `rollout`'s weights until its batch holds one group with
        differing rewards per prompt of the step (or the cap is reached); see the module docstring."""
        step, version, group_size = rollout.step, rollout.version, self.programs.group_size
        target = len(rollout.examples)
        per_piece = target // self.pieces
        filler: GroupBatchFiller[SampledGroup] = GroupBatchFiller(target, group_size, self.dynamic_sampling,
                                                                   where=f"step {step}: ")
        examples, handed, generated_tokens = rollout.examples, 0, 0
        sampled_task, sampled_shaping, stats = [], [], []
        while True:
            key = jax.random.fold_in(self.key, step)
            key = jax.random.fold_in(key, filler.rounds) if filler.rounds else key
            pieces = []
            for piece in self.programs.generate(params, examples, self.prompt_ids(examples), key=key, version=version,
                                                pieces=self.pieces):
                self._trace_reward(piece, step)
                pieces.append(piece)
                generated_tokens += sum(c.length for c in piece.completions)
            rewards, groups = [], []
            for piece in sorted(pieces, key=lambda p: p.index):  # collecting rewards is a collective: one order
                task, piece_stats = self.programs.collect_rewards(piece)
                shaping = self._shaping(piece.completions)
                sampled_task.append(task)
                sampled_shaping.append(shaping)
                stats.append(piece_stats)
                rewards.append(task + shaping)
                groups += split_groups(piece, task, shaping, group_size)
            filler.add_round(np.concatenate(rewards), groups)
            # every piece but the last goes downstream as soon as its groups are kept: its inference can start
            while handed < self.pieces - 1 and len(filler.kept) >= (handed + 1) * per_piece:
                chunk = filler.kept[handed * per_piece:(handed + 1) * per_piece]
                rollout.pieces[handed].set_result(group_piece(handed, chunk, np.ones(per_piece, bool)))
                handed += 1
            if not filler.needs_more:
                break
            examples = self.data.next_batch()
        filled = filler.finish()
        task = np.concatenate([g.task for g in filled.groups])
        shaping = np.concatenate([g.shaping for g in filled.groups])
        metrics = self._reward_metrics(np.concatenate(sampled_task), np.concatenate(sampled_shaping), stats)
        metrics.update(filled.metrics)
        metrics["dynamic_sampling/generated_sequences"] = float(sum(len(t) for t in sampled_task))
        metrics["dynamic_sampling/generated_tokens"] = float(generated_tokens)
        trained = np.repeat(filled.trained, group_size)
        if trained.any():
            metrics["dynamic_sampling/batch_reward"] = float(task[trained].mean())
        rollout.scores = RolloutScores(task=task, shaping=shaping, metrics=metrics)
        rollout.data_state = self.data.state()
        for index in range(handed, self.pieces):
            chunk = slice(index * per_piece, (index + 1) * per_piece)
            rollout.pieces[index].set_result(group_piece(index, filled.groups[chunk], filled.trained[chunk]))

    def _shaping(self, completions: Sequence[Any]) -> np.ndarray:
        if self.reward_shaping is None:
            return np.zeros(len(completions), np.float32)
        term = np.asarray(self.reward_shaping(np.array([c.length for c in completions], np.int64)), np.float32)
        if term.shape != (len(completions),) or not np.isfinite(term).all():
            raise ValueError(f"reward_shaping must return one finite value per sequence ({len(completions)}), got "
                             f"{term!r}")
        return term

    def _trace_reward(self, piece: Piece, step: int) -> None:
        rewards = self.graph.stages_of_kind(StageKind.REWARD)
        if not rewards:
            return
        start = self.trace.now()
        stage = rewards[0]

        def done(_: concurrent.futures.Future) -> None:
            self.trace.record(stage=stage.name, step=step, version=None, devices=stage.placement, start=start,
                              end=self.trace.now(), microbatch=piece.index if self.pieces > 1 else None)

        piece.rewards.add_done_callback(done)

    # ---- trainer -------------------------------------------------------------------------------
    def run(
        self,
        state: Any,
        *,
        start_step: int,
        num_steps: int,
        history: Sequence[tuple[int, Any]] = (),
        on_step: Callable[[StepResult, Any], None] | None = None,
    ) -> Any:
        """Runs steps `start_step .. start_step + num_steps - 1` from training `state` (the actor is at version
        `start_step`). `history` holds older generation-layout weights (version, params) that pending
        rollouts may read after a resume. Calls `on_step(result, state)` after each step; returns the state.

        Over process groups (`role`) a generation process runs the rollout loop (`state`, `history` and `on_step`
        are unused; it returns None once the training processes have received every rollout) and a training process
        every other stage; there `history` holds the versions in the staging layout (`StagePrograms.staged_sync`)."""
        self._read_versions = {generation_version(step, self.async_bound)
                               for step in range(start_step, start_step + num_steps)}
        if self.role == Role.GENERATE:
            return self._run_generation(start_step, start_step + num_steps)
        for version, params in history:
            self._publish(version, params)
        with self.trace.span(self.graph.stage(self._sync_unit()[0]).name, start_step, start_step,
                             self._devices(self._sync_unit())):
            self._publish(start_step, _block(self._sync(state)))
        if self.role == Role.TRAIN:
            return self._run_training(state, start_step, start_step + num_steps, on_step)
        rollouts: queue.Queue = queue.Queue()
        worker = None
        if self.concurrent_rollout:
            worker = threading.Thread(target=self._rollout_loop, args=(start_step, start_step + num_steps, rollouts),
                                      name="rpegjax-rollout", daemon=True)
            worker.start()
        try:
            for step in range(start_step, start_step + num_steps):
                if worker is None:
                    rollout, params = self._start_rollout(step)
                    self._generate(rollout, params)
                else:
                    rollout = rollouts.get()
                if isinstance(rollout, BaseException):
                    raise rollout
                state, result = self._train_step(state, rollout)
                # weights older than what the next k rollouts read are no longer needed
                self.store.prune(generation_version(step + 1, self.async_bound))
                if on_step is not None:
                    on_step(result, state)
        except BaseException as error:
            self.store.stop(error)
            raise
        finally:
            self.store.stop(RuntimeStopped("run finished"))
            if worker is not None:
                worker.join(timeout=60)
        return state

    def _sync(self, state: Any) -> Any:
        """The weight-sync stage's copy: the generation layout (on the generation devices, or over the training
        devices when a transfer takes it to the generation processes)."""
        return self.programs.sync(state) if self.links is None else self.programs.staged_sync(state)

    def _publish(self, version: int, params: Any) -> None:
        """Makes weights `version` readable by generation: the store, and over process groups a transfer (only of
        the versions a rollout of this run reads: an offer is held until it is pulled)."""
        self.store.put(version, params)
        if self.links is not None and version in self._read_versions:
            self.links.send_weights(version, params, self.trace.now)

    # ---- process groups ------------------------------------------------------------------------
    def _run_generation(self, start: int, end: int) -> None:
        """A generation process: the rollout loop in its thread, until the training processes say the run ended
        (or the loop failed without being able to tell them)."""
        failures: list[BaseException] = []
        unsent = threading.Event()

        def loop() -> None:
            try:
                self._generation_loop(start, end, unsent)
            except BaseException as error:  # re-raised below, once the training processes have stopped
                failures.append(error)

        worker = threading.Thread(target=loop, name="rpegjax-rollout", daemon=True)
        worker.start()
        message = self.links.await_finish(give_up=unsent.is_set)  # every rollout offered has been pulled
        if message is not None and message["status"] == "ok":
            worker.join()
        self.store.stop(RuntimeStopped("run finished"))
        if failures:
            raise failures[0]
        if message["status"] != "ok":
            raise RuntimeStopped(f"the training processes failed: {message['message']}")

    def _generation_loop(self, start: int, end: int, unsent: threading.Event) -> None:
        """Rollouts of steps `start..end-1`, each from the weights version the bound allows (pulled from the
        training processes once, kept while later steps read it), each piece sent to the training processes
        with this process's block of its rewards. A failure is sent in place of the pieces not sent yet (`unsent`
        is set when even that fails)."""
        step, sent = start, set()
        try:
            for step in range(start, end):
                sent = set()
                version = generation_version(step, self.async_bound)
                if version not in self.store.versions():
                    self.store.prune(version)  # versions only grow: older ones are read by no later step
                    self.store.put(version, self.links.receive_weights(version, self.trace.now))
                rollout, params = self._start_rollout(step)
                self._generate(rollout, params)
                for future in rollout.pieces:
                    piece = future.result()
                    rewards, stats = piece.rewards.result()
                    self.links.send_piece(step, self.pieces, piece, version=rollout.version, examples=rollout.examples,
                                          data_state=rollout.data_state, rewards=rewards, stats=stats)
                    sent.add(piece.index)
        except BaseException as error:
            try:
                for index in range(self.pieces):
                    if index not in sent:
                        self.links.send_failure(step, index, self.pieces, error)
            except BaseException:
                unsent.set()
            raise

    def _run_training(self, state: Any, start: int, end: int,
                      on_step: Callable[[StepResult, Any], None] | None) -> Any:
        """A training process: every stage but generation, each step's rollout received from the generation
        processes; the end of the run (or its failure) is sent to them."""
        try:
            for step in range(start, end):
                state, result = self._train_step(state, self._receive_rollout(step))
                self.store.prune(generation_version(step + 1, self.async_bound))
                if on_step is not None:
                    on_step(result, state)
        except BaseException as error:
            self.links.finish(error)
            raise
        finally:
            self.store.stop(RuntimeStopped("run finished"))
        self.links.finish()
        return state

    def _receive_rollout(self, step: int) -> Rollout:
        received = [self.links.receive_piece(step, index, self.pieces, base_data_state=self.data.state())
                    for index in range(self.pieces)]
        version = generation_version(step, self.async_bound)
        if any(r.version != version for r in received):
            raise RuntimeError(f"step {step}: the rollout was generated with weights version "
                               f"{[r.version for r in received]}, the bound allows only {version}")
        futures = []
        for r in received:
            futures.append(concurrent.futures.Future())
            futures[-1].set_result(r.piece)
        last = received[-1]
        return Rollout(step=step, version=version, examples=last.examples, pieces=futures, data_state=last.data_state)

    def _sync_unit(self) -> tuple[str, ...]:
        for unit in self.train_units:
            if StageKind.WEIGHT_SYNC in self._kinds(unit):
                return unit
        raise GraphError("the graph has no weight_sync stage; generation could never see new weights")

    def _train_step(self, state: Any, rollout: Rollout) -> tuple[Any, StepResult]:
        step, programs = rollout.step, self.programs
        dispatches_before = programs.dispatches
        metrics: dict[str, float] = {}
        piece_outputs: list[dict[str, jax.Array]] = [dict() for _ in range(self.pieces)]
        batch = rewards = None
        for unit in self.train_units:
            kinds = self._kinds(unit)
            name, devices = self._unit_name(unit), self._devices(unit)
            microbatches = self.graph.stage(unit[0]).microbatches
            if set(kinds) <= INFERENCE_KINDS:
                mesh = self.stage_meshes.get(unit[0])
                if microbatches == self.pieces:  # piece by piece, as the rollout finishes
                    for index, future in enumerate(rollout.pieces):
                        piece = future.result()
                        with self.trace.span(name, step, step, devices, microbatch=index if self.pieces > 1 else None):
                            piece_outputs[index].update(_block(programs.infer(kinds, state, piece.batch, mesh)))
                    continue
                batch = batch if batch is not None else self._assemble(rollout, piece_outputs)
                with self.trace.span(name, step, step, devices):
                    outputs = [programs.infer(kinds, state, chunk, mesh) for chunk in _split_rows(batch, microbatches)]
                    merged = {k: jnp.concatenate([o[k] for o in outputs]) for k in outputs[0]}
                    batch = batch.replace(**_block(merged))
            elif StageKind.ADVANTAGE in kinds:
                batch = batch if batch is not None else self._assemble(rollout, piece_outputs)
                batch, reward_metrics = self._attach_rewards(rollout, batch)
                rewards = batch.rewards
                metrics.update(reward_metrics)
                with self.trace.span(name, step, step, devices):
                    batch, advantage_metrics = programs.advantages(batch)
                    _block(batch.advantages)
                _merge_metrics(metrics, advantage_metrics, "advantage/")
            elif set(kinds) & UPDATE_KINDS:
                if batch is None:
                    raise GraphError(f"stage {unit[0]!r} runs before the advantage stage", stage=unit[0])
                with self.trace.span(name, step, step, devices):
                    state, update_metrics = programs.update(kinds, state, batch)
                    update_metrics = jax.device_get(update_metrics)
                _merge_metrics(metrics, update_metrics)
            elif StageKind.WEIGHT_SYNC in kinds:
                with self.trace.span(name, step, step + 1, devices):
                    self._publish(step + 1, _block(self._sync(state)))
            else:
                raise GraphError(f"the runtime cannot execute stage kinds {[k.value for k in kinds]} of {unit}",
                                 stage=unit[0])
        self.dispatches_per_step.append(programs.dispatches - dispatches_before)
        pieces = [future.result() for future in rollout.pieces]
        completions = [c for piece in pieces for c in piece.completions]
        lengths = np.array([c.length for c in completions])
        metrics.update({
            "staleness": float(step - rollout.version),
            "weights_version": float(rollout.version),
            "response_length": float(lengths.mean()),
            "tokens": float(lengths.sum()),
            "dispatches": float(self.dispatches_per_step[-1]),
        })
        if self.programs.episodes is not None:  # multi-turn: tool-output tokens per sequence (in `tokens`, no loss)
            metrics["tool_tokens"] = float(np.mean([np.count_nonzero(~c.loss_mask) for c in completions]))
        return state, StepResult(step=step, version=rollout.version, metrics=metrics, data_state=rollout.data_state,
                                 completions=completions, examples=rollout.examples, rewards=rewards)

    def _assemble(self, rollout: Rollout, piece_outputs: list[dict[str, jax.Array]]):
        pieces = [future.result() for future in rollout.pieces]
        batch = concatenate_pieces(pieces)
        if piece_outputs[0]:
            batch = batch.replace(**{key: jnp.concatenate([o[key] for o in piece_outputs]) for key in piece_outputs[0]})
        return batch

    def _attach_rewards(self, rollout: Rollout, batch):
        """`batch` with the rewards the advantages read (task + shaping), and the step's reward metrics; a
        rollout of dynamic sampling was scored by the rollout stage."""
        if rollout.scores is None:
            task, shaping, stats = [], [], []
            for future in rollout.pieces:  # in piece order in every process: gathering rewards is a collective
                piece = future.result()
                # over process groups a piece arrives with every row's rewards
                piece_rewards, piece_stats = (piece.rewards.result() if self.links is not None
                                              else self.programs.collect_rewards(piece))
                task.append(piece_rewards)
                shaping.append(self._shaping(piece.completions))
                stats.append(piece_stats)
            task, shaping = np.concatenate(task).astype(np.float32), np.concatenate(shaping)
            rollout.scores = RolloutScores(task=task, shaping=shaping, metrics=self._reward_metrics(task, shaping, stats))
        scores = rollout.scores
        return batch.replace(rewards=(scores.task + scores.shaping).astype(np.float32)), dict(scores.metrics)

    def _reward_metrics(self, task: np.ndarray, shaping: np.ndarray, stats: Sequence[RewardStats]) -> dict[str, float]:
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


def check_placements(graph: Graph, programs: StagePrograms) -> dict[str, Any]:
    """Checks that `programs` run every device stage where the graph places it; returns the meshes of the
    inference stages whose own layout differs from the learner's (they run re-sharded, see `StagePrograms.infer`).

    Generation must run on its placement's devices with its layout (the sampler's mesh); every other device
    stage on the training devices (the learner's mesh) with the learner's layout, except inference stages,
    which may ask for another layout of those devices."""
    meshes = {}
    for stage in graph.stages:
        if stage.host:
            continue
        kind = StageKind.GENERATE if StageKind.GENERATE in stage.kinds else stage.kinds[0]
        have, want = programs.mesh_of(kind), stage_mesh(graph, stage.name)
        where = f"stage {stage.name!r} (placement {stage.placement!r}, layout {dict(want.shape)})"
        if device_ids(have) != device_ids(want):
            raise GraphError(f"{where} is placed on devices {sorted(device_ids(want))}, but its program runs on devices "
                             f"{sorted(device_ids(have))}; build the sampler and learner on the graph's placements "
                             "(rpegjax.runtime.meshes.stage_mesh)", stage=stage.name)
        if not same_layout(have, dict(want.shape)):
            if not set(stage.kinds) <= INFERENCE_KINDS:
                raise GraphError(f"{where}: its program's mesh has layout {dict(have.shape) if have else {}}; only "
                                 "inference stages can run with a layout of their own", stage=stage.name)
            meshes[stage.name] = want
    return meshes


def _split_rows(batch, pieces: int):
    if pieces == 1:
        return [batch]
    rows = batch.batch_size
    if rows % pieces:
        raise GraphError(f"{rows} rows cannot be split into {pieces} micro-batches")
    size = rows // pieces
    return [jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch) for i in range(pieces)]

