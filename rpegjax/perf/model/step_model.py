"""The analytical performance model: predict an RPEG's step time, per-stage times, memory and timeline.

`predict(graph, model, workload, hardware, options)` reads everything about the plan from the graph —
placements and their devices, per-stage parallel sizes, fused groups, micro-batches, the asynchrony bound,
a shared actor-critic trunk — and returns a `Prediction`:

* per stage: time (roofline + α–β collectives, `rpegjax.perf.model.stage_costs`), FLOPs, peak memory per device;
* per device: persistent state (weights, optimiser state of every model living there, the generation copy;
  an offloaded optimiser state is in host memory while generation runs, so generation sits beside less)
  plus the largest transient of the stages it runs (activations, gradients, KV cache, log-prob chunks);
  the KV cache takes what is left, which caps decode concurrency; a plan that does not fit says why;
* the predicted timeline (a `Trace` of predicted events, `rpegjax.perf.model.schedule`), steady-state step time,
  generated tokens per second and model FLOPs utilisation (useful FLOPs / (step time · devices · peak)).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Execution, Graph, Role, Stage, StageKind
from rpegjax.graph.trace import Trace
from rpegjax.models.config import ModelConfig
from rpegjax.perf.model import expert_costs, generation_stage, stage_costs
from rpegjax.perf.model import schedule as schedule_module
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.hardware import HardwareSpec
from rpegjax.perf.model.stage_costs import (
    CostInputs,
    ExecutionOptions,
    Layout,
    StageCost,
    Workload,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePrediction:
    name: str
    kind: str
    seconds: float
    compute_seconds: float
    memory_seconds: float
    communication_seconds: float
    overhead_seconds: float
    flops: float
    model_flops: float
    peak_memory_bytes: float  # per device of its placement while it runs (persistent + its transient)
    detail: Mapping[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    graph: Graph
    stages: tuple[StagePrediction, ...]
    step_seconds: float
    step_latency_seconds: float
    peak_memory_bytes: float
    memory_limit_bytes: float
    fits: bool
    problems: tuple[str, ...]
    tokens_per_second: float  # generated (response) tokens per second of steady state
    mfu: float
    model_flops_per_step: float
    trace: Trace | None

    def stage(self, name: str) -> StagePrediction:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no predicted stage {name!r}; stages: {[s.name for s in self.stages]}")

    def stage_seconds(self) -> dict[str, float]:
        return {s.name: s.seconds for s in self.stages}

    @property
    def needed_memory_bytes(self) -> float:
        """Per-GPU memory the plan needs: its peak, or the largest need of a stage that did not fit."""
        return max([self.peak_memory_bytes] + [s.peak_memory_bytes for s in self.stages if np.isfinite(s.peak_memory_bytes)])

    @property
    def fit_reason(self) -> str | None:
        """None when the plan fits; else "does not fit: needs X GB per GPU of Y GB usable (first problem)"."""
        if self.fits:
            return None
        first = self.problems[0] if self.problems else "unknown"
        if self.needed_memory_bytes > self.memory_limit_bytes:
            return (f"does not fit: needs {self.needed_memory_bytes / 1e9:.1f} GB per GPU of "
                    f"{self.memory_limit_bytes / 1e9:.1f} GB usable ({first})")
        return f"does not fit: {first}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe document: times of a plan that does not fit are null, with the reason beside them."""
        finite = lambda value: float(value) if np.isfinite(value) else None
        stages = []
        for s in self.stages:
            stage = {**dataclasses.asdict(s), "detail": {k: finite(v) for k, v in s.detail.items()}}
            stages.append({k: finite(v) if isinstance(v, float) else v for k, v in stage.items()})
        return {
            "graph": self.graph.name, "step_seconds": finite(self.step_seconds),
            "step_latency_seconds": finite(self.step_latency_seconds),
            "tokens_per_second": self.tokens_per_second if self.fits else None, "mfu": self.mfu if self.fits else None,
            "model_flops_per_step": self.model_flops_per_step, "peak_memory_bytes": self.peak_memory_bytes,
            "needed_memory_bytes": self.needed_memory_bytes, "memory_limit_bytes": self.memory_limit_bytes,
            "fits": self.fits, "reason": self.fit_reason, "problems": list(self.problems), "stages": stages,
        }


