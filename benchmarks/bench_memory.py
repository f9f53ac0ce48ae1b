"""W-long (shared/WORKLOADS.md): per-device memory of the actor update and a log-prob stage at real shapes.

Compiles ahead of time on 8 virtual CPU devices with abstract parameters and optimiser state
(`jax.ShapeDtypeStruct` with shardings: nothing of the model is allocated) and reads XLA's
`compiled.memory_analysis()` of the partitioned program, i.e. bytes per device:

* update    GRPOLearner's update (GRPO loss with k3 KL to the reference, clip 0.2, AdamW), one optimiser
            step on one row per device of `--tokens` tokens;
* logprobs  the learner's log-prob stage (reference / old log-probs) on the same batch;
* logprobs-micro  the same stage as the runtime runs it in row micro-batches (`rpegjax.learners.inference`):
            `--inference-rows` rows (all devices) per micro-batch, or as many as `--inference-memory-gib` allows;
            log-prob rows also give the memory budget's estimate of their temporaries (`rpegjax.models.memory`);
* grad      the gradient of the summed token log-probs of one row on one device, no optimiser (with
            `--today`: 15.7 GiB at 4k and 183 GiB at 16k for 2 layers of 7B in float32).

`--rows-per-device` rows per data shard (default 1); `--longest` real tokens per row (default all: no padding)
with `--bucket` (the learner's length_bucket) runs update and log-prob stages trimmed as the runtime does
(`rpegjax.learners.lengths`); the table gives the length each program ran at.

Beside each row, the planner's predicted peak for the same layout (`rpegjax.graph.stage_costs`:
persistent weights + optimiser state per device, plus the stage's transient bytes) with flash attention
and the row's own `--remat`. The model runs with `--attention`, `--remat`, layers in one `lax.scan` (unless
`--unrolled`) and float32 master parameters with `--dtype` compute (defaults: blockwise, full, bfloat16);
`--today` is the configuration before long-sequence support (dense attention, no remat, unrolled layers, float32).
XLA's CPU backend computes bfloat16 matmuls in float32 (converted copies), so bfloat16 figures here
overstate a GPU's temporaries.

    python benchmarks/bench_memory.py --models 7b --tokens 4096,16384 --layouts fsdp8 [--layers 2] [--lora-rank 8]

`--packing`: the learner packs sequences (`rpegjax.learners.packing`, `max_tokens_per_micro_batch` = `--tokens`):
the batch holds `--sequence-tokens` sequences (default a quarter of `--tokens`), as many per device as fill one
packed row of `--tokens`, and the update and the log-prob stage run the runtime's packed programs (the learner's
update, `TrainingPrograms.lower_inference` for the reference stage, which unpacks its outputs), beside the
planner's prediction for packed rows of that budget (`rpegjax.perf.model.packed_batches`).

`--lora-rank r`: the model carries LoRA adapters of rank r on every projection and only they train (the
planner's figure, for full fine-tuning, is then not shown); `--lora-dropout p` adds LoRA dropout to the update's
forward (the log-prob stages never drop). `--correction KIND`: the update runs decoupled PPO with that train/rollout
correction (`rpegjax.learners.corrections`; the batch then carries old log-probs; TIS kinds cap at 2); unset: on-policy.
"""

from __future__ import annotations

import argparse
import os
import sys

