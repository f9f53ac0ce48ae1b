"""Qwen3-30B-A3B's GRPO update, and its sampler's programs, with expert parallelism, compiled ahead of time:
per-device memory.

Compiles `GRPOLearner`'s update (GRPO loss with k3 KL to the reference, clip 0.2, AdamW; float32 master weights,
bfloat16 compute, blockwise attention, full remat, scanned layers) for one row of `--tokens` tokens per device
with abstract parameters and optimiser state (`jax.ShapeDtypeStruct` with shardings: nothing is allocated), and
prints XLA's `memory_analysis()` of the partitioned program: bytes per device. The experts are split over the
layout's `expert` axis (`rpegjax.models.expert_parallel`: dropless ragged all-to-all, or `--capacity-factor`).

`--target cuda-h100` compiles with XLA's GPU compiler for compile-only H100s (no GPU: JAX's CUDA plugin on the path as
CI installs it, `PYTHONPATH=$PWD:$PWD/.gpu-aot JAX_PLATFORMS=cpu`; `rpegjax.train.compile_target`); `cpu` on virtual CPU
devices, where XLA lowers `ragged_dot` as a dense product over every expert (so its figures are not a GPU's).
The table also says how the compiled program computes the grouped matmuls (`ragged_dot` ops left in the HLO or
rewritten) and which all-to-alls it exchanges.

    PYTHONPATH=$PWD:$PWD/.gpu-aot JAX_PLATFORMS=cpu python benchmarks/bench_moe_memory.py --target cuda-h100 \
        --layouts expert8,fsdp2xexpert8 [--tokens 16384] [--layers 48] [--capacity-factor 1.25]

`--generate decode[,prefill,start]` compiles the paged sampler's programs instead (`Sampler.lower_programs`: at the
largest shapes a run reaches; bfloat16 weights in the generation layout, experts split over `expert`, slots over
every axis but tensor): `--slots` slots and a pool of `--pool-tokens` tokens per slot replica, prompts of
`--prompt` tokens, responses up to `--tokens` - `--prompt`, groups of `--group-size`, chunks of `--chunk-steps`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

LAYOUTS = {"expert8": {"expert": 8}, "expert16": {"expert": 16}, "fsdp2xexpert8": {"fsdp": 2, "expert": 8},
           "data2xexpert8": {"data": 2, "expert": 8}, "expert8xtensor2": {"expert": 8, "tensor": 2}}
GIB = 1 << 30
GENERATE_PROGRAMS = ("decode", "prefill", "start")



def _mesh_and_model(name: str, args, devices, *, param_dtype: str):
    """(mesh axes, mesh, Qwen3-30B-A3B config) of a layout: bf16 compute, the run's capacity factor and layers."""
    from rpegjax.models import ModelConfig
    from rpegjax.sharding import make_mesh

    parallel = LAYOUTS[name]
    mesh = make_mesh(parallel, devices[:math.prod(parallel.values())])
    cfg = ModelConfig.qwen3_moe("30b-a3b").replace(param_dtype=param_dtype, dtype="bfloat16",
                                                   moe_capacity_factor=args.capacity_factor or None)
    return parallel, mesh, cfg.replace(num_layers=args.layers) if args.layers else cfg

def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="cuda-h100", help="cpu, cuda-h100 or cuda-gh200")
    parser.add_argument("--layouts", default="expert8,fsdp2xexpert8", help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the one row per device")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=0, help="override the depth (0: the model's 48)")
    parser.add_argument("--capacity-factor", type=float, default=0.0, help="capacity mode (0: dropless)")
    parser.add_argument("--hlo", default="", help="write each compiled program's HLO text to this directory")
    parser.add_argument("--generate", default="", help="sampler programs instead of the update: decode,prefill,start")
    parser.add_argument("--slots", type=int, default=1024, help="--generate: slots over the whole mesh")
    parser.add_argument("--pool-tokens", type=int, default=393216, help="--generate: paged pool per slot replica")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--chunk-steps", type=int, default=16)
    args = parser.parse_args()
    for name in filter(None, args.generate.split(",")):
        if name not in GENERATE_PROGRAMS:
            parser.error(f"--generate: unknown program {name!r}; known: {list(GENERATE_PROGRAMS)}")
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {name!r}; known: {sorted(LAYOUTS)}")
    return args


def main() -> None:
    args = _arguments()
    most = max(math.prod(LAYOUTS[name].values()) for name in args.layouts.split(","))
    if args.target == "cpu":
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={most}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from rpegjax.train.compile_target import DryRunTarget, compile_devices, describe

    devices = compile_devices(DryRunTarget(args.target), most)
    if args.generate:
        for name in args.layouts.split(","):
            for line in measure_generation(name, devices, args):
                print(line, flush=True)
        return
    print(f"Qwen3-30B-A3B GRPO update, one {args.tokens}-token row per device, {describe(devices)}, jax "
          f"{jax.__version__}; experts {'dropless' if not args.capacity_factor else f'capacity {args.capacity_factor}'}")
    print("| layout | devices | layers | arguments GiB | outputs GiB | temporaries GiB | args+temps GiB | grouped matmuls "
          "| collectives | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts.split(","):
        print(measure(name, devices, args), flush=True)


def measure(name: str, devices: list, args: argparse.Namespace) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig
    from rpegjax.learners.batch import TrainBatch
    from rpegjax.learners.update import TrainState
    from rpegjax.models import Decoder
    from rpegjax.sharding import ShardingRules

    parallel, mesh, cfg = _mesh_and_model(name, args, devices, param_dtype="float32")
    count = math.prod(parallel.values())
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    rows = count // parallel.get("tensor", 1)
    grpo = GRPOConfig(group_size=rows, clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3",
                      router_aux_loss_coef=0.001, optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.0,
                                                                            max_grad_norm=1.0))
    learner = GRPOLearner(grpo, model, mesh=mesh, rules=ShardingRules.fsdp_tp())
    shapes = jax.eval_shape(learner.optimizer.init, learner.params)
    opt_state = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                             shapes, learner.state_shardings.opt_state)
    state = TrainState(params=learner.params, opt_state=opt_state,
                       step=jax.ShapeDtypeStruct((), jnp.int32, sharding=learner.state_shardings.step))
    columns = np.arange(args.tokens)
    real = np.ones((rows, args.tokens), bool)
    zeros = np.zeros((rows, args.tokens), np.float32)
    batch = TrainBatch(tokens=np.ones((rows, args.tokens), np.int32), token_mask=real,
                       response_mask=real & (columns >= args.prompt), behaviour_logprobs=zeros, ref_logprobs=zeros,
                       advantages=np.linspace(-1, 1, rows, dtype=np.float32))
    batch = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), batch)  # as the dry run lowers
    started = time.perf_counter()
    compiled = learner.lower_update(state, batch).compile()
    seconds = time.perf_counter() - started
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        with open(os.path.join(args.hlo, f"{name}-{args.target}.hlo.txt"), "w") as f:
            f.write(text)
    grouped = _grouped_matmuls(text)
    exchanges = ", ".join(f"{count} {op}" for op, count in _collectives(text).items()) or "none"
    arguments, temporaries = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    return (f"| {name} | {count} | {cfg.num_layers} | {arguments / GIB:.2f} | {memory.output_size_in_bytes / GIB:.2f} "
            f"| {temporaries / GIB:.2f} | {(arguments + temporaries) / GIB:.2f} | {grouped} | {exchanges} "
            f"| {seconds:.0f} |")