# ------------------------------------------------------------------------------------------- plan reading
def placement_devices(graph: Graph, name: str) -> tuple[int, ...]:
    """A placement's device indices (`Placement.device_indices`)."""
    return graph.placements[name].device_indices


@functools.lru_cache(maxsize=4096)
def device_index(devices: tuple[int, ...]) -> np.ndarray:
    """`devices` as a read-only index array (indexing per-device arrays with it is much faster than with a list;
    the planner does so for every stage of every candidate)."""
    index = np.asarray(devices, dtype=np.intp)
    index.setflags(write=False)
    return index


def stage_layout(graph: Graph, stage: Stage) -> Layout:
    return Layout.from_parallel(graph.parallel_of(stage.name), where=f"stage {stage.name!r}",
                                sequence_parallel=graph.execution.sequence_parallel)


def _home(graph: Graph, kind: StageKind, *, own_kind: bool = False) -> Stage | None:
    for stage in graph.stages:
        if (stage.kind is kind) if own_kind else (kind in stage.kinds):
            return stage
    return None


def _role_shape(role: Role, actor: ModelShape, critic: ModelShape) -> ModelShape:
    return critic if role is Role.CRITIC else actor


@dataclasses.dataclass(frozen=True)
class _Resident:
    """One model's persistent state on a set of devices."""

    what: str
    devices: tuple[int, ...]
    layout: Layout
    bytes_per_device: float
    offloaded: bool = False  # in host memory while the sampler generates (`Execution.optimizer_offload`)


def resident_state(graph: Graph, inputs: CostInputs) -> list[_Resident]:
    """Weights and optimiser states that stay on devices across stages, and the generation copy of the actor."""
    o, out = inputs.options, []
    for kind, shape, what in ((StageKind.ACTOR_UPDATE, inputs.actor, "actor"),
                              (StageKind.CRITIC_UPDATE, inputs.critic, "critic")):
        home = _home(graph, kind, own_kind=True)
        if home is not None:
            layout, devices = stage_layout(graph, home), placement_devices(graph, home.placement)
            out.append(_Resident(f"{what} weights", devices, layout, shape.weight_bytes / layout.shards))
            out.append(_Resident(f"{what} optimiser", devices, layout,
                                 stage_costs.optimizer_state_bytes(shape, layout, o), offloaded=o.optimizer_offload))
    reference = _home(graph, StageKind.REF_LOGPROB)
    if reference is not None:
        layout = stage_layout(graph, reference)
        out.append(_Resident("reference weights", placement_devices(graph, reference.placement), layout,
                             inputs.actor.weight_bytes / layout.shards))
    generate, actor = _home(graph, StageKind.GENERATE), _home(graph, StageKind.ACTOR_UPDATE)
    if generate is not None and actor is not None:
        gen_layout, gen_devices = stage_layout(graph, generate), placement_devices(graph, generate.placement)
        if o.replicated_generation_weights:  # rpegjax's sampler: its own copy in the compute dtype (weight sync
            # casts it, `rpegjax.models.precision.generation_cast`), split over the tensor axis only
            # (a MoE model's experts over its expert axis too)
            copy_bytes = expert_costs.generation_copy_params(inputs.actor, gen_layout) * inputs.actor.compute_bytes_each
            out.append(_Resident("generation weights", gen_devices, gen_layout, copy_bytes))
            return out
        same = gen_devices == placement_devices(graph, actor.placement) and (
            (gen_layout.fsdp, gen_layout.tensor) == (stage_layout(graph, actor).fsdp, stage_layout(graph, actor).tensor))
        if not same:
            out.append(_Resident("generation weights", gen_devices, gen_layout, inputs.actor.weight_bytes / gen_layout.shards))
    return out


def _host_problems(residents: list[_Resident], hardware: HardwareSpec) -> list[str]:
    """An offloaded optimiser state that the host memory of a device does not hold."""
    host = np.zeros(hardware.num_devices)
    for resident in residents:
        if resident.offloaded:
            host[device_index(resident.devices)] += resident.bytes_per_device
    if host.max() <= hardware.device.host_memory_bytes:
        return []
    return [f"offloaded optimiser state needs {host.max() / 1e9:.1f} GB of host memory per device, "
            f"{hardware.device.name} has {hardware.device.host_memory_bytes / 1e9:.1f} GB"]


