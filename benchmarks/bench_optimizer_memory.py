"""Optimiser state that fits: per-device memory of the actor update at real shapes with the
AdamW state laid out as the parameters, split over the data axes too (ZeRO-1, `--optimizer-sharding data`), and
offloaded to host memory while generation runs (`--offload`).

Compiles GRPOLearner's update (GRPO loss, k3 KL, AdamW, one optimiser step, one row of `--tokens` tokens per data
shard) ahead of time on `--devices` virtual CPU devices with abstract parameters and optimiser state (nothing of the
model is allocated) and prints XLA's `memory_analysis()` per device beside:

* state: bytes per device of the parameters and of the optimiser state, from the abstract arrays' own shards;
* generation phase: what stays in device memory while the sampler runs (parameters, plus the optimiser state
  unless offloaded) and what waits in host memory;
* the performance model's figures for the same layout (`rpegjax.perf`): the persistent state of the training and
  generation phases, and the update's peak (persistent + transient).

XLA's CPU backend reports no host bytes in `memory_analysis()` (its `host_*` fields stay 0 even for a program whose
arguments are in `pinned_host` memory), so host-resident bytes come from the arrays' shardings. The CPU backend also
computes bfloat16 matmuls through float32 copies, so its temporaries overstate a GPU's.

    python benchmarks/bench_optimizer_memory.py --model 32b --devices 16 --layout data=2,fsdp=4,tensor=2 \
        --tokens 16384 --optimizer-sharding data --offload
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="7b", help="Qwen2.5 size: 0.5b, 1.5b, 7b, 32b, 72b")
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    parser.add_argument("--layout", default="fsdp=8", help="mesh axis sizes, e.g. data=2,fsdp=4,tensor=2")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of each row (one row per data shard)")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=0, help="override the depth (0: the model's own)")
    parser.add_argument("--optimizer-sharding", default="params", choices=["params", "data"])
    parser.add_argument("--offload", action="store_true", help="optimiser state in host memory while generating")
    return parser.parse_args(argv)


ARGS = parse_args(sys.argv[1:])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.devices}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rpegjax.graph.ir import Execution  # noqa: E402
from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig  # noqa: E402
from rpegjax.learners.batch import TrainBatch  # noqa: E402
from rpegjax.learners.update import TrainState  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402
from rpegjax.perf.model import costs  # noqa: E402
from rpegjax.perf.model.generation_cost import ResponseLengths  # noqa: E402
from rpegjax.perf.model.stage_costs import (  # noqa: E402
    CostInputs,
    ExecutionOptions,
    Layout,
    Workload,
    model_pass_cost,
    optimizer_state_bytes,
)
from rpegjax.perf.reference import presets
from rpegjax.runtime.offload import HOST_MEMORY  # noqa: E402
from rpegjax.sharding import make_mesh  # noqa: E402
from rpegjax.train.dry_run import shard_bytes  # noqa: E402

GIB = 1 << 30


def execution(args: argparse.Namespace) -> Execution:
    return Execution(attention="blockwise", remat="full", scan_layers=True, param_dtype="float32", dtype="bfloat16",
                     optimizer_sharding=args.optimizer_sharding, optimizer_offload=args.offload)


def abstract_state(learner: GRPOLearner, offload: bool) -> tuple[TrainState, TrainState]:
    """The learner's TrainState as ShapeDtypeStructs with its shardings: as the update takes it, and as it waits
    between updates (the optimiser state in host memory when offloaded)."""
    shapes = jax.eval_shape(learner.optimizer.init, learner.params)
    place = lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)  # noqa: E731
    opt_state = jax.tree.map(place, shapes, learner.state_shardings.opt_state)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=learner.state_shardings.step)
    state = TrainState(params=learner.params, opt_state=opt_state, step=step)
    if not offload:
        return state, state
    host = jax.tree.map(lambda leaf: place(leaf, leaf.sharding.with_memory_kind(HOST_MEMORY)), opt_state)
    return state, state.replace(opt_state=host)


def batch_of(rows: int, tokens: int, prompt: int) -> TrainBatch:
    columns = np.arange(tokens)
    real = np.ones((rows, tokens), bool)
    zeros = np.zeros((rows, tokens), np.float32)
    return TrainBatch(tokens=np.ones((rows, tokens), np.int32), token_mask=real,
                      response_mask=np.broadcast_to(columns >= prompt, (rows, tokens)).copy(),
                      behaviour_logprobs=zeros, ref_logprobs=zeros, advantages=np.linspace(-1, 1, rows, dtype=np.float32))


def predicted(cfg: ModelConfig, parallel: dict[str, int], args: argparse.Namespace) -> dict[str, float]:
    """The performance model's persistent bytes per device (training and generation phases) and update peak."""
    shape = costs.ModelShape.from_config(cfg)
    layout = Layout.from_parallel(parallel, where="bench_optimizer_memory")
    options = ExecutionOptions().executing(execution(args))
    workload = Workload(prompts=layout.replicas, group_size=1, prompt_tokens=args.prompt,
                        responses=ResponseLengths.fixed(args.tokens - args.prompt))
    inputs = CostInputs(hardware=presets.gh200_quad(args.devices), actor=shape, critic=shape, workload=workload,
                        options=options)
    weights = shape.weight_bytes / layout.shards
    optimizer = optimizer_state_bytes(shape, layout, options)
    cost = model_pass_cost(inputs, shape, layout, logits=True, backward=True, optimizer_steps=1)
    return {"weights": weights, "optimizer": optimizer, "generation": weights + (0.0 if args.offload else optimizer),
            "peak": weights + optimizer + cost.transient_bytes}