# `--devices` before JAX starts: the virtual CPU devices (or compile-only GPUs with `--target`) the layouts cover
DEVICES = argparse.ArgumentParser(add_help=False)
DEVICES.add_argument("--devices", type=int, default=8)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           f"{DEVICES.parse_known_args(sys.argv[1:])[0].devices}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rpegjax.graph.ir import StageKind  # noqa: E402
from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig  # noqa: E402
from rpegjax.learners.batch import TrainBatch  # noqa: E402
from rpegjax.learners.inference import map_micro_batches  # noqa: E402
from rpegjax.learners.scoring import sequence_logprobs  # noqa: E402
from rpegjax.learners.update import TrainState, row_shards  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402
from rpegjax.models.lora import LoRAConfig  # noqa: E402
from rpegjax.models.memory import forward_bytes_per_row, forward_fixed_bytes  # noqa: E402
from rpegjax.options import RematPolicy  # noqa: E402
from rpegjax.perf.model import costs  # noqa: E402
from rpegjax.perf.model.generation_cost import ResponseLengths  # noqa: E402
from rpegjax.perf.model.stage_costs import (  # noqa: E402
    CostInputs,
    ExecutionOptions,
    Layout,
    Workload,
    model_pass_cost,
)
from rpegjax.perf.reference import presets
from rpegjax.runtime.training_programs import TrainingPrograms  # noqa: E402
from rpegjax.sharding import ShardingRules, make_mesh  # noqa: E402
from rpegjax.train.compile_target import DryRunTarget, compile_devices, describe  # noqa: E402
from rpegjax.train.compiled_flops import compiled_flops  # noqa: E402

GIB = 1 << 30
# name: (mesh axis sizes, sequence parallelism)
LAYOUTS = {"fsdp8": ({"fsdp": 8}, False), "fsdp4xtp2": ({"fsdp": 4, "tensor": 2}, False),
           "fsdp4xtp2sp": ({"fsdp": 4, "tensor": 2}, True), "cp8": ({"context": 8}, False),
           "fsdp2xcp4": ({"fsdp": 2, "context": 4}, False), "cp4xtp2sp": ({"context": 4, "tensor": 2}, True),
           # 16 and 32 devices (--devices)
           "fsdp8xtp2": ({"fsdp": 8, "tensor": 2}, False), "fsdp8xtp2sp": ({"fsdp": 8, "tensor": 2}, True),
           "fsdp16xtp2": ({"fsdp": 16, "tensor": 2}, False), "fsdp16xtp2sp": ({"fsdp": 16, "tensor": 2}, True),
           "fsdp8xcp2xtp2sp": ({"fsdp": 8, "context": 2, "tensor": 2}, True),
           "fsdp16xcp2": ({"fsdp": 16, "context": 2}, False), "fsdp32": ({"fsdp": 32}, False)}


def model_config(size: str, args: argparse.Namespace) -> ModelConfig:
    cfg = ModelConfig.qwen2p5(size)
    changes = dict(param_dtype="float32", dtype=args.dtype, attention=args.attention,
                   attention_block_size=args.block, remat=args.remat, scan_layers=not args.unrolled)
    if args.today:
        changes.update(dtype="float32", attention="dense", remat="none", scan_layers=False)
    if args.layers:
        changes["num_layers"] = args.layers
    return cfg.replace(**changes)


def abstract_state(learner: GRPOLearner) -> TrainState:
    """The learner's TrainState as ShapeDtypeStructs with its shardings (optimiser moments follow the params' dtype)."""
    shapes = jax.eval_shape(learner.optimizer.init, learner.params)
    with_sharding = lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)  # noqa: E731
    opt_state = jax.tree.map(with_sharding, shapes, learner.state_shardings.opt_state)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=learner.state_shardings.step)
    return TrainState(params=learner.params, opt_state=opt_state, step=step)


def batch_of(rows: int, tokens: int, prompt: int, longest: int, *, old_logprobs: bool = False) -> TrainBatch:
    """Rows of `tokens` columns: a prompt, then response tokens up to `longest`, padding after (host arrays);
    `old_logprobs`: with the old-log-prob pass's output (decoupled PPO)."""
    columns = np.arange(tokens)
    real = np.broadcast_to(columns < longest, (rows, tokens)).copy()
    response = real & (columns >= prompt)
    zeros = np.zeros((rows, tokens), np.float32)
    return TrainBatch(tokens=np.ones((rows, tokens), np.int32), token_mask=real,
                      response_mask=response, behaviour_logprobs=zeros, ref_logprobs=zeros,
                      old_logprobs=zeros if old_logprobs else None,
                      advantages=np.linspace(-1, 1, rows, dtype=np.float32))


