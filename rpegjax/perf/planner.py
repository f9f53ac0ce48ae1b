"""The planner: searches structure and execution of an RPEG together and returns executable graphs, ranked.

Search space (`PlanSpace`): asynchrony bound; for PPO a separate or shared actor-critic trunk; fusion of the
inference stages; micro-batch count of generation and the stages that consume it; colocated placement or a
split of the devices between a rollout sub-mesh and a training sub-mesh; the generation layout (tensor x data);
the training layout (data x fsdp x tensor); inference stages on the training layout or each re-sharded to the
layout that is fastest for it; the execution options the runtime supports on the hardware (attention kernel
and remat policy, `rpegjax.perf.executable`), with the fewest update micro-batches that fit in memory (more
only add passes), or sequence packing with the token budget whose update and inference stages fit and are
fastest (passes of packed rows, `rpegjax.perf.packed_batches`). Plans are predicted as the runtime executes them (`Evaluator.for_runtime`). Every candidate is a `Graph` built with the builders and transforms, predicted
by `step_model.Evaluator`; plans that exceed device memory are ranked out.

Exactness: the search is branch and bound over that whole space. The per-step work of the busiest resource
(`Evaluator.lower_bound`) bounds every plan's step time from below; it does not depend on the asynchrony bound
and micro-batching (micro-batching only adds work), and fusion saves at most one dispatch per extra fused
stage, so one bound per (critic, placement, layouts, re-sharding) candidate covers all its variants. A cheaper
bound comes first: the candidate's generate stage alone (priced when its sampler is pinned; no variant steps
faster than it generates), so the full bound is computed only for candidates whose generation could still enter
the top. Variants are predicted in bound order until the bound passes the k-th best time, so the returned
ranking is the same as predicting every plan (`brute_force`), which the tests check on small cases.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections.abc import Iterator, Sequence

import numpy as np

from rpegjax.graph import transforms
from rpegjax.graph.builders import ALL_PLACEMENT, grpo_graph, ppo_graph
from rpegjax.graph.ir import (
    INFERENCE_KINDS,
    UPDATE_KINDS,
    Algorithm,
    CriticMode,
    Execution,
    Graph,
    Placement,
    Role,
    StageKind,
)
from rpegjax.options import AttentionKind, CacheLayout, DecodeAttention, DType, OptimizerSharding, RematPolicy
from rpegjax.perf import executable, generation_stage, refusal, stage_costs, trust
from rpegjax.perf.costs import (
    AttentionKernel,
    forward_layer_bytes_per_token,
    layer_activation_bytes_per_token,
    layer_matmul_output_bytes_per_token,
)
from rpegjax.perf.step_model import Evaluator, Prediction, device_index, placement_devices

ROLLOUT, TRAIN = transforms.ROLLOUT_PLACEMENT, transforms.TRAIN_PLACEMENT
# generate seconds within which slot counts count as equally fast: the partial-rollout simulation's sampling
# error is ~1% of them (`partial_rollouts.MEASURED_STEPS`), and slots that buy no time only cost memory
SLOT_TOLERANCE = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpace:
    """The choices the planner enumerates (fractions of devices given to generation; None = colocated)."""

    async_bounds: tuple[int, ...] = (0, 1, 2)
    critic_modes: tuple[CriticMode, ...] = (CriticMode.SEPARATE, CriticMode.SHARED)
    fusion: tuple[bool, ...] = (False, True)
    microbatches: tuple[int, ...] = (1, 4)
    generation_fractions: tuple[float | None, ...] = (None, 0.25, 0.375, 0.5, 0.625, 0.75)
    tensor_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_sizes: tuple[int, ...] = (1,)  # training layouts' context axis (one row's sequence over its devices)
    sequence_parallel: tuple[bool, ...] = (False,)  # the residual stream split over tensor too (Execution field)
    reshard_inference: tuple[bool, ...] = (False, True)
    # those the hardware cannot run are skipped; cuDNN first, so that GPUs with bfloat16 get the fused kernel
    attention: tuple[AttentionKind, ...] = (AttentionKind.CUDNN, AttentionKind.BLOCKWISE, AttentionKind.DENSE)
    remat: tuple[RematPolicy, ...] = (RematPolicy.FULL, RematPolicy.DOTS, RematPolicy.NONE)
    update_microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)  # the fewest that fit are taken
    # row micro-batches of every inference stage (Execution.inference_rows = rows / this): the fewest that fit
    inference_microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    param_dtype: DType = DType.FLOAT32  # master weights and optimiser moments
    dtype: DType = DType.BFLOAT16  # matmul compute
    # the sampler's KV cache: paged (a pool of what the generation phase leaves of the usable memory, as vLLM's
    # gpu_memory_utilization sizes its cache; contiguous where a replica cannot hold a whole group) or
    # contiguous (every slot reserves its capacity)
    kv_cache: CacheLayout = CacheLayout.PAGED
    # the paged sampler's decode attention (`Execution.decode_attention`): XLA's gather over the longest row's
    # window, and/or the Pallas paged kernel (each row over its own pages; GPUs only, skipped elsewhere); gather
    # only for a contiguous cache. Gather alone in the library's default space (its searches and tests stay as
    # fast), both in scripts/plan.py's
    decode_attention: tuple[DecodeAttention, ...] = (DecodeAttention.GATHER,)
    # AdamW's state split over the data replicas too (ZeRO-1: less memory, the same traffic, so always taken), and
    # offloaded to host memory while generation runs (colocated plans on devices with a host link)
    optimizer_sharding: OptimizerSharding = OptimizerSharding.DATA
    optimizer_offload: tuple[bool, ...] = (False, True)
    # sequence packing (Execution.packing): rows padded to the longest, or sequences packed into rows of a token
    # budget; the budget is fitted per plan: of these multiples of the longest sequence (rounded up to whole
    # attention blocks, and for context parallelism to 2 x context blocks), the fastest whose stages fit
    packing: tuple[bool, ...] = (False, True)
    packed_rows: tuple[int, ...] = (64, 32, 16, 8, 4, 2, 1)
    # partial rollouts (`Execution.partial_rollouts`: two batches in flight, tokens lagging at most k + 2 versions;
    # `rpegjax.perf.partial_rollouts` models them), for colocated plans (the runtime runs them on shared processes);
    # off in the library's default space (its searches and tests stay as fast), on and off in scripts/plan.py's
    partial_rollouts: tuple[bool, ...] = (False,)
    inflight_batches: tuple[int, ...] = (2, 3)  # of a plan with partial rollouts (more: busier slots, older tokens)
    # a mixture-of-experts model's experts (`Execution.moe_capacity_factor`): dropless (None) or in the capacity mode
    # of each factor; dense models take None only. The perf model costs memory and time, not the tokens a factor
    # drops, so the fastest factor that fits wins: list only factors whose drops the run accepts
    moe_capacity_factors: tuple[float | None, ...] = (None,)
    # the least share of the sampler's slots running on average over generation (`slot_busy`) a plan may have:
    # a constraint the user sets (0: none); the sampler's slot count is chosen among those that meet it
    min_slot_busy: float = 0.0
    # the sampler takes the fewest slots whose generation is within this share of the fastest (`_fastest_slots`);
    # the reference plans take the fastest (0), as a serving engine fills the memory it is given
    slot_tolerance: float = SLOT_TOLERANCE

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "critic_modes", tuple(CriticMode(m) for m in self.critic_modes))
        except ValueError:
            raise ValueError(f"PlanSpace.critic_modes must hold {[m.value for m in CriticMode]}, got {self.critic_modes!r}") from None
        for name in ("async_bounds", "critic_modes", "fusion", "microbatches", "generation_fractions", "tensor_sizes",
                     "context_sizes", "sequence_parallel", "reshard_inference", "attention", "remat",
                     "update_microbatches", "inference_microbatches", "optimizer_offload", "packing", "packed_rows",
                     "partial_rollouts", "inflight_batches", "moe_capacity_factors", "decode_attention"):
            if not getattr(self, name):
                raise ValueError(f"PlanSpace.{name} must list at least one choice")
        if any(k < 0 for k in self.async_bounds) or any(m < 1 for m in self.microbatches) or any(
                t < 1 for t in (*self.tensor_sizes, *self.context_sizes)):
            raise ValueError(f"PlanSpace: async bounds >= 0, micro-batches and tensor sizes >= 1, got {self}")
        if any(f is not None and not 0 < f < 1 for f in self.generation_fractions):
            raise ValueError(f"PlanSpace.generation_fractions must be None or in (0, 1), got {self.generation_fractions}")
        if not 0 <= self.min_slot_busy <= 1:
            raise ValueError(f"PlanSpace.min_slot_busy must be in [0, 1], got {self.min_slot_busy!r}")
        if self.slot_tolerance < 0:
            raise ValueError(f"PlanSpace.slot_tolerance must be >= 0, got {self.slot_tolerance!r}")
        if any(m < 1 for m in (*self.update_microbatches, *self.inference_microbatches, *self.packed_rows)):
            raise ValueError(f"PlanSpace: update and inference micro-batches and packed rows must be >= 1, got {self}")
        object.__setattr__(self, "update_microbatches", tuple(sorted(self.update_microbatches)))
        object.__setattr__(self, "inference_microbatches", tuple(sorted(self.inference_microbatches)))
        object.__setattr__(self, "packed_rows", tuple(sorted(set(self.packed_rows), reverse=True)))
        for execution in self.executions():  # validates the values (GraphError names the field)
            del execution

    def executions(self, longest: int = 1, *, experts: bool = True) -> list[Execution]:
        """Every (attention, remat, offload, sequence parallelism, packing, partial rollouts, decode attention,
        expert capacity) execution of the space, with its precision, KV cache and optimiser sharding (micro-batches
        1; packed rows of the largest multiple of the `longest` sequence, until `Planner.fit_microbatches` fits the
        budget); without `experts` (a dense model) only dropless, the one a dense model runs."""
        partial = [dict(partial_rollouts=False)] * (False in self.partial_rollouts) + [
            dict(partial_rollouts=True, inflight_batches=batches) for batches in self.inflight_batches
            if True in self.partial_rollouts]
        capacities = self.moe_capacity_factors if experts else (None,)
        decode = self.decode_attention if self.kv_cache is CacheLayout.PAGED else (DecodeAttention.GATHER,)
        return [Execution(attention=attention, remat=remat, scan_layers=True, kv_cache=self.kv_cache,
                          decode_attention=decode_attention,
                          param_dtype=self.param_dtype, dtype=self.dtype, optimizer_sharding=self.optimizer_sharding,
                          optimizer_offload=offload, sequence_parallel=sequence_parallel, packing=packing,
                          max_tokens_per_micro_batch=self.packed_rows[0] * longest if packing else None,
                          moe_capacity_factor=capacity, **rollouts)
                for attention, remat, offload, sequence_parallel, packing, rollouts, decode_attention, capacity in
                itertools.product(self.attention, self.remat, self.optimizer_offload, self.sequence_parallel,
                                  self.packing, partial, dict.fromkeys(decode), capacities)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanChoice:
    """One point of the space; `build_graph` turns it into a graph."""

    algorithm: Algorithm
    use_reference: bool
    num_devices: int
    async_bound: int = 0
    critic_mode: CriticMode = CriticMode.SEPARATE
    fused: bool = False
    microbatches: int = 1
    generation_devices: int = 0  # 0: generation shares all devices with training
    generation_layout: tuple[tuple[str, int], ...] = ()
    train_layout: tuple[tuple[str, int], ...] = ()
    inference_layouts: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()  # stage -> own layout
    optimizer_steps: int = 1  # optimiser steps per RL step (the batch split into this many mini-batches)
    execution: Execution = dataclasses.field(default_factory=Execution)

    def describe(self) -> str:
        placement = "colocated" if not self.generation_devices else (
            f"disaggregated {self.generation_devices}+{self.num_devices - self.generation_devices}")
        parts = [f"k={self.async_bound}", placement, f"gen {_layout_text(self.generation_layout)}",
                 f"train {_layout_text(self.train_layout)}"]
        if self.algorithm is Algorithm.PPO:
            parts.append(f"critic {self.critic_mode.value}")
        parts.append("fused" if self.fused else "unfused")
        if self.microbatches > 1:
            parts.append(f"{self.microbatches} microbatches")
        if self.optimizer_steps > 1:
            parts.append(f"{self.optimizer_steps} optimiser steps")
        if self.inference_layouts:
            parts.append("re-sharded " + ", ".join(f"{s}:{_layout_text(l)}" for s, l in self.inference_layouts))
        parts.append(self.execution.describe())
        return "; ".join(parts)


def _layout_text(layout: tuple[tuple[str, int], ...]) -> str:
    return "x".join(f"{axis[0]}{size}" for axis, size in layout if size > 1) or "1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    choice: PlanChoice
    graph: Graph
    prediction: Prediction


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Plan
    alternatives: tuple[Plan, ...]  # next best, ranked
    evaluated: int  # plans predicted in full
    candidates: int  # plans in the space
    rejected: tuple[str, ...]  # why candidates that do not fit were ranked out: the closest of each family
    seconds: float


# ------------------------------------------------------------------------------------------------- building
def _sizes(layout: tuple[tuple[str, int], ...]) -> dict[str, int]:
    return dict(layout)


@functools.lru_cache(maxsize=128)
def _structure(algorithm: Algorithm, use_reference: bool, critic_mode: CriticMode, async_bound: int,
               num_devices: int, optimizer_steps: int = 1) -> Graph:
    """The builder's graph with asynchrony and actor-critic sharing applied (immutable, so shared)."""
    name = f"{algorithm.value}-plan"
    if algorithm is Algorithm.PPO:
        return ppo_graph(use_reference=use_reference, critic=critic_mode, async_bound=async_bound,
                         num_devices=num_devices, minibatches=optimizer_steps, name=name)
    return grpo_graph(use_reference=use_reference, async_bound=async_bound, num_devices=num_devices,
                      minibatches=optimizer_steps, name=name)