def main() -> None:
    args = ARGS
    parallel = {name: int(size) for name, size in (item.split("=") for item in args.layout.split(","))}
    cfg = ModelConfig.qwen2p5(args.model).replace(param_dtype="float32", dtype="bfloat16", attention="blockwise",
                                                  remat="full", scan_layers=True)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    mesh = make_mesh(parallel)
    rows = mesh.devices.size // parallel.get("tensor", 1)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    grpo = GRPOConfig(group_size=rows, kl_coef=0.04, kl_kind="k3", optimizer=OptimizerConfig(weight_decay=0.0))
    learner = GRPOLearner(grpo, model, mesh=mesh, optimizer_sharding=args.optimizer_sharding)
    updating, resting = abstract_state(learner, args.offload)
    started = time.perf_counter()
    compiled = learner.lower_update(updating, batch_of(rows, args.tokens, args.prompt)).compile()
    seconds = time.perf_counter() - started
    memory = compiled.memory_analysis()
    on_host = lambda leaf: leaf.sharding.memory_kind == HOST_MEMORY  # noqa: E731
    resting_leaves = jax.tree.leaves(resting)
    device_resting = shard_bytes([leaf for leaf in resting_leaves if not on_host(leaf)])
    host_resting = shard_bytes([leaf for leaf in resting_leaves if on_host(leaf)])
    model_figures = predicted(cfg, parallel, args)
    row = {"model": f"{args.model} ({cfg.num_layers} layers)", "devices": args.devices, "layout": args.layout,
           "tokens": args.tokens, "optimizer": args.optimizer_sharding + (" + offload" if args.offload else ""),
           "params GiB": shard_bytes(updating.params) / GIB, "optimizer GiB": shard_bytes(updating.opt_state) / GIB,
           "arguments GiB": memory.argument_size_in_bytes / GIB, "temporaries GiB": memory.temp_size_in_bytes / GIB,
           "args+temps GiB": (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / GIB,
           "generation device GiB": device_resting / GIB, "generation host GiB": host_resting / GIB,
           "predicted optimizer GiB": model_figures["optimizer"] / GIB,
           "predicted generation GiB": model_figures["generation"] / GIB,
           "predicted update peak GiB": model_figures["peak"] / GIB, "compile s": seconds}
    print(" | ".join(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}"
                     for key, value in row.items()), flush=True)


if __name__ == "__main__":
    main()