def _persistent(residents: list[_Resident], num_devices: int, *, generating: bool = False) -> np.ndarray:
    """Bytes per device of the state that stays there: while training, or (`generating`) while the sampler
    decodes, when an offloaded optimiser state is in host memory."""
    memory = np.zeros(num_devices)
    for resident in residents:
        if not (generating and resident.offloaded):
            memory[device_index(resident.devices)] += resident.bytes_per_device
    return memory


def _phase(stage: Stage, persistent: np.ndarray, generating: np.ndarray) -> np.ndarray:
    """The persistent bytes per device that `stage` runs beside."""
    return generating if StageKind.GENERATE in stage.kinds else persistent


# ---------------------------------------------------------------------------------------------- stage costs
def _reshard_for(graph: Graph, stage: Stage, inputs: CostInputs) -> tuple[float, float]:
    """(seconds, transient bytes) to bring a model stage's weights from their home layout to the stage's own."""
    homes = {Role.ACTOR: _home(graph, StageKind.ACTOR_UPDATE, own_kind=True),
             Role.CRITIC: _home(graph, StageKind.CRITIC_UPDATE, own_kind=True)}
    home = homes.get(stage.role)
    if home is None or home.name == stage.name or StageKind.GENERATE in stage.kinds:
        return 0.0, 0.0
    source, target = stage_layout(graph, home), stage_layout(graph, stage)
    same_devices = placement_devices(graph, home.placement) == placement_devices(graph, stage.placement)
    if same_devices and (source.fsdp, source.tensor) == (target.fsdp, target.tensor):
        return 0.0, 0.0
    shape = _role_shape(stage.role, inputs.actor, inputs.critic)
    seconds = _transfer_seconds(graph, shape, home, stage, inputs.hardware)
    return seconds, shape.weight_bytes / target.shards


def _transfer_seconds(graph: Graph, shape: ModelShape, source: Stage, target: Stage, hardware: HardwareSpec) -> float:
    src_devices, dst_devices = placement_devices(graph, source.placement), placement_devices(graph, target.placement)
    level = max(hardware.level_index(src_devices[0], dst_devices[0]), hardware.level_index(src_devices[-1], dst_devices[-1]))
    return stage_costs.reshard_seconds(shape, stage_layout(graph, source), stage_layout(graph, target), hardware,
                                       same_devices=src_devices == dst_devices, crossing_level=level,
                                       senders=len(src_devices), receivers=len(dst_devices))


def stage_cost(graph: Graph, stage: Stage, inputs: CostInputs, persistent: np.ndarray) -> StageCost:
    """One execution of `stage` (all its merged kinds), before fusion with other stages."""
    kinds, device = stage.kinds, inputs.hardware.device
    if stage.host:
        cost = stage_costs.reward_cost(inputs) if StageKind.REWARD in kinds else StageCost(seconds=0.0)
        return _split(cost, stage.microbatches, 0.0)
    layout = stage_layout(graph, stage)
    devices = placement_devices(graph, stage.placement)
    if StageKind.GENERATE in kinds:
        if inputs.options.generation_memory_fraction is not None:
            budget = (inputs.options.generation_memory_fraction * inputs.hardware.device.reported_memory_bytes
                      - inputs.actor.weight_bytes / layout.shards)
        else:
            budget = inputs.hardware.usable_memory_bytes - float(persistent[device_index(devices)].max())
        return generation_stage.generation_cost(inputs, layout, kv_budget_bytes=budget, pieces=stage.microbatches,
                                                async_bound=graph.async_bound)
    if StageKind.WEIGHT_SYNC in kinds:
        readers = [graph.stage(name) for name in graph.consumers(stage.name)]
        generate = next((s for s in readers if StageKind.GENERATE in s.kinds), None)
        source = _home(graph, StageKind.ACTOR_UPDATE, own_kind=True)
        seconds = 0.0 if generate is None or source is None else _transfer_seconds(graph, inputs.actor, source, generate, inputs.hardware)
        return StageCost(seconds=seconds + device.dispatch_overhead_s, communication_seconds=seconds,
                         overhead_seconds=device.dispatch_overhead_s)
    if StageKind.ADVANTAGE in kinds:
        return _split(stage_costs.advantage_cost(inputs, layout), stage.microbatches, device.dispatch_overhead_s)
    reshard, copy_bytes = _reshard_for(graph, stage, inputs)
    shape = _role_shape(stage.role, inputs.actor, inputs.critic)
    if StageKind.ACTOR_UPDATE in kinds or StageKind.CRITIC_UPDATE in kinds:
        epochs, steps = int(stage.options.get("epochs", 1)), int(stage.options.get("minibatches", 1))
        cost = stage_costs.model_pass_cost(inputs, shape, layout, logits=True, backward=True, epochs=epochs, optimizer_steps=steps)
        if inputs.options.optimizer_offload:
            reshard += stage_costs.offload_seconds(shape, layout, inputs)
    else:
        logits = bool({StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB} & set(kinds))
        cost = stage_costs.model_pass_cost(inputs, shape, layout, logits=logits, backward=False, pieces=stage.microbatches,
                                           models=_fused_models(graph, stage))
    cost = dataclasses.replace(cost, seconds=cost.seconds + reshard, communication_seconds=cost.communication_seconds + reshard,
                               transient_bytes=cost.transient_bytes + copy_bytes)
    return _split(cost, stage.microbatches, device.dispatch_overhead_s)


