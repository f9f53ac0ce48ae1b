"""What rpegjax's runtime can execute: a plan's graph and execution options on a hardware spec, or why not.

The planner searches only executions that pass `execution_problems`, and `scripts/plan.py` refuses (with
these reasons) any plan that fails `plan_problems`: a prediction for a plan the runtime cannot run is not
printed. The rules mirror the runtime:

* attention "cudnn" is cuDNN's fused kernel: a CUDA GPU and bfloat16/float16 compute
  (`rpegjax.models.attention.cudnn_attention`); "dense" and "blockwise" run on any backend and dtype;
* the runtime's meshes shard over `data`, `fsdp` and `tensor` only (no pipeline stages);
* batches are padded rows, or packed as `Execution.packing` says (first-fit-decreasing rows of the token budget,
  one per row shard per pass), never another system's token-sized passes over real tokens: the cost options must
  be those of `ExecutionOptions.executing` (an `Evaluator.for_runtime`);
* packed rows mask attention per segment, which cuDNN's kernel cannot (jax's `dot_product_attention` takes no
  segment ids): packing runs with "blockwise" or "dense" attention;
* every batch a program sees splits evenly over its layout's data x fsdp replicas: an update micro-batch
  (sequences / (mini-batches x micro-batches)), an inference piece (sequences / the stage's micro-batches) and
  its row micro-batches (`Execution.inference_rows`) (`rpegjax.sharding.rules` refuses an activation whose
  batch does not divide).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Execution, Graph, StageKind
from rpegjax.options import AttentionKind, DecodeAttention
from rpegjax.perf.model.hardware import HardwareSpec
from rpegjax.perf.model.stage_costs import row_micro_batches

RUNTIME_AXES = ("data", "fsdp", "expert", "context", "tensor")  # the job's mesh axes (train/config.MESH_AXES)


def execution_problems(execution: Execution, hardware: HardwareSpec) -> list[str]:
    """Why the runtime cannot run `execution` on `hardware` (empty when it can)."""
    problems = []
    if execution.attention is AttentionKind.CUDNN:
        platform = hardware.device.platform
        if platform != "gpu":
            problems.append(f"attention 'cudnn' needs a CUDA GPU; {hardware.device.name} is a {platform} device "
                            f"(use 'blockwise')")
    if execution.decode_attention is DecodeAttention.PALLAS and hardware.device.platform != "gpu":
        problems.append(f"decode attention 'pallas' (a Triton kernel) needs a CUDA GPU; {hardware.device.name} is a "
                        f"{hardware.device.platform} device (use 'gather')")
    if execution.packing and execution.attention is AttentionKind.CUDNN:
        problems.append("attention 'cudnn' cannot mask packed rows (no segment ids in jax's dot_product_attention); "
                        "packing runs with 'blockwise' or 'dense'")
    if execution.dtype not in execution.attention.compute_dtypes:
        problems.append(f"attention '{execution.attention}' computes in {' or '.join(execution.attention.compute_dtypes)}, "
                        f"the plan in {execution.dtype} (use 'blockwise', or bfloat16 compute)")
    return problems


def packed_row_problem(budget: int, context: int, block: int) -> str | None:
    """Why packed rows of `budget` tokens cannot run over `context` devices (None when they can): context
    parallelism cuts a row into 2·context equal chunks of whole attention blocks (`rpegjax.models.context_attention`)."""
    if context == 1:
        return None
    chunk, rest = divmod(budget, 2 * context)
    if rest or chunk % min(block, chunk):
        return (f"packed rows of {budget} tokens do not cut into {2 * context} chunks of whole attention blocks of "
                f"{block} tokens (context {context}; max_tokens_per_micro_batch a multiple of {2 * context * block})")
    return None


def graph_layouts(graph: Graph) -> list[tuple[str, Mapping[str, int]]]:
    """Every layout of `graph`, named: its placements' and the stages' own."""
    layouts = [(f"placement {p.name!r}", p.parallel) for p in graph.placements.values()]
    return layouts + [(f"stage {s.name!r}", s.parallel) for s in graph.stages if s.parallel is not None]


def packed_rows_problems(graph: Graph, widths: Iterable[int]) -> list[tuple[str, str]]:
    """(layout, why) for each layout of `graph` over which packed rows of one of `widths` tokens cannot run
    (`packed_row_problem`)."""
    widths = list(widths)
    problems = []
    for where, parallel in graph_layouts(graph):
        for width in widths:
            problem = packed_row_problem(width, parallel.get("context", 1), graph.execution.attention_block_size)
            if problem:
                problems.append((where, problem))
    return problems


def batch_problems(graph: Graph, sequences: int) -> list[str]:
    """Why a step of `sequences` rows does not split evenly over the replicas of the programs that read it."""
    problems = []
    for stage in graph.stages:
        if stage.host:
            continue
        parallel = graph.parallel_of(stage.name)
        replicas = parallel.get("data", 1) * parallel.get("fsdp", 1) * parallel.get("expert", 1)  # rows split over all three
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
                            f"{replicas} data x fsdp x expert replicas")
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
    for where, parallel in graph_layouts(graph):
        unknown = {axis: size for axis, size in parallel.items() if axis not in RUNTIME_AXES and size > 1}
        if unknown:
            problems.append(f"{where} splits over {unknown}; the runtime's meshes have axes {RUNTIME_AXES} only")
    if graph.execution.packing:
        budget = graph.execution.max_tokens_per_micro_batch
        problems += [f"{where}: {problem}" for where, problem in packed_rows_problems(graph, [budget])]
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


__all__ = ["RUNTIME_AXES", "batch_problems", "execution_problems", "graph_layouts", "packed_row_problem",
           "packed_rows_problems", "plan_problems", "require_executable"]
