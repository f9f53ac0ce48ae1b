"""The plans other systems would run, predicted by the same model: verl's default (`verl_like`) and ReaL's
per-stage re-sharding (`real_like`), the references `scripts/plan.py` compares the planner's best against.
"""

from __future__ import annotations

import dataclasses
import math

from rpegjax.graph.ir import Algorithm, CriticMode, StageKind
from rpegjax.perf.model.step_model import Evaluator
from rpegjax.perf.planner.choice import Plan, PlanChoice, build_graph
from rpegjax.perf.planner.search import Planner
from rpegjax.perf.planner.space import PlanSpace, layouts


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
    choice = planner.fitting.fit(PlanChoice(
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
                                     execution=planner.fitting.unfitted(skeleton.execution))
        for own in (planner.fitting.own_inference_layouts(choice, candidates), ()):
            fitted = planner.fitting.fit(dataclasses.replace(choice, inference_layouts=own))
            graph = build_graph(fitted)
            plan = Plan(choice=fitted, graph=graph, prediction=evaluator.predict(graph))
            if plan.prediction.fits and not planner.fitting.batch_problems(plan.graph):
                return plan
            fallback = fallback or plan
    return fallback
