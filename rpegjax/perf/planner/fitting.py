"""Fitting a skeleton of the planner's space to its memory: what no variant of a skeleton changes, chosen once.

`Fitter.fit` gives a skeleton (critic, placement, layouts, execution) the fewest update and inference micro-batches
of the space whose stages fit in memory (or, for packed rows, the packed-row budget whose stages fit and are
fastest), and the sampler's slots and KV pool as the generation phase's memory gives them (the fewest slots within
`PlanSpace.slot_tolerance` of the fastest generation); `own_inference_layouts` picks each inference stage's own
fastest layout (ReaL-style re-sharding). None of these depends on the asynchrony bound, fusion or generation
pieces, so they hold for every variant the search then predicts (`rpegjax.perf.planner.search`). Memory is
checked against the usable memory less each phase's trust margin (`rpegjax.perf.planner.trust`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Execution, Graph, Role, StageKind
from rpegjax.options import CacheLayout, DecodeAttention
from rpegjax.perf.model import generation_stage, stage_costs
from rpegjax.perf.model.step_model import Evaluator, device_index, placement_devices
from rpegjax.perf.planner import executable, trust
from rpegjax.perf.planner.choice import PlanChoice, build_graph, packed_budgets
from rpegjax.perf.planner.space import PlanSpace


class Fitter:
    """Fits skeletons of `space` for one evaluator (model, workload, hardware) within `regime`'s margins."""

    def __init__(self, evaluator: Evaluator, space: PlanSpace, regime: trust.CheckedRegime):
        self.evaluator = evaluator
        self.space = space
        self.regime = regime
        self._own_layouts: dict[tuple, tuple] = {}
        # the generate stage's seconds of each pinned skeleton: no variant of it steps faster (the search's first bound)
        self.generation_seconds: dict[PlanChoice, float] = {}

    def fit(self, skeleton: PlanChoice) -> PlanChoice:
        """The skeleton with the fewest update and inference micro-batches of the space whose stages fit in memory
        (the largest when none does: the plan is then ranked out, with its reason), and the sampler's slots and
        KV pool pinned to what the generation phase leaves. None of these depends on the asynchrony bound, fusion
        or generation pieces, so they hold for every variant; the sampler's memory and time depend on neither kind
        of micro-batch, nor the micro-batched stages' on the sampler, so the two are fitted apart."""
        return self.fit_passes(self.pin_generation(skeleton))

    def fit_passes(self, skeleton: PlanChoice) -> PlanChoice:
        """`skeleton` with the fewest update and inference micro-batches that fit (`fit`); a packed
        candidate with its packed-row budget instead (one budget sizes the update's and the inference passes)."""
        if skeleton.execution.packing:
            return self._fastest_budget(skeleton)
        choice = self._fewest(skeleton, "update_microbatches", self.space.update_microbatches, trust.TRAINING)
        sequences = self.evaluator.inputs.workload.sequences
        rows = [sequences // m for m in self.space.inference_microbatches if sequences % m == 0]
        return self._fewest(choice, "inference_rows", [None if r == sequences else r for r in rows], trust.INFERENCE)

    def budgets(self, choice: PlanChoice) -> list[int]:
        """The packed-row budgets the space tries for `choice` (`packed_budgets`)."""
        return packed_budgets(choice, self.evaluator.inputs.workload, self.space.packed_rows)

    def unfitted(self, execution: Execution) -> Execution:
        """`execution` before `fit`: no inference micro-batches, the sampler's slots and pool unpinned."""
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
            if self.batch_problems(graph):
                continue
            choice = candidate
            costs, persistent, _ = self.evaluator.stage_costs(graph)
            if all(persistent[device_index(placement_devices(graph, s.placement))].max() + costs[s.name].transient_bytes <= limit
                   for s in graph.stages if set(s.kinds) & kinds and np.isfinite(costs[s.name].seconds)):
                return choice
        return choice

    def pin_generation(self, choice: PlanChoice) -> PlanChoice:
        """`choice` with the sampler's slots and, for a paged cache, its pool in tokens per replica, as the
        generation phase's memory gives them, rounded as the runtime rounds slots: whole groups on every slot
        replica (`usable_slots`), and with a paged cache whole groups in every replica's pool. A paged cache whose
        replicas cannot hold a group is replaced by the contiguous one (the plan says so)."""
        execution = choice.execution
        generated = self.generation(choice)
        if generated is None:
            return choice  # not even one sequence fits: ranked out with its reason
        per_replica, cost, layout, inputs, beside = generated
        group = inputs.workload.group_size
        if execution.kv_cache is CacheLayout.PAGED and per_replica < group:
            execution = dataclasses.replace(execution, kv_cache=CacheLayout.CONTIGUOUS, kv_pool_tokens=None,
                                            decode_attention=DecodeAttention.GATHER)
            generated = self.generation(dataclasses.replace(choice, execution=execution))
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
        execution, seconds = self._fastest_slots(choice, execution, slots, step, layout.replicas)
        pinned = dataclasses.replace(choice, execution=execution)
        self.generation_seconds[pinned] = seconds
        return pinned

    def generation(self, choice: PlanChoice):
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

    def batch_problems(self, graph: Graph) -> list[str]:
        """Why the runtime could not split `graph`'s batch over its replicas (`executable.batch_problems`)."""
        return executable.batch_problems(graph, self.evaluator.inputs.workload.sequences)

    def _fastest_budget(self, skeleton: PlanChoice) -> PlanChoice:
        """`skeleton` with the packed-row budget (`packed_budgets`) whose update and inference stages fit and take
        the least time together (else the smallest budget). Not simply the largest that fits: every pass computes
        whole rows, so a budget past what the batch fills computes padding (the packed rows are rounded up to the
        row shards), and a small one pays per-pass weight gathers and overheads."""
        usable = self.evaluator.inputs.hardware.usable_memory_bytes
        limits = {**dict.fromkeys(UPDATE_KINDS, self.regime.limit(usable, trust.TRAINING)),
                  **dict.fromkeys(INFERENCE_KINDS, self.regime.limit(usable, trust.INFERENCE))}
        best, fallback = None, skeleton
        for budget in self.budgets(skeleton):
            candidate = dataclasses.replace(skeleton, execution=dataclasses.replace(
                skeleton.execution, max_tokens_per_micro_batch=budget))
            graph = build_graph(candidate)
            if self.batch_problems(graph):
                continue
            fallback = candidate
            costs, persistent, _ = self.evaluator.stage_costs(graph)
            stages = [s for s in graph.stages if set(s.kinds) & limits.keys()]
            if all(np.isfinite(costs[s.name].seconds)
                   and persistent[device_index(placement_devices(graph, s.placement))].max()
                   + costs[s.name].transient_bytes <= min(limits[k] for k in s.kinds if k in limits) for s in stages):
                seconds = sum(costs[s.name].seconds for s in stages)
                if best is None or seconds < best[0]:
                    best = (seconds, candidate)
        return fallback if best is None else best[1]

    def own_inference_layouts(self, base: PlanChoice, candidates) -> tuple:
        """Each inference stage on the layout that minimises its own pass time (ReaL-style per-stage re-sharding);
        re-sharding and memory are then costed and checked when the whole plan is predicted (timed without
        inference micro-batches: those are fitted to the layouts chosen)."""
        base = dataclasses.replace(base, execution=self.unfitted(base.execution))
        if base.execution.packing:  # timed on rows of one longest sequence: the least padding on any layout
            base = dataclasses.replace(base, execution=dataclasses.replace(
                base.execution, max_tokens_per_micro_batch=self.budgets(base)[-1]))
        key = (base.critic_mode, base.generation_devices, base.execution)
        if key not in self._own_layouts:
            graph = build_graph(base)
            inputs = self.evaluator.inputs_for(graph)
            fastest = []
            for stage in graph.stages:
                if not INFERENCE_KINDS & set(stage.kinds):
                    continue
                shape = inputs.critic if stage.role is Role.CRITIC else inputs.actor
                logits = bool({StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB} & set(stage.kinds))
                seconds = {layout: stage_costs.model_pass_cost(inputs, shape, stage_costs.Layout.from_parallel(
                    dict(layout), where=stage.name), logits=logits, backward=False).seconds for layout in candidates}
                fastest.append((stage.name, min(candidates,
                                                key=lambda layout: (seconds[layout], candidates.index(layout)))))
            self._own_layouts[key] = tuple(fastest)
        return tuple((name, layout) for name, layout in self._own_layouts[key] if layout != base.train_layout)

    def _fastest_slots(self, choice: PlanChoice, execution: Execution, most: int, step: int,
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
        capacity = self.evaluator.inputs.workload.prompt_tokens + self.evaluator.inputs.workload.responses.max
        timed = []
        for count in counts:
            candidate = _with_slots(execution, count, replicas, capacity)
            generated = self.generation(dataclasses.replace(choice, execution=candidate))
            if generated is not None:
                timed.append((generated[1].seconds, candidate, generated[1].detail["slot_busy"]))
        if not timed:
            return dataclasses.replace(execution, decode_slots=most), 0.0
        meeting = [(seconds, candidate) for seconds, candidate, busy in timed if busy >= self.space.min_slot_busy]
        if not meeting:  # the busiest: its plans are then refused, saying how busy (`Planner.slot_busy_problem`)
            seconds, candidate, _ = max(timed, key=lambda item: item[2])
            return candidate, seconds
        timed = meeting
        fastest = min(seconds for seconds, _ in timed)
        tolerance = self.space.slot_tolerance
        return next((candidate, seconds) for seconds, candidate in timed if seconds <= fastest * (1 + tolerance))


def _with_slots(execution: Execution, count: int, replicas: int, capacity: int) -> Execution:
    """`execution` with `count` decode slots (all replicas) and its paged pool at most their capacity (tokens
    past every slot at full length are never used)."""
    pool = execution.kv_pool_tokens
    if pool is not None:
        pool = min(pool, count // replicas * capacity)
    return dataclasses.replace(execution, decode_slots=count, kv_pool_tokens=pool)
