"""The single controller: executes an RPEG step after step, in one loop whatever the mode.

The loop takes each step's rollout from a *source* (`rpegjax.runtime.sources`) and hands it to a consumer: the
*step executor* (`rpegjax.runtime.executor`), which runs every other execution unit of the graph in order (fused
groups as one program) and publishes the next weights version through the weight-sync stage
(`rpegjax.runtime.publishing`). The rollout stage (`rpegjax.runtime.rollout_stage`) generates step t from the
weights version `t - k` under asynchrony bound k, read off the graph's generate edge, and waits for it; its
rewards, their shaping and the reward metrics are the *scorer*'s (`rpegjax.runtime.scoring`). So with k = 0
generation and training alternate exactly (synchronous on-policy RL), and with k >= 1 generation of the next k
steps overlaps training.

The source decides the mode:
- threaded (`concurrent_rollout=True`, one process): a rollout worker thread generates ahead, within the bound;
- inline (`concurrent_rollout=False`): several processes on one mesh must launch the same device programs in the
  same order, which two threads cannot promise; step t's rollout is generated in the calling thread right before
  step t trains. The weights each rollout reads, and so every result, are the same; only the overlap is lost;
- received: when generation and training are placed on disjoint groups of processes (`rpegjax.runtime.roles`),
  each process takes the role of the devices it owns. A training process receives each rollout from the
  generation processes, piece by piece as they arrive, so its inference starts on the first pieces; a generation
  process runs the same loop over a threaded source with weights pulled from the training processes, its
  consumer sending each piece as it finishes (`rpegjax.runtime.sending`; `run` returns once the training
  processes say the run ended). Only its worker thread launches device programs: the sender moves host data.
  Weights and rollout pieces cross between the groups through `jax.experimental.transfer` (`RoleLinks`), never
  through a collective spanning both groups; the staleness bound and every number are those of the one-process
  run. With partial rollouts the pieces carry every token's weights version, each step's groups in flight follow
  its last piece to the training processes (which checkpoint them) and a resumed run's go back at the start; with
  weights in flight the generation process takes the newest version the training processes have offered between
  decode chunks (`PulledWeights.newest`), which then offer every version a step may take.

Placement: generation runs where the graph places it (the sampler's mesh), every other device stage on the
training devices (the learner's mesh); `check_placements` refuses programs built elsewhere. When the two are
disjoint device sets (a disaggregated graph) the rollout's and the trainer's device work run on separate
devices, and the weight-sync stage moves the weights across. An inference stage may ask for a layout of its own
on the training devices; it then runs on weights re-sharded to it (`StagePrograms.infer`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator
from rpegjax.distributed.hosts import ProcessAddress
from rpegjax.graph.ir import INFERENCE_KINDS, Graph, GraphError, StageKind
from rpegjax.graph.trace import Trace
from rpegjax.learners.group_filter import DynamicSamplingConfig
from rpegjax.runtime.executor import StepExecutor, StepResult
from rpegjax.runtime.meshes import device_ids, same_layout, stage_mesh
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig
from rpegjax.runtime.programs import StagePrograms
from rpegjax.runtime.publishing import WeightPublisher
from rpegjax.runtime.roles import Role, RoleLinks, process_groups
from rpegjax.runtime.rollout_stage import Rollout, RolloutStage
from rpegjax.runtime.scoring import Scorer
from rpegjax.runtime.sending import PulledWeights, RolloutSender
from rpegjax.runtime.sources import InlineSource, ReceivedSource, RolloutSource, ThreadedSource
from rpegjax.runtime.versions import ParameterStore, RuntimeStopped, generation_version

__all__ = ["Runtime", "StepResult", "check_placements"]


class Runtime:
    """Executes `graph` with `programs`; owns the parameter store, the rollout stage, the step executor and the trace.

    `prompt_ids(examples) -> list[list[int]]` tokenises a batch of examples (host work, done by the rollout
    stage). `key` seeds generation: step t samples with `fold_in(key, t)`, so runs are reproducible whatever the
    thread timing. `concurrent_rollout=False` generates in the calling thread instead of a worker thread (the
    same results, without overlap; required with several processes, see above). `dynamic_sampling`: keep only
    groups whose rewards differ, sampling more rounds of prompts (`rpegjax.runtime.rollout_stage`).
    `reward_shaping(lengths) -> term`: an additive reward term from the response lengths (int [rows] -> float
    [rows]). `address`: where this process's transfer server listens in a run over process groups. `partial`:
    partial rollouts (`rpegjax.runtime.partial_rollouts`).
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
        address: ProcessAddress = ProcessAddress(),
        partial: PartialRolloutConfig | None = None,
    ):
        graph.validate()
        if partial is not None:
            _check_partial(programs, dynamic_sampling)
        self.partial = partial
        self.concurrent_rollout = concurrent_rollout
        if dynamic_sampling is not None and programs.group_size < 2:  # a group of one never has differing rewards
            raise ValueError(f"dynamic sampling needs groups of at least 2 samples, got group_size={programs.group_size}")
        self.graph = graph
        self.programs = programs
        self.data = data
        self.trace = trace if trace is not None else Trace(graph.name)
        self.store = ParameterStore()
        self.scorer = Scorer(programs.collect_rewards, reward_shaping)
        self.rollout_stage = RolloutStage(graph, programs, data, prompt_ids=prompt_ids, key=key, trace=self.trace,
                                     weights=self.store.get, scorer=self.scorer, dynamic_sampling=dynamic_sampling,
                                     partial=partial, newest=self.store.newest)
        self.async_bound = self.rollout_stage.async_bound
        self.stage_meshes = check_placements(graph, programs)
        self.groups = process_groups(graph)
        self.links: RoleLinks | None = None
        if self.groups is not None:
            self.links = self._link_groups(data, address)
            if self.role == Role.GENERATE:
                pulled = PulledWeights(self.links, self.store, self.trace)
                stage = self.rollout_stage
                stage.weights, stage.newest, stage.fetch = pulled, pulled.newest, pulled.fetch
            else:  # a piece arrives with every row's rewards (colocated, gathering them is a collective)
                self.scorer.collect = _arrived_rewards
        self.publisher = WeightPublisher(programs, self.store, self.trace, self.links)
        self.executor = StepExecutor(graph, programs, scorer=self.scorer, publisher=self.publisher, trace=self.trace,
                                     stage_meshes=self.stage_meshes, pieces=self.rollout_stage.pieces)

    @property
    def role(self) -> Role | None:
        """This process's role in a run over process groups (None: every process runs every stage)."""
        return None if self.groups is None else self.groups.role

    @property
    def dispatches_per_step(self) -> list[int]:
        """Device programs launched by each step's training units (inference, advantage, update, weight sync)."""
        return self.executor.dispatches_per_step

    @property
    def last_reward_error(self) -> str:
        """The message of the last failure of the reward function (empty: none yet)."""
        return self.scorer.last_reward_error

    def _link_groups(self, data: DataIterator, address: ProcessAddress) -> RoleLinks:
        """The transfers between the generation and the training processes (a collective of every process).
        Rewards are scored, and with dynamic sampling each round's gathered, by the generation processes alone."""
        self.rollout_stage.check_batch(data.batch_size)
        programs = self.programs
        programs.reward_processes = self.groups.generation
        partial = self.rollout_stage.partial
        return RoleLinks(self.graph, self.groups, weights_like=programs.generation_shapes(),
                         weights_staging=programs.staging_shardings(),
                         weights_targets=programs.sampler.params_sharding,
                         rows=data.batch_size // self.rollout_stage.pieces * programs.group_size,
                         length=programs.sequence_length, examples=data.examples, address=address,
                         carry=None if partial is None else (partial.capacity, programs.group_size))

    # ---- the step loop -------------------------------------------------------------------------
    def run(
        self,
        state: Any,
        *,
        start_step: int,
        num_steps: int,
        history: Sequence[tuple[int, Any]] = (),
        on_step: Callable[[StepResult, Any], None] | None = None,
        carry: dict[str, Any] | None = None,
    ) -> Any:
        """Runs steps `start_step .. start_step + num_steps - 1` from training `state` (the actor is at version
        `start_step`). `history` holds older generation-layout weights (version, params) that pending
        rollouts may read after a resume, `carry` the groups partial rollouts had in flight (`StepResult.carry` of
        step `start_step - 1`). Calls `on_step(result, state)` after each step; returns the state.

        Over process groups (`role`) a generation process runs the rollout loop (`state`, `history` and `on_step`
        are unused; it returns None once the training processes have received every rollout) and a training process
        every other stage; there `history` holds the versions in the staging layout (`StagePrograms.staged_sync`).
        With partial rollouts a generation process receives `carry` from the training processes."""
        steps = range(start_step, start_step + num_steps)
        if self.partial is not None and self.role == Role.GENERATE:
            carry = self.links.receive_start_carry()
        self.rollout_stage.restore_carry(carry)
        self.publisher.read_versions = {generation_version(step, self.async_bound) for step in steps}
        if self.partial is not None and self.partial.inflight_weights:  # step t may take any version up to t
            self.publisher.read_versions |= set(steps)
        if self.role == Role.GENERATE:
            self.rollout_stage.weights.offered = set(self.publisher.read_versions)
            return self._serve_generation(steps)
        if self.partial is not None and self.role == Role.TRAIN:
            self.links.send_start_carry(carry or {"groups": []})
        self.executor.publish_initial(state, start_step, history)
        training = _Training(self, self.programs.at_rest(state), on_step)
        self._loop(self._source(), training, steps)
        return training.state

    def _source(self) -> RolloutSource:
        """Where a training process gets its rollouts (see the module docstring)."""
        if self.role == Role.TRAIN:
            update = self.graph.stages_of_kind(StageKind.ACTOR_UPDATE)[0]
            return ReceivedSource(self.links, pieces=self.rollout_stage.pieces, async_bound=self.async_bound,
                                  data_state=self.data.state, trace=self.trace, placement=update.placement,
                                  shaping=self.scorer.shaping)
        return ThreadedSource(self.rollout_stage) if self.concurrent_rollout else InlineSource(self.rollout_stage)

    def _loop(self, source: RolloutSource, consume: _Consumer, steps: range) -> None:
        """The step loop: each step's rollout from `source`, handed to `consume`. A failure stops the parameter
        store (a rollout waiting for weights wakes) and closes the source and the consumer with it."""
        error = None
        source.start(steps)
        try:
            for step in steps:
                consume(source.next(step))
        except BaseException as failure:
            error = failure
            self.store.stop(failure)
            raise
        finally:
            self.store.stop(RuntimeStopped("run finished"))
            consume.close(error)
            source.close(error)

    def _serve_generation(self, steps: range) -> None:
        """A generation process: the step loop in a thread of its own, sending each rollout to the training
        processes, until they say the run ended (or the loop failed without being able to tell them)."""
        sender = RolloutSender(self.links, self.trace, self.rollout_stage.stage.placement,
                               pieces=self.rollout_stage.pieces, first_step=steps.start)
        failures: list[BaseException] = []

        def loop() -> None:
            try:  # generation in the source's worker thread; this one sends each piece as it finishes
                self._loop(ThreadedSource(self.rollout_stage), sender, steps)
            except BaseException as error:  # re-raised below, once the training processes have stopped
                failures.append(error)

        worker = threading.Thread(target=loop, name="rpegjax-send", daemon=True)
        worker.start()
        message = self.links.await_finish(give_up=sender.unsent.is_set)  # every rollout offered has been pulled
        if message is None or message["status"] == "ok":  # None: the loop failed and could not tell them
            worker.join()
        self.store.stop(RuntimeStopped("run finished"))
        if failures:
            raise failures[0]
        if message["status"] != "ok":  # not None here: the loop ends only by finishing or failing
            raise RuntimeStopped(f"the training processes failed: {message['message']}")