def _fused_models(graph: Graph, stage: Stage) -> int:
    """Models whose forward passes run in `stage`'s program: one per inference stage of its fused group (the
    reference and the policy), each its own weights."""
    if stage.fused_group is None:
        return 1
    members = graph.fused_groups()[stage.fused_group]
    return sum(1 for name in members if set(graph.stage(name).kinds) & INFERENCE_KINDS) or 1


def _split(cost: StageCost, pieces: int, dispatch: float) -> StageCost:
    """The cost run in `pieces` pieces: one extra dispatch per piece, pieces complete evenly."""
    if pieces == 1:
        return cost
    return dataclasses.replace(cost, seconds=cost.seconds + (pieces - 1) * dispatch,
                               overhead_seconds=cost.overhead_seconds + (pieces - 1) * dispatch,
                               piece_fractions=tuple((j + 1) / pieces for j in range(pieces)))


# ------------------------------------------------------------------------------------------------- predict
def _shape(model: ModelShape | ModelConfig) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape.from_config(model)


def _cost_key(graph: Graph, stage: Stage, persistent: np.ndarray) -> tuple:
    """Everything a stage's cost depends on besides the fixed inputs: the stage, its placement, the layouts
    its weights come from (resharding) or go to (weight sync); for the sampler, the memory left on its devices."""
    if stage.host:
        return (stage,)  # reward time does not depend on the execution options
    if StageKind.GENERATE in stage.kinds:  # the sampler: its layout, pieces and the memory its devices leave only
        left = round(float(persistent[device_index(placement_devices(graph, stage.placement))].max()))
        # partial rollouts carry a group while its tokens lag at most max_token_lag: the versions beyond k
        execution = graph.execution
        carries = (generation_stage.partial_carries(execution.max_token_lag, graph.async_bound)
                   if execution.partial_rollouts else None)
        return (stage.kinds, stage.microbatches, stage_layout(graph, stage), left, carries,
                _execution_key(stage, execution))
    related = []
    for kind in (StageKind.ACTOR_UPDATE, StageKind.CRITIC_UPDATE):
        home = _home(graph, kind, own_kind=True)
        if home is not None:
            related.append((home.placement, graph.placements[home.placement], tuple(graph.parallel_of(home.name).items())))
    if StageKind.WEIGHT_SYNC in stage.kinds:
        for reader in graph.consumers(stage.name):
            reader_stage = graph.stage(reader)
            if not reader_stage.host:
                related.append((graph.placements[reader_stage.placement], tuple(graph.parallel_of(reader).items())))
    return stage, graph.placements[stage.placement], tuple(related), None, _execution_key(stage, graph.execution)