def _placed(graph: Graph, choice: PlanChoice) -> Graph:
    """Every device stage on its sub-mesh with its layout, in one rewrite (what a `place` per stage would give;
    the caller validates): colocated on `all`, or generation on `rollout` and the rest on `train`."""
    n, g = choice.num_devices, choice.generation_devices
    train, generation, own = _sizes(choice.train_layout), _sizes(choice.generation_layout), dict(choice.inference_layouts)
    if g:
        placements = {ROLLOUT: Placement(name=ROLLOUT, parallel=generation, devices=tuple(range(g))),
                      TRAIN: Placement(name=TRAIN, parallel=train, devices=tuple(range(g, n)))}
    else:
        placements = {ALL_PLACEMENT: Placement(name=ALL_PLACEMENT, parallel=train, devices=tuple(range(n)))}
    stages = []
    for stage in graph.stages:
        if stage.host:
            stages.append(stage)
            continue
        generates = StageKind.GENERATE in stage.kinds
        placement = (ROLLOUT if generates else TRAIN) if g else ALL_PLACEMENT
        layout = generation if generates else _sizes(own[stage.name]) if stage.name in own else train
        parallel = None if layout == dict(placements[placement].parallel) else layout
        stages.append(dataclasses.replace(stage, placement=placement, parallel=parallel))
    return dataclasses.replace(graph, stages=tuple(stages), placements=placements)