def measure_generation(name: str, devices: list, args: argparse.Namespace) -> list[str]:
    """The paged sampler's programs of `args.generate` on layout `name`: a header and one table row each."""
    import jax
    from flax import nnx

    from rpegjax.generate import CacheConfig, Sampler, SamplingConfig
    from rpegjax.generate.paged_cache import pages_for
    from rpegjax.models import Decoder

    parallel, mesh, cfg = _mesh_and_model(name, args, devices, param_dtype="bfloat16")
    count = math.prod(parallel.values())
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    cache = CacheConfig.paged(page_size=args.page_size, pages_per_replica=pages_for(args.pool_tokens, args.page_size))
    sampler = Sampler(cfg, graphdef, num_slots=args.slots, max_prompt_len=args.prompt,
                      max_new_tokens=args.tokens - args.prompt, chunk_steps=args.chunk_steps, mesh=mesh, cache=cache)
    params = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                          abstract, sampler.params_sharding)
    lowered = sampler.lower_programs(params, SamplingConfig(max_new_tokens=args.tokens - args.prompt, temperature=1.0),
                                     group_size=args.group_size)
    header = (f"Qwen3-30B-A3B sampler, {name}, {args.slots} slots over {sampler.replicas} slot replicas, paged pool "
              f"{sampler.paged.pages_per_replica} pages of {args.page_size} per replica, capacity {sampler.capacity}; "
              f"experts {'dropless' if not args.capacity_factor else f'capacity {args.capacity_factor}'}")
    columns = ("| program | layout | devices | layers | arguments GiB | outputs GiB | temporaries GiB | args+temps GiB "
               "| collectives | compile s |")
    lines = [header, columns, "|---|---|---|---|---|---|---|---|---|---|"]
    for program in args.generate.split(","):
        started = time.perf_counter()
        compiled = lowered[program].compile()
        seconds = time.perf_counter() - started
        memory, text = compiled.memory_analysis(), compiled.as_text()
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, f"{program}-{name}-{args.target}.hlo.txt"), "w") as f:
                f.write(text)
        exchanges = ", ".join(f"{n} {op}" for op, n in _collectives(text).items()) or "none"
        arguments, temporaries = memory.argument_size_in_bytes, memory.temp_size_in_bytes
        lines.append(f"| {program} | {name} | {count} | {cfg.num_layers} | {arguments / GIB:.2f} "
                     f"| {memory.output_size_in_bytes / GIB:.2f} | {temporaries / GIB:.2f} "
                     f"| {(arguments + temporaries) / GIB:.2f} | {exchanges} | {seconds:.0f} |")
    return lines


def _grouped_matmuls(text: str) -> str:
    """How the compiled HLO computes ragged_dot: ragged-dot ops left, and the largest operand of any dot / GEMM
    fusion (a dense rewrite shows up as [local experts, received rows, d])."""
    ragged = len(re.findall(r"(?<=\s)ragged-dot\(", text))
    largest, elements = "none", 0
    for line in text.splitlines():
        if "dot" not in line:
            continue
        for dtype, dims in re.findall(r"\b(bf16|f16|f32)\[([0-9,]+)\]", line):
            size = math.prod(int(dim) for dim in dims.split(","))
            if size > elements:
                largest, elements = f"{dtype}[{dims}]", size
    return f"{ragged} ragged-dot ops; largest dot operand {largest}"


def _collectives(text: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for op in ("ragged-all-to-all", "all-to-all", "all-gather", "reduce-scatter", "all-reduce"):
        # the op after whitespace (an instruction's name starts with %; an async one's shape may hold /*index=5*/)
        count = len(re.findall(rf"(?<=\s){op}(?:-start)?\(", text))
        if count:
            found[op] = count
    return found


if __name__ == "__main__":
    sys.exit(main())
