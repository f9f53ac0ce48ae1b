"""The performance model's per-device peak memory against XLA's compiled programs.

For each (Qwen2.5 size, tokens per row, layout, attention, remat) a GRPO plan on 8 virtual CPU devices (one
row per data shard, prompt `--prompt` tokens) is dry-run (`rpegjax.train.dry_run`: every stage program
compiled with abstract inputs, nothing allocated) and predicted by `Evaluator.for_runtime` for the same
graph, execution options and batch. Per stage:

    compiled  = arguments + outputs + temporaries − donated aliases (XLA's memory_analysis, per device)
                + the state resident beside the program (training state, reference and generation weights)
    predicted = the model's persistent state on the stage's devices + the stage's transient bytes

and the relative error (predicted / compiled − 1). Target: within 15%. XLA's CPU backend computes bfloat16
matmuls through float32 copies, so on the CPU target bfloat16 rows are compiled in float32 (`--dtype`);
`--target cuda-h100` compiles with XLA's GPU compiler for 8 compile-only H100s instead (JAX's CUDA plugin:
`pip install -e ".[gpu-aot]"`; `rpegjax.train.compile_target`), where bfloat16 is what a GPU holds.

    python benchmarks/bench_memory_model.py --models 0.5b --tokens 2048,4096 --layouts fsdp8,fsdp4xtp2
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import itertools

from rpegjax.graph import builders
from rpegjax.graph.ir import Execution
from rpegjax.learners import GRPOConfig
from rpegjax.models import ModelConfig
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.reference import presets
from rpegjax.train.compile_target import DryRunTarget, compile_devices
from rpegjax.train.dry_run import Batch, dry_run

GIB = 1 << 30
LAYOUTS = {"fsdp8": {"data": 1, "fsdp": 8, "tensor": 1}, "fsdp4xtp2": {"data": 1, "fsdp": 4, "tensor": 2},
           "d2xf2xt2": {"data": 2, "fsdp": 2, "tensor": 2}}


def compare(model: ModelConfig, parallel: dict[str, int], tokens: int, prompt: int, execution: Execution,
            *, logprob_chunk: int = 256, target: DryRunTarget = DryRunTarget.CPU) -> list[dict]:
    """Rows of (stage, compiled peak, predicted peak) for one shape; one row per data replica and device,
    compiled for `target`'s devices."""
    graph = dataclasses.replace(builders.grpo_graph(use_reference=True, num_devices=8, parallel=parallel),
                                execution=execution)
    replicas = parallel["data"] * parallel["fsdp"]
    cfg = model.replace(param_dtype=execution.param_dtype, dtype=execution.dtype,
                        max_position_embeddings=max(model.max_position_embeddings, tokens))
    workload = Workload(prompts=1, group_size=replicas, prompt_tokens=prompt, responses=ResponseLengths.fixed(tokens - prompt))
    hw = presets.h100_node(8)
    prediction = step_model.Evaluator.for_runtime(cfg, workload, hw).predict(graph, enforce_memory=False, with_trace=False)
    predicted = {s.name: s.peak_memory_bytes for s in prediction.stages}
    report = dry_run(graph, cfg, GRPOConfig(group_size=replicas, kl_coef=0.04, logprob_chunk_size=logprob_chunk),
                     Batch(rows=replicas, prompt=prompt, new=tokens - prompt, slots=replicas, group_size=replicas),
                     capacity_bytes=hw.usable_memory_bytes, predicted=predicted, devices=compile_devices(target, 8))
    rows = []
    for program in report.programs:
        if program.predicted is None:  # a program the model does not predict alone (prefill, weight sync)
            continue
        rows.append({"stage": program.stage, "program": program.program.split(" ")[0], "compiled": program.peak,
                     "xla_program": program.program_bytes, "resident": program.resident,
                     "predicted": program.predicted, "compile_s": program.compile_seconds})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.5b", help="Qwen2.5 sizes, comma-separated")
    parser.add_argument("--layers", type=int, default=0, help="override the depth (0: the model's own)")
    parser.add_argument("--tokens", default="2048,4096", help="tokens per row, comma-separated")
    parser.add_argument("--layouts", default="fsdp8,fsdp4xtp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--attention", default="blockwise", help="comma-separated kernels")
    parser.add_argument("--remat", default="full,none", help="comma-separated policies")
    parser.add_argument("--dtype", default="float32", help="compute dtype (master weights float32)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--target", default="cpu", choices=list(DryRunTarget), help="what to compile for")
    args = parser.parse_args()
    print("| model | layout | tokens/row | attention | remat | stage | program | XLA program GiB | resident GiB "
          "| compiled peak GiB | predicted GiB | error | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for size, layout, tokens, attention, remat in itertools.product(
            args.models.split(","), args.layouts.split(","), [int(t) for t in args.tokens.split(",")],
            args.attention.split(","), args.remat.split(",")):
        model = ModelConfig.qwen2p5(size)
        if args.layers:
            model = model.replace(num_layers=args.layers)
        execution = Execution(attention=attention, remat=remat, scan_layers=True, param_dtype="float32", dtype=args.dtype)
        for row in compare(model, LAYOUTS[layout], tokens, args.prompt, execution, target=DryRunTarget(args.target)):
            error = row["predicted"] / row["compiled"] - 1
            errors.append(abs(error))
            print(f"| {size}{'' if not args.layers else f' ({args.layers} layers)'} | {layout} | {tokens} | {attention} "
                  f"| {remat} | {row['stage']} | {row['program']} | {row['xla_program'] / GIB:.2f} "
                  f"| {row['resident'] / GIB:.2f} | {row['compiled'] / GIB:.2f} | {row['predicted'] / GIB:.2f} "
                  f"| {100 * error:+.0f}% | {row['compile_s']:.1f} |", flush=True)
    if errors:
        errors.sort()
        print(f"\n{len(errors)} programs: median |error| {100 * errors[len(errors) // 2]:.0f}%, max {100 * errors[-1]:.0f}%, "
              f"within 15%: {sum(e <= 0.15 for e in errors)} of {len(errors)}")


if __name__ == "__main__":
    main()