def within_staleness(execution: Execution, async_bound: int, staleness: int) -> bool:
    """Whether a plan of this execution at `async_bound` trains no token older than `staleness` versions: a
    partial-rollout plan's tokens lag up to its `max_token_lag` (k + 2 by default), not only k."""
    if not execution.partial_rollouts:
        return True
    return (async_bound + 2 if execution.max_token_lag is None else execution.max_token_lag) <= staleness


def build_graph(choice: PlanChoice) -> Graph:
    """The executable graph of `choice`: builder (asynchrony, critic sharing), placements and layouts, then the
    fusion and micro-batch transforms; validated. Neither the structure nor its rules read the execution options,
    so the structure is built once per choice of the rest (the planner tries many executions of each)."""
    structure = _planned_structure(dataclasses.replace(choice, execution=_NO_EXECUTION))
    return dataclasses.replace(structure, execution=choice.execution)


_NO_EXECUTION = Execution()


@functools.lru_cache(maxsize=4096)
def _planned_structure(choice: PlanChoice) -> Graph:
    graph = _placed(_structure(choice.algorithm, choice.use_reference, choice.critic_mode, choice.async_bound,
                               choice.num_devices, choice.optimizer_steps), choice).validate()
    if choice.fused:
        graph = transforms.default_fusion(graph)
    if choice.microbatches > 1:
        done: set[str] = set()
        for stage in graph.stages:
            consumes_rollouts = stage.kind is StageKind.GENERATE or stage.kind is StageKind.REWARD or (
                INFERENCE_KINDS & set(stage.kinds))
            if consumes_rollouts and stage.name not in done:
                graph = transforms.microbatch(graph, stage.name, choice.microbatches)
                done.update(m.name for m in graph.stages if m.fused_group and m.fused_group == stage.fused_group)
                done.add(stage.name)
    return graph.validate()


