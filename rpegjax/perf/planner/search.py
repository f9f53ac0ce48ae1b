"""The planner: searches structure and execution of an RPEG together and returns executable graphs, ranked.

Search space (`PlanSpace`): asynchrony bound; for PPO a separate or shared actor-critic trunk; fusion of the
inference stages; micro-batch count of generation and the stages that consume it; colocated placement or a
split of the devices between a rollout sub-mesh and a training sub-mesh; the generation layout (tensor x data);
the training layout (data x fsdp x tensor); inference stages on the training layout or each re-sharded to the
layout that is fastest for it; the execution options the runtime supports on the hardware (attention kernel
and remat policy, `rpegjax.perf.planner.executable`), with the fewest update micro-batches that fit in memory (more
only add passes), or sequence packing with the token budget whose update and inference stages fit and are
fastest (passes of packed rows, `rpegjax.perf.model.packed_batches`). Plans are predicted as the runtime executes
them (`Evaluator.for_runtime`). Every candidate is a `Graph` built with the builders and transforms
(`rpegjax.perf.planner.choice`), predicted by `step_model.Evaluator`; plans that exceed device memory are ranked
out. What no variant of a skeleton changes (micro-batches, the sampler's slots) is fitted once per skeleton
(`rpegjax.perf.planner.fitting`).

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
import heapq
import itertools
import math
import time
from collections.abc import Iterator

from rpegjax.graph.ir import INFERENCE_KINDS, Algorithm, CriticMode, Execution, Graph, StageKind
from rpegjax.options import AttentionKind
from rpegjax.perf.model import stage_costs
from rpegjax.perf.model.costs import (
    AttentionKernel,
    forward_layer_bytes_per_token,
    layer_activation_bytes_per_token,
    layer_matmul_output_bytes_per_token,
)
from rpegjax.perf.model.step_model import Evaluator, Prediction
from rpegjax.perf.planner import executable, refusal, trust
from rpegjax.perf.planner.choice import Plan, PlanChoice, build_graph, layout_text
from rpegjax.perf.planner.fitting import Fitter
from rpegjax.perf.planner.space import PlanSpace, generation_splits, stage_layouts, within_staleness


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Plan
    alternatives: tuple[Plan, ...]  # next best, ranked
    evaluated: int  # plans predicted in full
    candidates: int  # plans in the space
    rejected: tuple[str, ...]  # why candidates that do not fit were ranked out: the closest of each family
    seconds: float


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
        self.fitting = Fitter(evaluator, self.space, self.regime)  # what no variant of a skeleton changes
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
        """Every skeleton of the space, fitted (`Fitter.fit`)."""
        for pinned in self._pinned_skeletons():
            yield self.fitting.fit_passes(pinned)

    def _pinned_skeletons(self) -> Iterator[PlanChoice]:
        """Every skeleton with its sampler pinned (`Fitter.pin_generation`) and one update and inference pass."""
        shape, hardware = self.evaluator.inputs.actor, self.evaluator.inputs.hardware
        critic_modes = self.space.critic_modes if self.algorithm is Algorithm.PPO else (CriticMode.SEPARATE,)
        for critic_mode, split in itertools.product(critic_modes, generation_splits(self.num_devices, self.space.generation_fractions,
                                                                          hardware.node_size)):
            train_devices = self.num_devices - split
            generation, training = stage_layouts(self.space, shape, hardware, split or self.num_devices, train_devices)
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
                        yield self.fitting.pin_generation(base)
                    else:
                        own = self.fitting.own_inference_layouts(base, training)
                        if own:
                            yield self.fitting.pin_generation(dataclasses.replace(base, inference_layouts=own))

    def variants(self, skeleton: PlanChoice) -> Iterator[PlanChoice]:
        for k, fused, m in itertools.product(self.space.async_bounds, self.space.fusion, self.space.microbatches):
            if within_staleness(skeleton.execution, k, max(self.space.async_bounds)):
                yield dataclasses.replace(skeleton, async_bound=k, fused=fused, microbatches=m)

    def _bound(self, skeleton: PlanChoice, *, fitted: bool = True) -> float:
        """A lower bound on the step of every variant of `skeleton`; unless `fitted`, of every variant of the
        skeleton with its micro-batches fitted: one update and inference pass, their memory not checked (more
        passes only add work, and fitting sees to memory); a packed skeleton's fastest budget (a larger one
        computes more padding)."""
        choices = [skeleton]
        if not fitted and skeleton.execution.packing:
            choices = [dataclasses.replace(skeleton, execution=dataclasses.replace(
                skeleton.execution, max_tokens_per_micro_batch=budget)) for budget in self.fitting.budgets(skeleton)]
        bounds = [float("inf")]
        for choice in choices:
            graph = build_graph(choice)
            if self.fitting.batch_problems(graph) or self._outside_regime(graph):
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
        heap = [(self.fitting.generation_seconds.get(pinned, 0.0), index, False, pinned)
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
            skeleton = self.fitting.fit_passes(pinned)
            bound = first_bound if math.isinf(first_bound) else self._bound(skeleton)
            if math.isinf(bound):
                misses.append((index, skeleton))
                continue
            if len(ranked) >= top and bound > ranked[-1][0][0]:
                continue
            for choice in self.variants(skeleton):
                if self.fitting.batch_problems(build_graph(choice)):
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
        problems = self.fitting.batch_problems(graph)
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
        """Why the planner does not trust `plan`'s predicted memory (`rpegjax.perf.planner.trust`), or None."""
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
                 if not self.fitting.batch_problems(build_graph(choice))]
        fitting = sorted((p for p in plans if p.prediction.fits and self.untrusted(p) is None
                          and self.slot_busy_problem(p) is None), key=_rank_key)
        return fitting[:top]


def _keep_closest(choice: PlanChoice, need: tuple, line: str, rejected: dict[str, tuple[tuple, str]]) -> None:
    """Records `line` as the refusal of `choice`'s family (placement and critic) when it is the closest yet."""
    family = "colocated" if not choice.generation_devices else (
        f"disaggregated {choice.generation_devices}+{choice.num_devices - choice.generation_devices}")
    if choice.algorithm is Algorithm.PPO:
        family += f", critic {choice.critic_mode.value}"
    layouts = f"gen {layout_text(choice.generation_layout)}, train {layout_text(choice.train_layout)}"
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