# The `Execution` fields only update stages' costs read: remat and micro-batches shape the backward pass, the
# optimiser's sharding and offload its state and the transfers around an update. The sampler sees the optimiser
# state only as the memory its devices leave, which is in its key. Every other field is in a non-update stage's key
# (tests/perf/model/test_step_model.py checks both ways, so a new field is keyed unless named here).
UPDATE_ONLY_FIELDS = frozenset({"remat", "update_microbatches", "optimizer_sharding", "optimizer_offload"})
_SHARED_FIELDS = tuple(f.name for f in dataclasses.fields(Execution) if f.name not in UPDATE_ONLY_FIELDS)


def _execution_key(stage: Stage, execution: Execution) -> tuple:
    """The execution options a stage's cost reads: an update's, all of them; any other stage's, all but the
    update-only ones (the planner varies those per plan; generation, the costliest to predict, reads none)."""
    if set(stage.kinds) & UPDATE_KINDS:
        return (execution,)  # every field (a frozen dataclass: hashed and compared field by field)
    return tuple(getattr(execution, name) for name in _SHARED_FIELDS)


def executed_shape(shape: ModelShape, execution: Execution) -> ModelShape:
    """`shape` as `execution` runs it: its precision, and a mixture-of-experts model's capacity mode
    (`Execution.moe_capacity_factor`); ValueError when a dense model is given a capacity factor."""
    experts = shape.experts
    if experts is None and execution.moe_capacity_factor is not None:
        raise ValueError(f"Execution.moe_capacity_factor={execution.moe_capacity_factor} needs a mixture-of-experts "
                         "model; this one is dense")
    if experts is not None:
        experts = dataclasses.replace(experts, capacity_factor=execution.moe_capacity_factor)
    return dataclasses.replace(shape, param_dtype=execution.param_dtype, compute_dtype=execution.dtype, experts=experts)