# ---------------------------------------------------------------------------------------------- candidates
def layouts(num_devices: int, tensor_sizes: tuple[int, ...], *, heads: int, kv_heads: int, node_size: int,
            with_fsdp: bool, context_sizes: tuple[int, ...] = (1,),
            expert_sizes: tuple[int, ...] = (1,)) -> list[tuple[tuple[str, int], ...]]:
    """(data, fsdp, tensor) layouts of `num_devices`: tensor inside a node dividing the head count; fsdp powers of 2;
    with `context_sizes` other than 1, (data, fsdp, context, tensor) layouts too; with `expert_sizes` other than 1
    (a mixture-of-experts model's, `expert_axis_sizes`), (data, fsdp, expert, [context,] tensor) layouts too."""
    out = []
    for tensor, context, expert in itertools.product(tensor_sizes, context_sizes, expert_sizes):
        if tensor > node_size or heads % tensor or num_devices % (tensor * context * expert):
            continue
        rest = num_devices // (tensor * context * expert)
        fsdp_sizes = [f for f in (2**i for i in range(rest.bit_length())) if rest % f == 0] if with_fsdp else [1]
        for fsdp in fsdp_sizes:
            middle = (("expert", expert),) if expert > 1 else ()
            middle += (("context", context),) if context > 1 else ()
            out.append((("data", rest // fsdp), ("fsdp", fsdp), *middle, ("tensor", tensor)))
    return out


def _stage_layouts(space: PlanSpace, shape, hardware, generation_devices: int, train_devices: int) -> tuple[list, list]:
    """(generation layouts, training layouts) of the space, both with the model's expert axis sizes (the sampler
    splits experts over `expert` as training does)."""
    kwargs = dict(heads=shape.heads, kv_heads=shape.kv_heads, node_size=hardware.node_size)
    return (layouts(generation_devices, space.tensor_sizes, with_fsdp=False,
                    expert_sizes=expert_axis_sizes(shape, generation_devices), **kwargs),
            layouts(train_devices, space.tensor_sizes, with_fsdp=True, context_sizes=space.context_sizes,
                    expert_sizes=expert_axis_sizes(shape, train_devices), **kwargs))


def expert_axis_sizes(shape, num_devices: int) -> tuple[int, ...]:
    """The expert axis sizes a model's layouts take on `num_devices` devices: 1 for a dense model; for a
    mixture-of-experts one every size dividing both its expert count and the devices (the runtime splits the
    experts evenly, `rpegjax.models.expert_parallel`)."""
    if shape.experts is None:
        return (1,)
    count = shape.experts.experts
    return tuple(p for p in range(1, min(count, num_devices) + 1) if count % p == 0 and num_devices % p == 0)


def _undominated(executions: list[Execution], inputs: stage_costs.CostInputs,
                 tensor_sizes: tuple[int, ...]) -> list[Execution]:
    """`executions` less those with dense attention whose flash-style twin (the same options otherwise) is there
    and costs no more memory: the cost model gives dense attention at least the twin's time in every stage (every
    (query, key) pair instead of the causal half, plus its scores' traffic), and at least its memory when a
    row's shortest span, the prompt and one token, makes the scores of a query outweigh the flash kernel's float32
    accumulator (checked per tensor size on the formulas themselves). Such a plan never ranks above its twin."""
    def memory_dominated(execution: Execution) -> bool:
        keys = inputs.workload.prompt_tokens + 1
        for shape in {inputs.actor, inputs.critic}:
            shape = dataclasses.replace(shape, param_dtype=execution.param_dtype, compute_dtype=execution.dtype)
            for tensor, formula in itertools.product(tensor_sizes, (
                    forward_layer_bytes_per_token, layer_activation_bytes_per_token, layer_matmul_output_bytes_per_token)):
                dense, flash = (formula(shape, keys_per_query=keys, kernel=kernel, tensor=tensor)
                                for kernel in (AttentionKernel.DENSE, AttentionKernel.FLASH))
                if dense < flash:
                    return False
        return True

    twins = {dataclasses.replace(e, attention=AttentionKind.DENSE) for e in executions if e.attention.skips_causal_blocks}
    return [e for e in executions if e.attention.skips_causal_blocks or e not in twins or not memory_dominated(e)]


def _splits(num_devices: int, fractions: tuple[float | None, ...], node_size: int) -> list[int]:
    splits = []
    for fraction in fractions:
        if fraction is None:
            splits.append(0)
            continue
        unit = node_size if num_devices >= 2 * node_size else 1
        g = int(round(num_devices * fraction / unit)) * unit
        if 0 < g < num_devices:
            splits.append(g)
    return sorted(set(splits))


class Planner:
    """Branch-and-bound search of `space` for one algorithm, model, workload and hardware (see module doc)."""

    def __init__(self, evaluator: Evaluator, *, algorithm: Algorithm | str, num_devices: int, use_reference: bool = True,
                 space: PlanSpace | None = None, optimizer_steps: int = 1,
                 regime: trust.CheckedRegime | None = None):
        self.evaluator = evaluator
        # where its memory predictions are trusted, and with what margins (the model's kind's, by default)
        self.regime = trust.regime_for(evaluator.inputs.actor) if regime is None else regime
        self.algorithm = Algorithm(algorithm)
        self.num_devices = num_devices
        self.use_reference = use_reference
        if isinstance(optimizer_steps, bool) or not isinstance(optimizer_steps, int) or optimizer_steps < 1:
            raise ValueError(f"planner: optimizer_steps must be a positive integer, got {optimizer_steps!r}")
        self.optimizer_steps = optimizer_steps  # optimiser steps per RL step (the algorithm's mini-batches)
        self.space = space or PlanSpace()
        self._own_cache: dict[tuple, tuple] = {}
        # the generate stage's seconds of each pinned skeleton: no variant of it steps faster (`search`)
        self._generation_seconds: dict[PlanChoice, float] = {}
        hardware = evaluator.inputs.hardware
        if num_devices > hardware.num_devices:
            raise ValueError(f"planner: {num_devices} devices requested, hardware {hardware.name!r} has {hardware.num_devices}")
        if not evaluator.follow_graph:
            raise ValueError("planner: the evaluator must predict the runtime's execution of each plan "
                             "(step_model.Evaluator.for_runtime)")
        # the executable options; of those the cost model cannot tell apart (blockwise and cuDNN attention are
        # both flash-style to it) the first in the space's order stays
        distinct: dict[tuple, Execution] = {}
        workload, experts = evaluator.inputs.workload, evaluator.inputs.actor.experts is not None
        for execution in self.space.executions(longest=workload.prompt_tokens + workload.responses.max, experts=experts):
            if not executable.execution_problems(execution, hardware):
                distinct.setdefault((evaluator.inputs.options.executing(execution), execution.moe_capacity_factor), execution)
        self.executions = _undominated(list(distinct.values()), evaluator.inputs, self.space.tensor_sizes)
        if not self.executions:
            refused = "; ".join(p for e in self.space.executions() for p in executable.execution_problems(e, hardware))
            raise ValueError(f"planner: the runtime can execute none of the space's execution options on "
                             f"{hardware.name!r}: {refused}")

    # the (critic, placement, layouts) skeletons and their structure variants
    def skeletons(self) -> Iterator[PlanChoice]:
        """Every skeleton of the space, fitted (`fit_microbatches`)."""
        for pinned in self._pinned_skeletons():
            yield self._fit_passes(pinned)

    def _pinned_skeletons(self) -> Iterator[PlanChoice]:
        """Every skeleton with its sampler pinned (`_pin_generation`) and one update and inference pass."""
        shape, hardware = self.evaluator.inputs.actor, self.evaluator.inputs.hardware
        critic_modes = self.space.critic_modes if self.algorithm is Algorithm.PPO else (CriticMode.SEPARATE,)
        for critic_mode, split in itertools.product(critic_modes, _splits(self.num_devices, self.space.generation_fractions,
                                                                          hardware.node_size)):
            train_devices = self.num_devices - split
            generation, training = _stage_layouts(self.space, shape, hardware, split or self.num_devices, train_devices)
            for gen_layout, train_layout, execution in itertools.product(generation, training, self.executions):
                # offload frees memory only where generation shares the devices, and needs a host link
                if execution.optimizer_offload and (split or hardware.device.host_bandwidth <= 0):
                    continue
                # the runtime runs partial rollouts only where generation and training share their processes
                # (`rpegjax.runtime.controller`): colocated plans
                if execution.partial_rollouts and split:
                    continue
                base = PlanChoice(algorithm=self.algorithm, use_reference=self.use_reference, num_devices=self.num_devices,
                                  optimizer_steps=self.optimizer_steps,
                                  critic_mode=critic_mode, generation_devices=split, generation_layout=gen_layout,
                                  train_layout=train_layout, execution=execution)
                for reshard in self.space.reshard_inference:
                    if not reshard:
                        yield self._pin_generation(base)
                    else:
                        own = _own_inference_layouts(self, base, training)
                        if own:
                            yield self._pin_generation(dataclasses.replace(base, inference_layouts=own))

    def fit_microbatches(self, skeleton: PlanChoice) -> PlanChoice:
        """The skeleton with the fewest update and inference micro-batches of the space whose stages fit in memory
        (the largest when none does: the plan is then ranked out, with its reason), and the sampler's slots and
        KV pool pinned to what the generation phase leaves. None of these depends on the asynchrony bound, fusion
        or generation pieces, so they hold for every variant; the sampler's memory and time depend on neither kind
        of micro-batch, nor the micro-batched stages' on the sampler, so the two are fitted apart."""
        return self._fit_passes(self._pin_generation(skeleton))

    def _fit_passes(self, skeleton: PlanChoice) -> PlanChoice:
        """`skeleton` with the fewest update and inference micro-batches that fit (`fit_microbatches`); a packed
        candidate with its packed-row budget instead (one budget sizes the update's and the inference passes)."""
        if skeleton.execution.packing:
            return _fastest_budget(self, skeleton)
        choice = self._fewest(skeleton, "update_microbatches", self.space.update_microbatches, trust.TRAINING)
        sequences = self.evaluator.inputs.workload.sequences
        rows = [sequences // m for m in self.space.inference_microbatches if sequences % m == 0]
        return self._fewest(choice, "inference_rows", [None if r == sequences else r for r in rows], trust.INFERENCE)

    def budgets(self, choice: PlanChoice) -> list[int]:
        """The packed-row budgets the space tries for `choice` (`packed_budgets`)."""
        return packed_budgets(choice, self.evaluator.inputs.workload, self.space.packed_rows)

    def unfitted(self, execution: Execution) -> Execution:
        """`execution` before `fit_microbatches`: no inference micro-batches, the sampler's slots and pool unpinned."""
        return dataclasses.replace(execution, inference_rows=None, decode_slots=None, kv_pool_tokens=None,
                                   kv_cache=self.space.kv_cache)

    def _fewest(self, skeleton: PlanChoice, field: str, values, phase: str) -> PlanChoice:
        """`skeleton` with the first of `values` for execution `field` whose `phase` stages fit with the phase's
        trust margin (`self.regime`; else the last that splits the batch evenly)."""
        choice = skeleton
        limit = self.regime.limit(self.evaluator.inputs.hardware.usable_memory_bytes, phase)
        kinds = UPDATE_KINDS if phase == trust.TRAINING else INFERENCE_KINDS
        for value in values:
            candidate = dataclasses.replace(skeleton, execution=dataclasses.replace(skeleton.execution, **{field: value}))
            graph = build_graph(candidate)
            if self._batch_problems(graph):
                continue
            choice = candidate
            costs, persistent, _ = self.evaluator.stage_costs(graph)
            if all(persistent[device_index(placement_devices(graph, s.placement))].max() + costs[s.name].transient_bytes <= limit
                   for s in graph.stages if set(s.kinds) & kinds and np.isfinite(costs[s.name].seconds)):
                return choice
        return choice

    def _pin_generation(self, choice: PlanChoice) -> PlanChoice:
        """`choice` with the sampler's slots and, for a paged cache, its pool in tokens per replica, as the
        generation phase's memory gives them, rounded as the runtime rounds slots: whole groups on every slot
        replica (`usable_slots`), and with a paged cache whole groups in every replica's pool. A paged cache whose
        replicas cannot hold a group is replaced by the contiguous one (the plan says so)."""
        execution = choice.execution
        generated = self._generation(choice)
        if generated is None:
            return choice  # not even one sequence fits: ranked out with its reason
        per_replica, cost, layout, inputs, beside = generated
        group = inputs.workload.group_size
        if execution.kv_cache is CacheLayout.PAGED and per_replica < group:
            execution = dataclasses.replace(execution, kv_cache=CacheLayout.CONTIGUOUS, kv_pool_tokens=None,
                                            decode_attention=DecodeAttention.GATHER)
            generated = self._generation(dataclasses.replace(choice, execution=execution))
            if generated is None:
                return choice
            per_replica, cost, layout, inputs, beside = generated
        paged = execution.kv_cache is CacheLayout.PAGED
        step = group * layout.replicas if paged else math.lcm(group, layout.replicas)
        # partial rollouts keep inflight_batches batches in flight: slots beyond one batch stay busy too
        in_flight = execution.inflight_batches if execution.partial_rollouts else 1
        most = max(step, -(-inputs.workload.sequences * in_flight // step) * step)
        slots = min(most, max(step, per_replica * layout.replicas // step * step))
        if paged:  # the pool within generation's trust margin too
            working = generation_stage.generation_working_bytes(inputs, layout, per_replica)
            limit = self.regime.limit(inputs.hardware.usable_memory_bytes, trust.GENERATION)
            kv = min(cost.transient_bytes - working, limit - beside - working)
            if kv < 1:
                return choice  # no pool within the margin: ranked out as untrusted, saying so
            execution = dataclasses.replace(
                execution, kv_pool_tokens=int(kv // generation_stage.kv_bytes_per_token(inputs.actor, layout)))
        execution, seconds = _fastest_slots(self, choice, execution, slots, step, layout.replicas)
        pinned = dataclasses.replace(choice, execution=execution)
        self._generation_seconds[pinned] = seconds
        return pinned

    def _generation(self, choice: PlanChoice):
        """(slots per replica, generate stage cost, its layout, cost inputs, persistent bytes per device beside it)
        of `choice`, or None when no sequence fits."""
        graph = build_graph(choice)
        generate = graph.stages_of_kind(StageKind.GENERATE)[0]
        cost = self.evaluator.stage_cost(graph, generate.name)
        if not np.isfinite(cost.seconds):
            return None
        layout = stage_costs.Layout.from_parallel(graph.parallel_of(generate.name), where=generate.name)
        beside = float(self.evaluator.generating_persistent(graph)[device_index(placement_devices(graph, generate.placement))].max())
        return int(cost.detail["slots"]), cost, layout, self.evaluator.inputs_for(graph), beside

    def variants(self, skeleton: PlanChoice) -> Iterator[PlanChoice]:
        for k, fused, m in itertools.product(self.space.async_bounds, self.space.fusion, self.space.microbatches):
            if within_staleness(skeleton.execution, k, max(self.space.async_bounds)):
                yield dataclasses.replace(skeleton, async_bound=k, fused=fused, microbatches=m)

    def _batch_problems(self, graph: Graph) -> list[str]:
        return executable.batch_problems(graph, self.evaluator.inputs.workload.sequences)

    def _bound(self, skeleton: PlanChoice, *, fitted: bool = True) -> float:
        """A lower bound on the step of every variant of `skeleton`; unless `fitted`, of every variant of the
        skeleton with its micro-batches fitted: one update and inference pass, their memory not checked (more
        passes only add work, and fitting sees to memory); a packed skeleton's fastest budget (a larger one
        computes more padding)."""
        choices = [skeleton]
        if not fitted and skeleton.execution.packing:
            choices = [dataclasses.replace(skeleton, execution=dataclasses.replace(
                skeleton.execution, max_tokens_per_micro_batch=budget)) for budget in self.budgets(skeleton)]
        bounds = [float("inf")]
        for choice in choices:
            graph = build_graph(choice)
            if self._batch_problems(graph) or self._outside_regime(graph):
                continue  # the runtime could not split the batch (more pieces only make it worse), or untrusted
            fusable = sum(1 for s in graph.stages if INFERENCE_KINDS & set(s.kinds))
            bounds.append(self.evaluator.lower_bound(graph, check_memory=fitted)
                          - max(0, fusable - 1) * self.evaluator.inputs.hardware.device.dispatch_overhead_s)
        return min(bounds)

    def search(self, *, top: int = 5) -> PlanResult:
        """The best plan and the next `top - 1`, exactly as `brute_force` would rank them. Skeletons are taken in
        the order of a lower bound, from a heap: first their generate stage's seconds (known once the sampler is
        pinned: every variant's step is at least its generation), replaced when popped by a bound that needs no
        micro-batch fitting (`_bound(fitted=False)`: a prediction of every stage, per packed budget), and fitted
        only when that bound is popped while it can still enter the top. The search stops when the smallest bound
        left exceeds the top's last step: exact, whatever the order (each bound is below all its variants)."""
        start = time.perf_counter()
        heap = [(self._generation_seconds.get(pinned, 0.0), index, False, pinned)
                for index, pinned in enumerate(self._pinned_skeletons())]
        heapq.heapify(heap)  # (bound, index, whether the bound is _bound's, skeleton): indices are unique
        ranked: list[tuple[tuple, Plan]] = []  # the best `top` so far, sorted
        misses: list[tuple[int, PlanChoice]] = []  # (index, fitted skeleton) of those that do not fit
        rejected: dict[str, tuple[tuple, str]] = {}  # family -> (closeness, its closest miss's line)
        per_skeleton = len(self.space.async_bounds) * len(self.space.fusion) * len(self.space.microbatches)
        evaluated, candidates = 0, per_skeleton * len(heap)
        while heap:
            first_bound, index, tight, pinned = heapq.heappop(heap)
            if len(ranked) >= top and first_bound > ranked[-1][0][0]:
                break  # the smallest lower bound left: no later candidate can enter the top
            if not tight:
                heapq.heappush(heap, (self._bound(pinned, fitted=False), index, True, pinned))
                continue
            if math.isinf(first_bound) and ranked:
                continue  # does not fit (more micro-batches would not help), and a plan that does is known
            skeleton = self._fit_passes(pinned)
            bound = first_bound if math.isinf(first_bound) else self._bound(skeleton)
            if math.isinf(bound):
                misses.append((index, skeleton))
                continue
            if len(ranked) >= top and bound > ranked[-1][0][0]:
                continue
            for choice in self.variants(skeleton):
                if self._batch_problems(build_graph(choice)):
                    continue
                plan = self._plan(choice)
                evaluated += 1
                if not plan.prediction.fits:
                    continue
                reason = self.untrusted(plan) or self.slot_busy_problem(plan)
                if reason is not None:  # never ranked; said why when nothing else fits
                    _keep_closest(plan.choice, (-1, plan.prediction.peak_memory_bytes), reason, rejected)
                    continue
                ranked.append((_rank_key(plan), plan))
                ranked.sort(key=lambda item: item[0])
                del ranked[top:]
        for _, skeleton in sorted(misses, key=lambda item: item[0]) if not ranked else ():
            self._reject(skeleton, rejected)  # nothing fits: each family's closest miss says what would fit
        closest = tuple(text for _, text in sorted(rejected.values()))
        if not ranked:
            raise ValueError(f"planner: no plan of {candidates} fits in device memory, splits its batch evenly and has "
                             f"a predicted memory the planner trusts; "
                             f"the closest of each family:\n  " + "\n  ".join(closest))
        plans = [plan for _, plan in ranked]
        return PlanResult(best=plans[0], alternatives=tuple(plans[1:]), evaluated=evaluated, candidates=candidates,
                          rejected=closest, seconds=time.perf_counter() - start)

    def _reject(self, skeleton: PlanChoice, rejected: dict[str, tuple[tuple, str]]) -> None:
        """Keeps the closest miss of `skeleton`'s family (placement and critic) as one line (`refusal`, or why its
        memory is not trusted: `trust`)."""
        graph = build_graph(skeleton)
        outside = self._outside_regime(graph)
        if outside is not None:  # said only where no plan of its family is in the regime
            _keep_closest(skeleton, (4, 0.0), f"untrusted: {outside}", rejected)
            return
        problems = self._batch_problems(graph)
        prediction = None if problems else self._plan(skeleton).prediction
        line = refusal.refusal_line(prediction, batch_problems=problems, sequences=self.evaluator.inputs.workload.sequences,
                                    most_update_microbatches=self.space.update_microbatches[-1],
                                    most_inference_microbatches=self.space.inference_microbatches[-1])
        _keep_closest(skeleton, refusal.closeness(prediction), line, rejected)

    def _outside_regime(self, graph: Graph) -> str | None:
        workload = self.evaluator.inputs.workload
        return trust.regime_problem(graph, self.evaluator.inputs_for(graph).actor,
                                    workload.prompt_tokens + workload.responses.max, self.regime)

    def untrusted(self, plan: Plan) -> str | None:
        """Why the planner does not trust `plan`'s predicted memory (`rpegjax.perf.trust`), or None."""
        workload = self.evaluator.inputs.workload
        return trust.untrusted(plan.prediction, self.evaluator.inputs_for(plan.graph).actor,
                               workload.prompt_tokens + workload.responses.max, self.regime)

    def slot_busy_problem(self, plan: Plan) -> str | None:
        """Why `plan`'s sampler is less busy than the space's `min_slot_busy` allows, or None."""
        busy = generation_slot_busy(plan.prediction)
        if busy >= self.space.min_slot_busy:
            return None
        return (f"generation slots {busy:.0%} busy on average, under the {self.space.min_slot_busy:.0%} asked "
                f"(min_slot_busy)")

    def _plan(self, choice: PlanChoice) -> Plan:
        graph = build_graph(choice)
        return Plan(choice=choice, graph=graph, prediction=self.evaluator.predict(graph, with_trace=False))

    def brute_force(self, *, top: int = 5) -> list[Plan]:
        """Predicts every plan of the space (slow; for tests) and ranks those that fit."""
        plans = [self._plan(choice) for skeleton in self.skeletons() for choice in self.variants(skeleton)
                 if not self._batch_problems(build_graph(choice))]
        fitting = sorted((p for p in plans if p.prediction.fits and self.untrusted(p) is None
                          and self.slot_busy_problem(p) is None), key=_rank_key)
        return fitting[:top]


def packed_budgets(choice: PlanChoice, workload, multiples: Sequence[int]) -> list[int]:
    """Packed-row budgets to try for `choice`, largest first: `multiples` of the workload's longest sequence,
    which is rounded up to whole attention blocks, and for a context axis of c to 2·c blocks (every layout of
    the plan cuts its rows so, `executable.packed_row_problem`)."""
    block = choice.execution.attention_block_size
    contexts = [_sizes(choice.train_layout).get("context", 1)]
    contexts += [_sizes(layout).get("context", 1) for _, layout in choice.inference_layouts]
    quantum = math.lcm(*(block * (2 * c if c > 1 else 1) for c in contexts))
    longest = -(-(workload.prompt_tokens + workload.responses.max) // quantum) * quantum
    return [longest * multiple for multiple in multiples]



def _fastest_budget(planner: Planner, skeleton: PlanChoice) -> PlanChoice:
    """`skeleton` with the packed-row budget (`packed_budgets`) whose update and inference stages fit and take
    the least time together (else the smallest budget). Not simply the largest that fits: every pass computes
    whole rows, so a budget past what the batch fills computes padding (the packed rows are rounded up to the
    row shards), and a small one pays per-pass weight gathers and overheads."""
    usable = planner.evaluator.inputs.hardware.usable_memory_bytes
    limits = {**dict.fromkeys(UPDATE_KINDS, planner.regime.limit(usable, trust.TRAINING)),
              **dict.fromkeys(INFERENCE_KINDS, planner.regime.limit(usable, trust.INFERENCE))}
    best, fallback = None, skeleton
    for budget in planner.budgets(skeleton):
        candidate = dataclasses.replace(skeleton, execution=dataclasses.replace(
            skeleton.execution, max_tokens_per_micro_batch=budget))
        graph = build_graph(candidate)
        if planner._batch_problems(graph):
            continue
        fallback = candidate
        costs, persistent, _ = planner.evaluator.stage_costs(graph)
        stages = [s for s in graph.stages if set(s.kinds) & limits.keys()]
        if all(np.isfinite(costs[s.name].seconds) and persistent[device_index(placement_devices(graph, s.placement))].max()
               + costs[s.name].transient_bytes <= min(limits[k] for k in s.kinds if k in limits) for s in stages):
            seconds = sum(costs[s.name].seconds for s in stages)
            if best is None or seconds < best[0]:
                best = (seconds, candidate)
    return fallback if best is None else best[1]


def _own_inference_layouts(planner: Planner, base: PlanChoice, candidates) -> tuple:
    """Each inference stage on the layout that minimises its own pass time (ReaL-style per-stage re-sharding);
    re-sharding and memory are then costed and checked when the whole plan is predicted (timed without
    inference micro-batches: those are fitted to the layouts chosen)."""
    base = dataclasses.replace(base, execution=planner.unfitted(base.execution))
    if base.execution.packing:  # timed on rows of one longest sequence: the least padding on any layout
        base = dataclasses.replace(base, execution=dataclasses.replace(
            base.execution, max_tokens_per_micro_batch=planner.budgets(base)[-1]))
    key = (base.critic_mode, base.generation_devices, base.execution)
    if key not in planner._own_cache:
        graph = build_graph(base)
        inputs = planner.evaluator.inputs_for(graph)
        fastest = []
        for stage in graph.stages:
            if not INFERENCE_KINDS & set(stage.kinds):
                continue
            shape = inputs.critic if stage.role is Role.CRITIC else inputs.actor
            logits = bool({StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB} & set(stage.kinds))
            seconds = {layout: stage_costs.model_pass_cost(inputs, shape, stage_costs.Layout.from_parallel(
                _sizes(layout), where=stage.name), logits=logits, backward=False).seconds for layout in candidates}
            fastest.append((stage.name, min(candidates, key=lambda layout: (seconds[layout], candidates.index(layout)))))
        planner._own_cache[key] = tuple(fastest)
    return tuple((name, layout) for name, layout in planner._own_cache[key] if layout != base.train_layout)



def _fastest_slots(planner: Planner, choice: PlanChoice, execution: Execution, most: int, step: int,
                   replicas: int) -> tuple[Execution, float]:
    """(`execution` with the fewest of `most` slots and its halvings (whole steps of `step`) whose generation is
    within the space's `slot_tolerance` of the fastest: the running slots decode each step (padded to a power of
    two) over the longest one's window, so fewer slots decode for more steps over fewer rows each (the step model
    times both), and slots beyond the sequences that run at once only hold memory (their prefill rows, pool). With
    partial rollouts also the slots of each whole number of batches in flight (one batch: the others queue for
    its freed slots). A paged pool is cut to the slots' capacity (`_with_slots`). Its generate stage's seconds
    (0 when no slot count fits: no bound known))."""
    in_flight = execution.inflight_batches if execution.partial_rollouts else 1
    counts = sorted({max(step, most // 2**i // step * step) for i in range(4)}
                    | {max(step, most * j // in_flight // step * step) for j in range(1, in_flight)})
    capacity = planner.evaluator.inputs.workload.prompt_tokens + planner.evaluator.inputs.workload.responses.max
    timed = []
    for count in counts:
        candidate = _with_slots(execution, count, replicas, capacity)
        generated = planner._generation(dataclasses.replace(choice, execution=candidate))
        if generated is not None:
            timed.append((generated[1].seconds, candidate, generated[1].detail["slot_busy"]))
    if not timed:
        return dataclasses.replace(execution, decode_slots=most), 0.0
    meeting = [(seconds, candidate) for seconds, candidate, busy in timed if busy >= planner.space.min_slot_busy]
    if not meeting:  # the busiest: its plans are then refused, saying how busy (`Planner.slot_busy_problem`)
        seconds, candidate, _ = max(timed, key=lambda item: item[2])
        return candidate, seconds
    timed = meeting
    fastest = min(seconds for seconds, _ in timed)
    tolerance = planner.space.slot_tolerance
    return next((candidate, seconds) for seconds, candidate in timed if seconds <= fastest * (1 + tolerance))


def _with_slots(execution: Execution, count: int, replicas: int, capacity: int) -> Execution:
    """`execution` with `count` decode slots (all replicas) and its paged pool at most their capacity (tokens
    past every slot at full length are never used)."""
    pool = execution.kv_pool_tokens
    if pool is not None:
        pool = min(pool, count // replicas * capacity)
    return dataclasses.replace(execution, decode_slots=count, kv_pool_tokens=pool)


def _keep_closest(choice: PlanChoice, need: tuple, line: str, rejected: dict[str, tuple[tuple, str]]) -> None:
    """Records `line` as the refusal of `choice`'s family (placement and critic) when it is the closest yet."""
    family = "colocated" if not choice.generation_devices else (
        f"disaggregated {choice.generation_devices}+{choice.num_devices - choice.generation_devices}")
    if choice.algorithm is Algorithm.PPO:
        family += f", critic {choice.critic_mode.value}"
    layouts = f"gen {_layout_text(choice.generation_layout)}, train {_layout_text(choice.train_layout)}"
    if family not in rejected or need < rejected[family][0]:
        rejected[family] = (need, f"{family} ({layouts}): {line}")


def generation_slot_busy(prediction: Prediction) -> float:
    """The generate stage's share of slots running on average (its `slot_busy`; 1 without a generate stage)."""
    stage = next((s for s in prediction.stages if s.kind == StageKind.GENERATE), None)
    return 1.0 if stage is None else float(stage.detail.get("slot_busy", 1.0))


def _rank_key(plan: Plan) -> tuple:
    """Faster first; ties go to fresher weights, shorter step latency, less memory, then a stable description."""
    c, p = plan.choice, plan.prediction
    return (round(p.step_seconds, 9), c.async_bound, round(p.step_latency_seconds, 6), round(p.peak_memory_bytes / 1e6),
            c.microbatches, not c.fused, c.describe())


# ------------------------------------------------------------------------------------------ reference plans
def verl_like(evaluator: Evaluator, *, algorithm: Algorithm | str, num_devices: int, use_reference: bool = True,
              space: PlanSpace | None = None, optimizer_steps: int = 1) -> Plan:
    """verl's default: synchronous, colocated, separate models; FSDP (ZeRO-3) training over all devices and
    tensor-parallel rollout (TP 2 up to ~14B parameters, else 4, as in verl's example scripts); executed with
    the space's first execution the runtime supports (flash-style attention and full remat, as verl's examples
    enable) and the fewest update micro-batches that fit. A mixture-of-experts model runs dropless whatever
    factors the space lists: verl trains MoE with Megatron, whose token dispatch is dropless unless a capacity
    factor is set (Megatron-Core's `TransformerConfig.moe_expert_capacity_factor` defaults to None)."""
    planner = Planner(evaluator, algorithm=algorithm, num_devices=num_devices, use_reference=use_reference,
                      space=dataclasses.replace(space or PlanSpace(), partial_rollouts=(False,),
                                                moe_capacity_factors=(None,), min_slot_busy=0.0, slot_tolerance=0.0),
                      optimizer_steps=optimizer_steps)
    shape = evaluator.inputs.actor
    tensor = 2 if shape.params <= 14e9 else 4
    tensor = min(tensor, evaluator.inputs.hardware.node_size, num_devices)
    choice = planner.fit_microbatches(PlanChoice(
        algorithm=Algorithm(algorithm), use_reference=use_reference, num_devices=num_devices, optimizer_steps=optimizer_steps,
        generation_layout=(("data", num_devices // tensor), ("fsdp", 1), ("tensor", tensor)),
        train_layout=(("data", 1), ("fsdp", num_devices), ("tensor", 1)), execution=planner.executions[0]))
    graph = build_graph(choice)
    return Plan(choice=choice, graph=graph, prediction=evaluator.predict(graph))


def real_like(evaluator: Evaluator, *, algorithm: Algorithm | str, num_devices: int, use_reference: bool = True,
              tensor_sizes: tuple[int, ...] = (1, 2, 4, 8), space: PlanSpace | None = None,
              optimizer_steps: int = 1) -> Plan:
    """ReaL's approach: synchronous, colocated, separate models, every stage on the parallel layout fastest
    for it (weights re-sharded between stages), no fusion, no asynchrony.

    Generation takes the layout with the fastest rollout, training the one with the fastest updates, each
    inference stage its own fastest; when that combination exceeds device memory, the next fastest training
    layouts are tried, first with and then without per-stage re-sharding.
    """
    planner = Planner(evaluator, algorithm=algorithm, num_devices=num_devices, use_reference=use_reference,
                      space=dataclasses.replace(space or PlanSpace(), async_bounds=(0,), critic_modes=(CriticMode.SEPARATE,),
                                                fusion=(False,), microbatches=(1,), generation_fractions=(None,),
                                                tensor_sizes=tensor_sizes, reshard_inference=(False,),
                                                partial_rollouts=(False,), min_slot_busy=0.0, slot_tolerance=0.0),
                      optimizer_steps=optimizer_steps)
    generation: dict[tuple, float] = {}
    training: dict[tuple, tuple[float, PlanChoice]] = {}
    for skeleton in planner.skeletons():
        graph = build_graph(skeleton)
        costs, _, problems = evaluator.stage_costs(graph)
        if problems:
            continue
        generate = graph.stages_of_kind(StageKind.GENERATE)[0].name
        update = sum(c.seconds for name, c in costs.items()
                     if graph.stage(name).kind in (StageKind.ACTOR_UPDATE, StageKind.CRITIC_UPDATE))
        generation[skeleton.generation_layout] = min(generation.get(skeleton.generation_layout, math.inf),
                                                     costs[generate].seconds)
        if update < training.get(skeleton.train_layout, (math.inf, None))[0]:
            training[skeleton.train_layout] = (update, skeleton)
    if not generation:
        raise ValueError("real_like: no layout fits in device memory")
    best_generation = min(generation, key=generation.get)
    shape, hardware = evaluator.inputs.actor, evaluator.inputs.hardware
    candidates = layouts(num_devices, tensor_sizes, heads=shape.heads, kv_heads=shape.kv_heads,
                         node_size=hardware.node_size, with_fsdp=True)
    fallback = None
    for _, skeleton in sorted(training.values(), key=lambda item: item[0]):
        # the fitted micro-batches and sampler were the skeleton's layouts': fitted again to these
        choice = dataclasses.replace(skeleton, generation_layout=best_generation,
                                     execution=planner.unfitted(skeleton.execution))
        for own in (_own_inference_layouts(planner, choice, candidates), ()):
            fitted = planner.fit_microbatches(dataclasses.replace(choice, inference_layouts=own))
            graph = build_graph(fitted)
            plan = Plan(choice=fitted, graph=graph, prediction=evaluator.predict(graph))
            if plan.prediction.fits and not planner._batch_problems(plan.graph):
                return plan
            fallback = fallback or plan
    return fallback


__all__ = ["SLOT_TOLERANCE", "Plan", "PlanChoice", "PlanResult", "PlanSpace", "Planner", "build_graph",
           "expert_axis_sizes", "generation_slot_busy", "layouts", "real_like", "verl_like"]
