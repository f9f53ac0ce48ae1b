"""Why a plan does not fit, in one line a user can act on: the stage that binds, its phase, and what would fit.

A plan is refused by the first of: the persistent state alone (weights and optimiser state of every model on a
device), a stage whose need exceeds the usable memory (the largest such), or a batch that does not split over
the replicas. The phase says when the memory is needed (generation: the sampler's weights and KV cache;
inference: a log-prob or value pass; training: an update); the remedy names the plan's own knob when the space
has more of it (more micro-batches) and otherwise what the user can change (more GPUs, fewer prompts, shorter
responses, more tensor parallelism in generation).
"""

from __future__ import annotations

import math

from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Graph, StageKind
from rpegjax.options import RematPolicy
from rpegjax.perf.model.step_model import Prediction


def phase_of(graph: Graph, stage_name: str) -> str:
    """The phase a stage's memory belongs to: generation, inference or training."""
    kinds = set(graph.stage(stage_name).kinds)
    if StageKind.GENERATE in kinds:
        return "generation"
    if kinds & UPDATE_KINDS:
        return "training"
    if kinds & INFERENCE_KINDS:
        return "inference"
    return "step"


def closeness(prediction: Prediction | None) -> tuple[int, float]:
    """How far a refused plan is from fitting, for ranking misses: a batch that does not split or persistent state
    over the memory are farthest, then generation without room for one sequence, then by GB needed."""
    if prediction is None:
        return 3, math.inf
    if any("persistent state" in p for p in prediction.problems):
        return 2, prediction.needed_memory_bytes
    bound = binding_stage(prediction)
    return (1 if bound is not None and math.isinf(bound[1]) else 0), prediction.needed_memory_bytes


def binding_stage(prediction: Prediction) -> tuple[str, float] | None:
    """(name, GB needed per GPU) of the stage that needs the most memory, or that could not be costed at all
    (generation where not one sequence's KV cache fits: infinite need); None when no stage exceeds the usable."""
    over = [(math.inf if not math.isfinite(s.seconds) else s.peak_memory_bytes, s.name) for s in prediction.stages
            if not math.isfinite(s.seconds) or s.peak_memory_bytes > prediction.memory_limit_bytes]
    if not over:
        return None
    need, name = max(over)
    return name, need


def remedy(phase: str, graph: Graph, *, most_update_microbatches: int, most_inference_microbatches: int,
           sequences: int) -> str:
    """What would make a plan bound by `phase` fit: the plan's own knob while the space has more, else the
    workload or the cluster."""
    execution = graph.execution
    if execution.packing and phase in ("training", "inference"):  # the planner tried its budgets down to the smallest
        return (f"more GPUs, context parallelism or shorter responses (already packed rows of "
                f"{execution.max_tokens_per_micro_batch} tokens, the space's smallest budget)")
    if phase == "training":
        if execution.update_microbatches < most_update_microbatches:
            return f"more update micro-batches (it has {execution.update_microbatches})"
        if execution.remat is not RematPolicy.FULL:
            return "full remat, more GPUs or shorter responses"
        return (f"more GPUs, shorter responses or fewer prompts (already {execution.update_microbatches} update "
                f"micro-batches, full remat)")
    if phase == "inference":
        rows = execution.inference_rows or sequences
        if sequences // rows < most_inference_microbatches:
            return f"more inference micro-batches (rows {rows} each)"
        return f"more GPUs or shorter responses (already {rows} rows per inference micro-batch)"
    if phase == "generation":
        generate, update = graph.stages_of_kind(StageKind.GENERATE), graph.stages_of_kind(StageKind.ACTOR_UPDATE)
        colocated = bool(generate and update) and generate[0].placement == update[0].placement
        offload = "the optimiser state offloaded while generating, " if colocated and not execution.optimizer_offload else ""
        return (f"{offload}a smaller KV pool or fewer slots, more tensor parallelism in generation (its weights and KV "
                "heads split further), or shorter responses (--response-max)")
    return "more GPUs"


def refusal_line(prediction: Prediction | None, *, batch_problems: list[str], most_update_microbatches: int,
                 most_inference_microbatches: int, sequences: int) -> str:
    """One line: what binds, in which phase, how much it needs of the usable memory, and what would fit (a plan
    whose batch does not split is not predicted: `prediction` None)."""
    if batch_problems:
        return f"batch: {batch_problems[0]}; choose prompts x group size divisible by the replicas"
    graph, limit = prediction.graph, prediction.memory_limit_bytes
    persistent = [p for p in prediction.problems if "persistent state" in p]
    if persistent:
        return f"{persistent[0].split(': ', 1)[1]}: fits with more GPUs (FSDP shards it) or bfloat16 weights"
    bound = binding_stage(prediction)
    if bound is not None:
        name, need = bound
        phase = phase_of(graph, name)
        fix = remedy(phase, graph, most_update_microbatches=most_update_microbatches,
                     most_inference_microbatches=most_inference_microbatches, sequences=sequences)
        if math.isinf(need):
            detail = next((p.split(": ", 1)[1] for p in prediction.problems if p.startswith(f"stage {name!r}")), "")
            return f"{phase} ({name}): {detail}; fits with {fix}"
        return f"{phase} ({name}): needs {need / 1e9:.1f} of {limit / 1e9:.1f} GB per GPU; fits with {fix}"
    return f"does not fit: {prediction.problems[0] if prediction.problems else 'unknown'}"


__all__ = ["binding_stage", "closeness", "phase_of", "refusal_line", "remedy"]