class Evaluator:
    """Predicts graphs for one model, workload, hardware and options, remembering stage costs across graphs
    (the planner evaluates thousands of graphs that share most stages)."""

    def __init__(self, model: ModelShape | ModelConfig, workload: Workload, hardware: HardwareSpec,
                 options: ExecutionOptions | None = None, *, critic: ModelShape | ModelConfig | None = None,
                 follow_graph: bool = False):
        actor = _shape(model)
        self.inputs = CostInputs(hardware=hardware, actor=actor, critic=actor if critic is None else _shape(critic),
                                 workload=workload, options=options or ExecutionOptions())
        self.follow_graph = follow_graph
        self._costs: dict[tuple, StageCost | str] = {}
        self._executing: dict[Execution, CostInputs] = {}

    @classmethod
    def for_runtime(cls, model: ModelShape | ModelConfig, workload: Workload, hardware: HardwareSpec,
                    options: ExecutionOptions | None = None, *, critic: ModelShape | ModelConfig | None = None) -> Evaluator:
        """Predicts graphs as rpegjax's runtime executes them: each graph's `Execution` (kernels, remat,
        precision, micro-batches, the experts' capacity mode) decides the options (`ExecutionOptions.executing`)
        and the costed shape (`executed_shape`); `options` gives only the efficiencies and overheads. The planner
        and `plan.py` predict this way; the validation against other systems' published runs uses those systems'
        own options instead."""
        return cls(model, workload, hardware, options, critic=critic, follow_graph=True)

    def inputs_for(self, graph: Graph) -> CostInputs:
        """The cost inputs `graph` is predicted with (its execution options and precision when following graphs)."""
        if not self.follow_graph:
            return self.inputs
        execution = graph.execution
        if execution not in self._executing:
            self._executing[execution] = dataclasses.replace(
                self.inputs, options=self.inputs.options.executing(execution),
                actor=executed_shape(self.inputs.actor, execution), critic=executed_shape(self.inputs.critic, execution))
        return self._executing[execution]

    def _check(self, graph: Graph) -> None:
        graph.validate()
        hardware = self.inputs.hardware
        if graph.num_devices > hardware.num_devices:
            raise ValueError(f"graph {graph.name!r} needs {graph.num_devices} devices, hardware {hardware.name!r} "
                             f"has {hardware.num_devices}")

    def stage_costs(self, graph: Graph) -> tuple[dict[str, StageCost], np.ndarray, list[str]]:
        """(cost per stage, persistent bytes per device, memory problems) for a validated graph."""
        inputs = self.inputs_for(graph)
        residents = resident_state(graph, inputs)
        persistent = _persistent(residents, graph.num_devices)
        generating = _persistent(residents, graph.num_devices, generating=True)
        limit = inputs.hardware.usable_memory_bytes
        problems = _host_problems(residents, inputs.hardware)
        for device_index in np.flatnonzero(persistent > limit)[:1]:
            held = [r.what for r in residents if device_index in r.devices]
            problems.append(f"device {device_index}: persistent state {persistent[device_index] / 1e9:.1f} GB "
                            f"({', '.join(held)}) exceeds the usable {limit / 1e9:.1f} GB")
        costs: dict[str, StageCost] = {}
        for stage in graph.stages:
            cost = self._remembered(graph, stage, inputs, _phase(stage, persistent, generating))
            if isinstance(cost, str):
                problems.append(f"stage {stage.name!r}: {cost}")
                cost = StageCost(seconds=float("inf"))
            costs[stage.name] = cost
        return costs, persistent, problems

    def stage_cost(self, graph: Graph, name: str) -> StageCost:
        """Stage `name`'s cost in `graph`, as `stage_costs` gives it, without costing the other stages (infinite
        seconds when it cannot run)."""
        inputs, stage = self.inputs_for(graph), graph.stage(name)
        residents = resident_state(graph, inputs)
        beside = _persistent(residents, graph.num_devices, generating=StageKind.GENERATE in stage.kinds)
        cost = self._remembered(graph, stage, inputs, beside)
        return StageCost(seconds=float("inf")) if isinstance(cost, str) else cost

    def _remembered(self, graph: Graph, stage: Stage, inputs: CostInputs, beside: np.ndarray) -> StageCost | str:
        """`stage_cost` of `stage` beside `beside` bytes per device, remembered (a MemoryError as its message)."""
        key = _cost_key(graph, stage, beside)
        if key not in self._costs:
            try:
                self._costs[key] = stage_cost(graph, stage, inputs, beside)
            except MemoryError as error:
                self._costs[key] = str(error)
        return self._costs[key]

    def lower_bound(self, graph: Graph, *, check_memory: bool = True) -> float:
        """The busiest resource's work per step (inf when the plan does not fit): no prediction is below it.
        Without `check_memory`, the stages' peaks are not checked against the device (persistent state and the
        sampler still are)."""
        self._check(graph)
        costs, persistent, problems = self.stage_costs(graph)
        if problems or (check_memory and self._memory_problems(graph, costs, persistent)[1]):
            return float("inf")
        return schedule_module.resource_bound(_units(graph, costs, self.inputs.hardware), graph.num_devices)

    def _memory_problems(self, graph: Graph, costs: Mapping[str, StageCost],
                         persistent: np.ndarray) -> tuple[np.ndarray, list[str]]:
        limit = self.inputs.hardware.usable_memory_bytes
        generating = self.generating_persistent(graph)
        peak, problems = persistent.copy(), []
        for stage in graph.stages:
            cost = costs[stage.name]
            if stage.host or not np.isfinite(cost.seconds):
                continue
            devices = device_index(placement_devices(graph, stage.placement))
            beside = _phase(stage, persistent, generating)
            peak[devices] = np.maximum(peak[devices], beside[devices] + cost.transient_bytes)
            need = float(beside[devices].max() + cost.transient_bytes)
            if need > limit:
                problems.append(f"stage {stage.name!r}: needs {need / 1e9:.1f} GB per device on placement "
                                f"{stage.placement!r}, the usable memory is {limit / 1e9:.1f} GB")
        return peak, problems

    def generating_persistent(self, graph: Graph) -> np.ndarray:
        """Persistent bytes per device while the sampler generates (an offloaded optimiser state is not there)."""
        return _persistent(resident_state(graph, self.inputs_for(graph)), graph.num_devices, generating=True)

    def predict(self, graph: Graph, *, steps: int | None = None, with_trace: bool = True,
                enforce_memory: bool = True) -> Prediction:
        """Predicts one steady-state RL step of `graph` (see the module docstring).

        With `enforce_memory=False` a plan whose memory accounting exceeds the device is still timed (its
        problems are reported, `fits` stays False): for published runs whose systems offload or shard state in
        ways this accounting does not express (`rpegjax.perf.reference.published_runs`)."""
        self._check(graph)
        inputs, hardware = self.inputs_for(graph), self.inputs.hardware
        costs, persistent, problems = self.stage_costs(graph)
        peak, memory_problems = self._memory_problems(graph, costs, persistent)
        problems += memory_problems
        generating = self.generating_persistent(graph)
        stage_predictions = []
        for stage in graph.stages:
            cost = costs[stage.name]
            devices = [] if stage.host else list(placement_devices(graph, stage.placement))
            stage_predictions.append(StagePrediction(
                name=stage.name, kind=stage.kind.value, seconds=cost.seconds, compute_seconds=cost.compute_seconds,
                memory_seconds=cost.memory_seconds, communication_seconds=cost.communication_seconds,
                overhead_seconds=cost.overhead_seconds, flops=cost.flops, model_flops=cost.model_flops,
                peak_memory_bytes=float(_phase(stage, persistent, generating)[devices].max() + cost.transient_bytes)
                if devices else 0.0,
                detail=dict(cost.detail)))
        fits = not problems
        timeline = None
        step_seconds = latency = float("inf")
        timed = fits or (not enforce_memory and all(np.isfinite(c.seconds) for c in costs.values()))
        if timed:
            simulated = steps or max(6, 4 * (graph.async_bound + 1))
            timeline = schedule_module.simulate(graph, _units(graph, costs, hardware), steps=simulated,
                                                num_devices=graph.num_devices)
            step_seconds, latency = timeline.step_seconds, timeline.step_latency
        workload = inputs.workload
        model_flops = sum(c.model_flops for c in costs.values() if np.isfinite(c.seconds))
        generated = float(workload.responses.sample(workload.sequences).sum())
        peak_flops = hardware.device.flops(inputs.actor.compute_dtype)
        return Prediction(
            graph=graph, stages=tuple(stage_predictions), step_seconds=step_seconds, step_latency_seconds=latency,
            peak_memory_bytes=float(peak.max()), memory_limit_bytes=hardware.usable_memory_bytes, fits=fits,
            problems=tuple(problems), tokens_per_second=generated / step_seconds if timed else 0.0,
            mfu=model_flops / (step_seconds * graph.num_devices * peak_flops) if timed else 0.0,
            model_flops_per_step=model_flops,
            trace=schedule_module.to_trace(timeline, graph.name or "predicted") if timeline is not None and with_trace else None)


