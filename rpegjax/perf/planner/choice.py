"""One point of the planner's space (`PlanChoice`), the executable graph it stands for (`build_graph`) and a
predicted plan (`Plan`).

`build_graph` applies the builder (asynchrony, critic sharing), the placements and layouts, then the fusion and
micro-batch transforms, and validates; the structure is cached per choice of everything but the execution
options, which the planner varies most.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from rpegjax.graph import transforms
from rpegjax.graph.builders import ALL_PLACEMENT, grpo_graph, ppo_graph
from rpegjax.graph.ir import INFERENCE_KINDS, Algorithm, CriticMode, Execution, Graph, Placement, StageKind
from rpegjax.perf.model.step_model import Prediction

ROLLOUT, TRAIN = transforms.ROLLOUT_PLACEMENT, transforms.TRAIN_PLACEMENT


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
        parts = [f"k={self.async_bound}", placement, f"gen {layout_text(self.generation_layout)}",
                 f"train {layout_text(self.train_layout)}"]
        if self.algorithm is Algorithm.PPO:
            parts.append(f"critic {self.critic_mode.value}")
        parts.append("fused" if self.fused else "unfused")
        if self.microbatches > 1:
            parts.append(f"{self.microbatches} microbatches")
        if self.optimizer_steps > 1:
            parts.append(f"{self.optimizer_steps} optimiser steps")
        if self.inference_layouts:
            parts.append("re-sharded " + ", ".join(f"{s}:{layout_text(l)}" for s, l in self.inference_layouts))
        parts.append(self.execution.describe())
        return "; ".join(parts)


def layout_text(layout: tuple[tuple[str, int], ...]) -> str:
    return "x".join(f"{axis[0]}{size}" for axis, size in layout if size > 1) or "1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    choice: PlanChoice
    graph: Graph
    prediction: Prediction


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