def analysis(compiled) -> dict[str, float]:
    """Bytes and matmul FLOPs per device, every loop iteration counted (`rpegjax.train.compiled_flops`; XLA's own
    cost analysis counts a loop body once, whatever its trip count)."""
    memory, counted = compiled.memory_analysis(), compiled_flops(compiled)
    return {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes,
            "flops": counted.flops if counted is not None else float("nan")}


def predicted_peak(cfg: ModelConfig, parallel: dict[str, int], sequence_parallel: bool, tokens: int, prompt: int, *,
                   backward: bool, packed_sequence: int | None = None) -> float:
    """The planner's per-device peak: persistent state (weights, + optimiser moments for the update) + transient bytes,
    costed with the row's own remat (`cfg.remat`); `packed_sequence`: sequences of this many tokens packed into rows
    of `tokens` (one per data shard)."""
    shape = costs.ModelShape.from_config(cfg)
    layout = Layout.from_parallel(parallel, where="bench_memory", sequence_parallel=sequence_parallel)
    options = ExecutionOptions(attention=costs.AttentionKernel.FLASH, remat=RematPolicy(cfg.remat), microbatch_tokens=tokens,
                               optimizer_bytes_per_param=8.0, grad_bytes_per_param=4.0,
                               packed_row_tokens=tokens if packed_sequence else None)
    per_row = tokens // packed_sequence if packed_sequence else 1
    workload = Workload(prompts=layout.replicas * per_row, group_size=1, prompt_tokens=prompt,
                        responses=ResponseLengths.fixed((packed_sequence or tokens) - prompt))
    inputs = CostInputs(hardware=presets.h100_node(8), actor=shape, critic=shape, workload=workload, options=options)
    cost = model_pass_cost(inputs, shape, layout, logits=True, backward=backward, optimizer_steps=1 if backward else 0)
    state_bytes = shape.param_bytes_each + (options.optimizer_bytes_per_param if backward else 0.0)
    return shape.params * state_bytes / layout.shards + cost.transient_bytes


