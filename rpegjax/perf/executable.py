"""What rpegjax's runtime can execute: a plan's graph and execution options on a hardware spec, or why not.

The planner searches only executions that pass `execution_problems`, and `scripts/plan.py` refuses (with
these reasons) any plan that fails `plan_problems`: a prediction for a plan the runtime cannot run is not
printed. The rules mirror the runtime:

* attention "cudnn" is cuDNN's fused kernel: a CUDA GPU and bfloat16/float16 compute
  (`rpegjax.models.attention.cudnn_attention`); "dense" and "blockwise" run on any backend and dtype;
* the runtime's meshes shard over `data`, `fsdp` and `tensor` only (no pipeline stages);
* there is no sequence packing and no token-sized micro-batching: the cost options must be those of
  `ExecutionOptions.executing` (an `Evaluator.for_runtime`), not another system's;
* every batch a program sees splits evenly over its layout's data x fsdp replicas: an update micro-batch
  (sequences / (mini-batches x micro-batches)), an inference piece (sequences / the stage's micro-batches) and
  its row micro-batches (`Execution.inference_rows`) (`rpegjax.sharding.rules` refuses an activation whose
  batch does not divide).
"""

from __future__ import annotations

from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Execution, Graph, StageKind
from rpegjax.options import AttentionKind
from rpegjax.perf.hardware import HardwareSpec
from rpegjax.perf.stage_costs import row_micro_batches

RUNTIME_AXES = ("data", "fsdp", "context", "tensor")


def execution_problems(execution: Execution, hardware: HardwareSpec) -> list[str]:
    """Why the runtime cannot run `execution` on `hardware` (empty when it can)."""
    problems = []
    if execution.attention is AttentionKind.CUDNN:
        platform = hardware.device.platform
        if platform != "gpu":
            problems.append(f"attention 'cudnn' needs a CUDA GPU; {hardware.device.name} is a {platform} device "
                            f"(use 'blockwise')")
    if execution.dtype not in execution.attention.compute_dtypes:
        problems.append(f"attention '{execution.attention}' computes in {' or '.join(execution.attention.compute_dtypes)}, "
                        f"the plan in {execution.dtype} (use 'blockwise', or bfloat16 compute)")
    return problems


def batch_problems(graph: Graph, sequences: int) -> list[str]:
    """Why a step of `sequences` rows does not split evenly over the replicas of the programs that read it."""
    problems = []
    for stage in graph.stages:
        if stage.host:
            continue
        parallel = graph.parallel_of(stage.name)
        replicas = parallel.get("data", 1) * parallel.get("fsdp", 1)
        if set(stage.kinds) & UPDATE_KINDS:
            parts = int(stage.options.get("minibatches", 1)) * graph.execution.update_microbatches
            what = f"{parts} update micro-batches"
        elif set(stage.kinds) & INFERENCE_KINDS:
            parts, what = stage.microbatches, f"{stage.microbatches} pieces"
            rows = graph.execution.inference_rows
            if rows is not None and sequences % parts == 0:
                try:
                    row_micro_batches(sequences // parts, rows, shards=replicas)
                except ValueError as error:
                    problems.append(f"stage {stage.name!r}: {error}")
        else:
            continue
        if sequences % parts or (sequences // parts) % replicas:
            problems.append(f"stage {stage.name!r}: {sequences} sequences in {what} do not split over its "
                            f"{replicas} data x fsdp replicas")
    return problems


def plan_problems(graph: Graph, hardware: HardwareSpec, *, follows_runtime: bool = True,
                  sequences: int | None = None) -> list[str]:
    """Why the runtime cannot execute `graph` on `hardware` as predicted (empty when it can).

    `follows_runtime`: whether the prediction used the runtime's kernels and batching for the graph's
    execution options (`Evaluator.for_runtime`); a prediction with another system's options is of a plan the
    runtime would run differently."""
    problems = execution_problems(graph.execution, hardware)
    if not follows_runtime:
        problems.append("predicted with another system's execution options (sequence packing, token-sized "
                        "micro-batches, its kernels), not the runtime's (Evaluator.for_runtime)")
    layouts = [(f"placement {p.name!r}", p.parallel) for p in graph.placements.values()]
    layouts += [(f"stage {s.name!r}", s.parallel) for s in graph.stages if s.parallel is not None]
    for where, parallel in layouts:
        unknown = {axis: size for axis, size in parallel.items() if axis not in RUNTIME_AXES and size > 1}
        if unknown:
            problems.append(f"{where} splits over {unknown}; the runtime's meshes have axes {RUNTIME_AXES} only")
    for stage in graph.stages_of_kind(StageKind.GENERATE):
        if graph.parallel_of(stage.name).get("context", 1) > 1:
            problems.append(f"stage {stage.name!r} splits rows over 'context'; the sampler does not (context "
                            f"parallelism is for training and inference stages)")
    if graph.num_devices > hardware.num_devices:
        problems.append(f"the plan needs {graph.num_devices} devices, {hardware.name!r} has {hardware.num_devices}")
    if sequences is not None:
        problems += batch_problems(graph, sequences)
    return problems


def require_executable(graph: Graph, hardware: HardwareSpec, *, follows_runtime: bool = True,
                       sequences: int | None = None, where: str = "plan") -> None:
    """Raises ValueError naming every reason the runtime cannot execute `graph`."""
    problems = plan_problems(graph, hardware, follows_runtime=follows_runtime, sequences=sequences)
    if problems:
        raise ValueError(f"{where} cannot be executed by rpegjax's runtime: " + "; ".join(problems))


__all__ = ["RUNTIME_AXES", "batch_problems", "execution_problems", "plan_problems", "require_executable"]