def predict(graph: Graph, model: ModelShape | ModelConfig, workload: Workload, hardware: HardwareSpec,
            options: ExecutionOptions | None = None, *, critic: ModelShape | ModelConfig | None = None,
            steps: int | None = None, with_trace: bool = True) -> Prediction:
    """Predicts one steady-state RL step of `graph` (see the module docstring)."""
    return Evaluator(model, workload, hardware, options, critic=critic).predict(graph, steps=steps, with_trace=with_trace)


def _units(graph: Graph, costs: Mapping[str, StageCost], hardware: HardwareSpec) -> list[schedule_module.Unit]:
    """Execution units with their device sets; a fused group costs the sum of its members, dispatched once."""
    units = []
    for members in graph.execution_units():
        stages = [graph.stage(name) for name in members]
        first = stages[0]
        seconds = sum(costs[name].seconds for name in members) - (len(members) - 1) * hardware.device.dispatch_overhead_s
        if first.host:
            devices = None
        else:
            device_set = set(placement_devices(graph, first.placement))
            if StageKind.WEIGHT_SYNC in first.kinds:  # the receivers are busy loading the new weights too
                for reader in graph.consumers(first.name):
                    if not graph.stage(reader).host:
                        device_set |= set(placement_devices(graph, graph.stage(reader).placement))
            devices = tuple(sorted(device_set))
        fractions = costs[members[0]].piece_fractions if len(members) == 1 else tuple(
            (j + 1) / first.microbatches for j in range(first.microbatches))
        units.append(schedule_module.Unit(stages=tuple(members), devices=devices, seconds=seconds,
                                          piece_fractions=fractions, kind=first.kind.value))
    return units