def measure(size: str, layout_name: str, tokens: int, programs: list[str], args) -> list[dict]:
    cfg = model_config(size, args)
    parallel, sequence_parallel = LAYOUTS[layout_name]
    mesh = make_mesh(parallel, compile_devices(DryRunTarget(args.target), args.devices))
    rows = mesh.devices.size // parallel.get("tensor", 1) // parallel.get("context", 1) * args.rows_per_device
    # packed: sequences of `sequence` tokens, enough to fill one packed row of `tokens` per data shard
    sequence = (args.sequence_tokens or tokens // 4) if args.packing else tokens
    sequences = rows * (tokens // sequence)
    lora = LoRAConfig(rank=args.lora_rank, dropout=args.lora_dropout) if args.lora_rank else None
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), lora=lora))
    correction = {} if not args.correction else dict(
        decoupled=True, correction=args.correction,
        importance_cap=2.0 if args.correction in ("token-tis", "sequence-tis") else None)
    # one row (context parallelism over every device): a group of one, whose baseline REINFORCE++ takes from the batch
    advantage = "reinforce++" if sequences == 1 else "grpo"
    packing = dict(packing=True, max_tokens_per_micro_batch=tokens) if args.packing else {}
    grpo = GRPOConfig(group_size=sequences, advantage=advantage, **packing, clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3", **correction,
                      logprob_chunk_size=args.logprob_chunk, length_bucket=args.bucket or None,
                      inference_rows=args.inference_rows or None, inference_memory_gib=args.inference_memory_gib or None,
                      optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0))
    learner = GRPOLearner(grpo, model, mesh=mesh, rules=ShardingRules.fsdp_tp(sequence_parallel=sequence_parallel))
    batch = batch_of(sequences, sequence, args.prompt, args.longest or sequence, old_logprobs=bool(args.correction))
    length = learner.trimmed_length(batch.token_mask)
    out = []
    for program in programs:
        started = time.perf_counter()
        if program == "grad":
            graphdef, state = nnx.split(model)
            tokens_in = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
            mask_in = jax.ShapeDtypeStruct((1, tokens), jnp.bool_)
            summed = lambda state, t, m: jnp.sum(sequence_logprobs(nnx.merge(graphdef, state), t, m))  # noqa: E731
            lowered = jax.jit(jax.grad(summed)).lower(state, tokens_in, mask_in)
        elif program == "update" and args.target != "cpu":  # compile-only devices take abstract rows, placed as a run places them
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
            lowered = TrainingPrograms(learner).lower_update((StageKind.ACTOR_UPDATE,), abstract_state(learner), abstract)
        elif program == "update":
            lowered = learner.lower_update(abstract_state(learner), batch)
        elif args.packing:  # the runtime's packed reference stage: packed rows in, unpacked log-probs out
            lowered = TrainingPrograms(learner).lower_inference((StageKind.REF_LOGPROB,), abstract_state(learner), batch)
        else:
            placement = learner.placement
            micro_batches = 1
            if program == "logprobs-micro":
                micro_batches = learner.inference_micro_batches(rows, length, shards=row_shards(placement.rows),
                                                                tensor=parallel.get("tensor", 1))

            def stage(params, tokens, mask, micro_batches=micro_batches):
                return map_micro_batches(lambda t, m: learner.logprobs_fn(params, t, m), micro_batches, tokens, mask,
                                         sharding=placement.rows)

            jitted = jax.jit(stage, in_shardings=(placement.param_shardings, placement.rows, placement.rows),
                             out_shardings=placement.rows)
            lowered = jitted.lower(learner.model_params(learner.params), jnp.asarray(batch.tokens[:, :length]),
                                   jnp.asarray(batch.token_mask[:, :length]))
        compiled = lowered.compile()
        seconds = time.perf_counter() - started
        ran = f"{length}" if program != "grad" else f"{tokens}"
        if args.packing and program != "grad":
            ran = f"{rows} packed rows of {tokens} ({tokens // sequence} x {sequence}-token sequences each)"
        elif program == "logprobs-micro":
            ran += f", {micro_batches} x {rows // micro_batches} rows"
        elif program != "grad":
            ran += f", {rows} rows"
        if program.startswith("logprobs") and not args.packing:  # the budget's estimate (rpegjax.models.memory) of the temporaries
            per_device = rows // micro_batches // row_shards(learner.placement.rows)
            tensor = parallel.get("tensor", 1)
            estimate = (forward_fixed_bytes(cfg, tensor=tensor)
                        + per_device * forward_bytes_per_row(cfg, length, logprob_chunk=args.logprob_chunk))
            ran += f"; estimate {estimate / GIB:.2f}"
        name = size + (f" +LoRA r{args.lora_rank}" if args.lora_rank else "") + (
            f" dropout {args.lora_dropout:g}" if args.lora_rank and args.lora_dropout else "")
        row = dict(model=name, layers=cfg.num_layers, layout="1 device" if program == "grad" else layout_name, tokens=tokens,
                   ran=ran, program=program, compile_s=seconds, **analysis(compiled))
        # the planner's figure is for one full-length row per data shard, the whole model
        if (not args.lora_rank and cfg.num_layers == ModelConfig.qwen2p5(size).num_layers and program != "grad" and args.rows_per_device == 1
                and length == sequence):
            row["predicted"] = predicted_peak(cfg, parallel, sequence_parallel, tokens, args.prompt,
                                              backward=program == "update",
                                              packed_sequence=sequence if args.packing else None)
        out.append(row)
        print_row(row, flush=True)
    return out