class _Consumer(Protocol):
    """What the step loop hands each rollout to: training (`_Training`) or sending it on (`RolloutSender`)."""

    def __call__(self, rollout: Rollout) -> None: ...

    def close(self, error: BaseException | None) -> None: ...


class _Training:
    """The consumer that trains on each rollout: the step executor, then the parameter store pruned and
    `on_step(result, state)` called."""

    def __init__(self, runtime: Runtime, state: Any, on_step: Callable[[StepResult, Any], None] | None):
        self.runtime = runtime
        self.state = state
        self.on_step = on_step

    def __call__(self, rollout: Rollout) -> None:
        runtime = self.runtime
        self.state, result = runtime.executor.run(self.state, rollout)
        # weights older than what the next k rollouts read are no longer needed
        runtime.store.prune(generation_version(rollout.step + 1, runtime.async_bound))
        if self.on_step is not None:
            self.on_step(result, self.state)

    def close(self, error: BaseException | None) -> None:
        pass


def _check_partial(programs: StagePrograms, dynamic_sampling: DynamicSamplingConfig | None) -> None:
    """Refuses partial rollouts where they are not built yet, naming what is in the way."""
    if dynamic_sampling is not None:
        raise ValueError("partial rollouts with dynamic sampling: not supported yet (a step's batch is the first "
                         "groups to complete; dynamic sampling filters rounds of one version); use one of them")
    if programs.episodes is not None:
        raise ValueError("partial rollouts with multi-turn episodes (rollout.env): not supported yet (an episode's "
                         "turns are not continued across steps)")


def _arrived_rewards(piece):
    """Every row's rewards of a piece received from the generation processes, and their summed statistics."""
    return piece.rewards.result()


def check_placements(graph: Graph, programs: StagePrograms) -> dict[str, Any]:
    """Checks that `programs` run every device stage where the graph places it; returns the meshes of the
    inference stages whose own layout differs from the learner's (they run re-sharded, see `StagePrograms.infer`).
    Programs used: `programs.mesh_of(kind)`.

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
