"""The generation margin of `trust.MOE_CHECKED`: Qwen3-30B-A3B's sampler programs (prefill, start, decode chunk) of
a colocated 32-H100 plan compiled for H100, beside the planner's prediction of its generate stage.

The plan is the first verified Qwen3-30B-A3B plan (docs/benchmarks.md, "W-plan") with the published NeMo-RL workload (64
prompts x 32, 128-token prompts, log-normal responses of mean 3,203 up to 3,968): capacity mode 1.25, generation
`--generation` (default d8xt4: no expert axis, the layout whose prefill set the old 27.5% margin) with a paged pool of
`--pool` tokens per replica, training f16xe2, compute in `--dtype`. Nothing is allocated (compile-only H100s):

    PYTHONPATH=$PWD:$PWD/.gpu-aot JAX_PLATFORMS=cpu python benchmarks/bench_moe_sampler_margin.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from rpegjax.graph.ir import Algorithm, Execution
from rpegjax.learners import GRPOConfig
from rpegjax.models import ModelConfig
from rpegjax.options import AttentionKind, CacheLayout, RematPolicy
from rpegjax.perf import planner
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.reference import presets
from rpegjax.train import dry_run
from rpegjax.train.compile_target import DryRunTarget, compile_devices, prepare_host
from rpegjax.train.config import default_grpo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", default="data=8,fsdp=1,tensor=4", help="generation layout, axis=size,...")
    parser.add_argument("--pool", type=int, default=1_020_928, help="paged pool tokens per slot replica")
    parser.add_argument("--dtype", default="bfloat16", help="matmul compute dtype")
    args = parser.parse_args()
    prepare_host(DryRunTarget.CUDA_H100)
    generation = tuple((axis, int(size)) for axis, size in (item.split("=") for item in args.generation.split(",")))
    model = ModelConfig.qwen3_moe("30b-a3b").replace(moe_capacity_factor=1.25)
    workload = Workload(prompts=64, group_size=32, prompt_tokens=128, responses=ResponseLengths.lognormal(3203, 3968))
    hw = presets.h100_node(32)
    execution = Execution(attention=AttentionKind.CUDNN, remat=RematPolicy.FULL, moe_capacity_factor=1.25,
                          kv_cache=CacheLayout.PAGED, kv_pool_tokens=args.pool, update_microbatches=2, dtype=args.dtype)
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=True, num_devices=32, optimizer_steps=4,
                                generation_layout=generation, train_layout=(("data", 1), ("fsdp", 16), ("expert", 2)),
                                execution=execution)
    graph = planner.build_graph(choice)
    prediction = step_model.Evaluator.for_runtime(model, workload, hw).predict(graph, with_trace=False,
                                                                               enforce_memory=False)
    generate = next(stage for stage in prediction.stages if stage.kind == "generate")
    replicas = math.prod(size for axis, size in generation if axis != "tensor")
    print(f"predicted generate peak {generate.peak_memory_bytes / 1e9:.2f} GB, {generate.detail['slots']} slots per "
          f"replica", flush=True)
    algorithm = GRPOConfig(**{f.name: getattr(default_grpo(), f.name) for f in dataclasses.fields(GRPOConfig)})
    algorithm = dataclasses.replace(algorithm, group_size=32, kl_coef=0.04, num_minibatches=4)
    batch = dry_run.Batch(rows=64 * 32, prompt=128, new=3968, slots=int(generate.detail["slots"]) * replicas,
                          group_size=32)
    cfg = model.replace(param_dtype=execution.param_dtype, dtype=execution.dtype,
                        max_position_embeddings=max(model.max_position_embeddings, 128 + 3968))
    started = time.time()
    programs = dry_run.lower_plan(graph, cfg, algorithm, batch, devices=compile_devices(DryRunTarget.CUDA_H100, 32),
                                  log=print)
    programs = [program for program in programs if program.stage == "generate"]
    print(f"lowered in {time.time() - started:.0f} s", flush=True)
    report = dry_run.compile_programs(programs, capacity_bytes=hw.usable_memory_bytes,
                                      predicted={s.name: s.peak_memory_bytes for s in prediction.stages}, log=print)
    print("| program | mesh | compiled GB | predicted GB | compile s |\n|---|---|---|---|---|")
    for m in report.programs:
        print(f"| {m.program} | {m.mesh} | {m.peak / 1e9:.2f} | {(m.predicted or 0) / 1e9:.2f} | {m.compile_seconds:.0f} |")


if __name__ == "__main__":
    main()