def print_header(args) -> None:
    kind = ("today: dense attention, no remat, float32" if args.today else
            f"attention {args.attention} (block {args.block}), remat {args.remat}, "
            f"{'unrolled' if args.unrolled else 'scanned'} layers, float32 master / {args.dtype} compute")
    devices = describe(compile_devices(DryRunTarget(args.target), args.devices))
    print(f"W-long memory per device (GiB), {devices}, jax {jax.__version__}; {kind}; "
          f"log-prob chunk {args.logprob_chunk}; update: {args.correction or 'on-policy'}")
    print("| model | layers | layout | tokens/row | program | ran at (length, rows) | arguments | outputs | temporaries "
          "| args+temps | planner peak | compile s | matmul TFLOP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(row: dict, flush: bool = False) -> None:
    predicted = f"{row['predicted'] / GIB:.2f}" if "predicted" in row else "n/a"
    print(f"| {row['model']} | {row['layers']} | {row['layout']} | {row['tokens']} | {row['program']} | {row['ran']} "
          f"| {row['arguments'] / GIB:.2f} | {row['outputs'] / GIB:.2f} | {row['temporaries'] / GIB:.2f} "
          f"| {(row['arguments'] + row['temporaries']) / GIB:.2f} | {predicted} | {row['compile_s']:.1f} "
          f"| {row['flops'] / 1e12:.2f} |", flush=flush)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.5b,7b,32b", help="Qwen2.5 sizes, comma-separated")
    parser.add_argument("--tokens", default="4096,16384,32768", help="tokens per row, comma-separated")
    parser.add_argument("--layouts", default="fsdp8,fsdp4xtp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    parser.add_argument("--programs", default="update,logprobs")
    parser.add_argument("--layers", type=int, default=0, help="override the depth (0: the model's own)")
    parser.add_argument("--attention", default="blockwise")
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--unrolled", action="store_true", help="a Python loop over layers instead of one lax.scan")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (parameters are float32 master copies)")
    parser.add_argument("--today", action="store_true", help="dense attention, no remat, float32 compute")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens of each row")
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--rows-per-device", type=int, default=1, help="rows per data shard")
    parser.add_argument("--inference-rows", type=int, default=0, help="logprobs-micro: rows per micro-batch (0: unset)")
    parser.add_argument("--inference-memory-gib", type=float, default=0.0,
                        help="logprobs-micro: per-device activation budget (0: unset)")
    parser.add_argument("--longest", type=int, default=0, help="real tokens of each row (0: all of --tokens)")
    parser.add_argument("--bucket", type=int, default=0, help="length bucket: rows trimmed to --longest rounded up (0: off)")
    parser.add_argument("--devices", type=int, default=8, help="devices the layouts cover (8, 16 or 32)")
    parser.add_argument("--target", default="cpu", choices=list(DryRunTarget),
                        help="compile for virtual CPU devices, or XLA's GPU compiler for compile-only GPUs "
                             "(PYTHONPATH with JAX's CUDA plugin; bfloat16 held as a GPU holds it)")
    parser.add_argument("--packing", action="store_true", help="pack sequences into rows of --tokens (the learner's "
                        "packing, max_tokens_per_micro_batch); programs update, logprobs")
    parser.add_argument("--sequence-tokens", type=int, default=0,
                        help="--packing: tokens of each packed sequence (0: a quarter of --tokens)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every projection, only "
                        "they trained (0: full fine-tuning)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout in the update's forward")
    parser.add_argument("--correction", default="", help="decoupled PPO with this train/rollout correction (token-tis, "
                        "sequence-tis, icepop, geometric-mask, none); unset: on-policy GRPO")
    args = parser.parse_args()
    if args.lora_dropout and not args.lora_rank:
        parser.error("--lora-dropout needs --lora-rank")
    programs = args.programs.split(",")
    if args.packing and (set(programs) - {"update", "logprobs"} or args.inference_rows or args.inference_memory_gib
                         or args.bucket or args.rows_per_device != 1 or args.longest):
        parser.error("--packing runs the programs update and logprobs on full packed rows: it chooses the micro-batches "
                     "and rows itself (no --inference-rows, --inference-memory-gib, --bucket, --rows-per-device, --longest)")
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {name!r}; known: {sorted(LAYOUTS)}")
    for program in programs:
        if program not in ("update", "logprobs", "logprobs-micro", "grad"):
            parser.error(f"--programs: unknown program {program!r}; known: update, logprobs, logprobs-micro, grad")
    print_header(args)
    for size in args.models.split(","):
        for layout in args.layouts.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                measure(size, layout, tokens, programs, args)


if __name__ == "__main__":
    main()
