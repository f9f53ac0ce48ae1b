"""Plan an RL step on a cluster: the planner's best RPEG against two fixed reference plans, by the same model.

    python scripts/plan.py --model qwen2.5-7b --hardware gh200 --gpus 256 --algo ppo [--json] [--gantt out.png]
    python scripts/plan.py --hardware h100 --hardware-profile h100.json ...   (measured device figures)

Prints predicted step time, per-stage times, generated tokens/s, model FLOPs utilisation and peak memory per
GPU for the best plan, the verl-like plan (synchronous, colocated, separate models) and the ReaL-like plan
(synchronous, per-stage re-sharded). The workload defaults to W-plan (shared/WORKLOADS.md). `--model` takes a
preset name or a Hugging Face config.json (or its directory). `--json` prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from rpegjax.graph.ir import Algorithm
from rpegjax.graph.trace import gantt_png
from rpegjax.models import ModelConfig
from rpegjax.options import AttentionKind, DecodeAttention, DType, RematPolicy
from rpegjax.perf import planner
from rpegjax.perf.model import hardware, step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import ExecutionOptions, Workload
from rpegjax.perf.planner import executable, explain
from rpegjax.perf.reference import presets, published_runs
from rpegjax.perf.reference import profile as hardware_profile
from rpegjax.train.compile_target import DryRunTarget, compile_devices, cuda_plugin_installed, prepare_host
from rpegjax.train.plan_document import model_shape

MODEL_PRESETS = {
    **{f"qwen2.5-{size}": (ModelConfig.qwen2p5, size) for size in ("0.5b", "1.5b", "7b", "32b", "72b")},
    **{f"llama3-{size}": (ModelConfig.llama3, size) for size in ("8b", "70b")},  # Llama 3.1's shapes (as below)
    **{f"llama3.1-{size}": (ModelConfig.llama3, size) for size in ("8b", "70b")},
    "qwen3-32b": (ModelConfig.qwen3, "32b"),
    **{f"qwen3-{size}": (ModelConfig.qwen3_moe, size) for size in ("30b-a3b", "235b-a22b")},  # mixture of experts
}


def load_model(name: str) -> ModelConfig:
    """A preset (`qwen2.5-7b`, `llama3-8b`, ...) or a Hugging Face config.json / model directory."""
    if name in MODEL_PRESETS:
        factory, size = MODEL_PRESETS[name]
        return factory(size)
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise SystemExit(f"--model {name!r}: neither a preset ({', '.join(sorted(MODEL_PRESETS))}) nor a config.json file")
    with open(path) as file:
        try:
            hf = json.load(file)
        except json.JSONDecodeError as error:
            raise SystemExit(f"--model {path}: not valid JSON ({error})") from None
    try:
        return ModelConfig.from_hf_dict(hf, source=path)
    except ValueError as error:
        raise SystemExit(f"--model {path}: {error}") from None


def _capacity_factor(text: str) -> float | None:
    """A `--moe-capacity-factor` value: 'dropless' (None) or a positive number."""
    if text == "dropless":
        return None
    try:
        if float(text) > 0:
            return float(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"a capacity factor is a positive number or 'dropless', got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=explain.LEGEND,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", metavar="NAME_OR_CONFIG",
                        help=f"model: a preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json or its "
                             f"directory")
    parser.add_argument("--hardware", default="gh200", choices=[*sorted(presets.PRESETS), "cpu"],
                        help="GPU and cluster preset (peak FLOP/s, HBM, NVLink and network; see "
                             "rpegjax/perf/reference/presets.py); cpu: this machine as --hardware-profile measured it "
                             "(no datasheet)")
    parser.add_argument("--hardware-profile", metavar="FILE",
                        help="a hardware profile (python -m rpegjax.perf.reference.calibration --out FILE, run on the "
                             "device): its measured matmul, attention and memory rates, backward efficiency and "
                             "overheads replace the preset's assumptions (datasheet peaks kept); its all-reduce times the node level when it "
                             "measured more than one device. Refused when measured on another device than the preset's")
    parser.add_argument("--moe-capacity-factor", type=_capacity_factor, nargs="+", default=None, metavar="C",
                        help="a mixture-of-experts model's expert modes to search (the plan's execution."
                             "moe_capacity_factor): capacity factors C, or 'dropless'; the fastest that fits and is "
                             "trusted wins (the tokens a factor drops are not costed: list only those the run accepts). "
                             "Without it, as the model says (the presets: dropless, which XLA's GPU compiler runs as a "
                             "dense GEMM over every local expert: rpegjax/perf/model/expert_costs.py)")
    parser.add_argument("--gpus", type=int, default=256, help="GPUs to plan for")
    parser.add_argument("--algo", default="grpo", choices=["grpo", "ppo"], help="RL algorithm (PPO adds a critic)")
    parser.add_argument("--prompts", type=int, default=512, help="prompts per RL step")
    parser.add_argument("--group-size", type=int, default=8, help="responses sampled per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--response-mean", type=float, default=4096,
                        help="mean response length in tokens (log-normal, sigma 1, clipped at --response-max)")
    parser.add_argument("--response-max", type=int, default=16384, help="maximum response length in tokens")
    parser.add_argument("--reference", action="store_true",
                        help="plan a reference model (a KL term: the job's grpo.kl_coef / ppo.kl_coef > 0); without it, "
                             "no reference, as the job runs by default")
    parser.add_argument("--optimizer-steps", type=int, default=1,
                        help="optimiser steps per RL step (the batch in this many mini-batches; the run's num_minibatches)")
    parser.add_argument("--async-bounds", default="0,1,2",
                        help="asynchrony bounds to search, comma-separated (0 on-policy, 1 one step off, ...)")
    parser.add_argument("--attention", default="cudnn,blockwise,dense",
                        help=f"attention kernels to search, comma-separated, of {', '.join(AttentionKind)} (those "
                             f"the runtime cannot run on --hardware are skipped; asking only for those is refused)")
    parser.add_argument("--decode-attention", default="pallas,gather",
                        help=f"the paged sampler's decode attention to search, comma-separated, of "
                             f"{', '.join(DecodeAttention)} (pallas: the Pallas paged kernel, each row over its own "
                             f"pages, GPUs only: skipped on other hardware)")
    parser.add_argument("--remat", default="full,dots,none",
                        help=f"remat policies to search, comma-separated, of {', '.join(RematPolicy)}")
    parser.add_argument("--context-sizes", default="1",
                        help="training context-parallel sizes to search, comma-separated (one row's sequence split over "
                             "that many devices; 1: none). Plans with a context axis are refused as untrusted: their "
                             "memory was checked against XLA:CPU only (rpegjax/perf/planner/trust.py)")
    parser.add_argument("--sequence-parallel", default="false", choices=["false", "true", "both"],
                        help="search sequence parallelism within tensor (the residual stream split over tensor); such "
                             "plans are refused as untrusted, as with --context-sizes")
    parser.add_argument("--packing", default="both", choices=["false", "true", "both"],
                        help="search sequence packing (rows of a token budget the planner fits, the job's "
                             "grpo.packing / max_tokens_per_micro_batch) against rows padded to the longest")
    parser.add_argument("--partial-rollouts", default="both", choices=["false", "true", "both"],
                        help="search partial rollouts (generation runs on over two or three batches of groups in flight, "
                             "carrying unfinished sequences into the next step: the job's --rollout.partial; colocated "
                             "plans only) against plans without; a partial plan's tokens lag up to k + 2 weights versions "
                             "(the job's default --rollout.max_token_lag), k being the plan's asynchrony bound")
    parser.add_argument("--inflight-batches", default="2,3",
                        help="batches of groups in flight to search with partial rollouts, comma-separated (the job's "
                             "--rollout.inflight_batches)")
    parser.add_argument("--min-slot-busy", type=float, default=0.0, metavar="SHARE",
                        help="search only plans whose generation slots are at least this share busy on average "
                             "(running sequences / slots over the generate stage, as predicted: the table's "
                             "'generation slots busy'); 0: no constraint. The reference plans are not constrained")
    parser.add_argument("--param-dtype", default="float32", choices=list(DType),
                        help="weights and optimiser moments (the run's model.param_dtype)")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DType), help="matmul compute (the run's model.dtype)")
    parser.add_argument("--top", type=int, default=3, help="alternatives to list after the best plan")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the table (null times and a reason for plans that "
                             "do not fit)")
    parser.add_argument("--explain", action="store_true",
                        help="say why the best plan wins: what bounds its step, what overlaps, how the reference "
                             "plans differ")
    parser.add_argument("--verify", action="store_true",
                        help="dry run of the best plan: compile every stage program ahead of time on the plan's meshes "
                             "(virtual CPU devices when --gpus exceeds the devices here), print per-device memory "
                             "against the usable memory, compiled FLOPs and the predicted step; exit 3 when it does "
                             "not fit. Slow: compiling real models on many virtual devices takes minutes")
    parser.add_argument("--verify-target", default="auto", choices=["auto", *DryRunTarget],
                        help="what --verify compiles for: cuda-h100 / cuda-gh200 compile with XLA's GPU compiler for "
                             "compile-only devices of that GPU (needs JAX's CUDA plugin, pip install 'rpegjax[gpu-aot]'; "
                             "no GPU needed); cpu: this machine's devices (virtual CPU devices, whose bfloat16 programs "
                             "hold float32 copies: up to 2x a GPU's memory); auto: the --hardware GPU when the plugin "
                             "is installed, else cpu")
    parser.add_argument("--gantt", metavar="PNG", help="write a Gantt chart of the predicted schedules to this PNG")
    parser.add_argument("--fitted-efficiencies", action="store_true",
                        help="use the efficiencies fitted to NeMo RL's published H100 step times (matmul "
                             f"{published_runs.FITTED_EFFICIENCIES.matmul} of peak, decode "
                             f"{published_runs.FITTED_EFFICIENCIES.decode_memory} of HBM bandwidth; see "
                             "rpegjax/perf/reference/published_runs.py) instead of the presets' assumptions (0.7 and "
                             "0.8)")
    args = parser.parse_args(argv)
    args.verify_target = verify_target(args.verify_target, args.hardware)
    if args.hardware == "cpu" and not args.hardware_profile:
        parser.error("--hardware cpu needs --hardware-profile: a CPU has no datasheet preset")
    if args.hardware_profile and args.fitted_efficiencies:
        parser.error("--hardware-profile and --fitted-efficiencies both set the efficiencies; give one")
    for name in ("gpus", "prompts", "group_size", "prompt_tokens", "response_max", "optimizer_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.top < 0:
        parser.error(f"--top must be >= 0, got {args.top}")
    try:
        args.async_bounds = tuple(int(v) for v in args.async_bounds.split(",") if v.strip())
    except ValueError:
        parser.error(f"--async-bounds: comma-separated integers, got {args.async_bounds!r}")
    if not args.async_bounds or min(args.async_bounds) < 0:
        parser.error(f"--async-bounds: at least one bound, each >= 0, got {args.async_bounds}")
    try:
        args.context_sizes = tuple(int(v) for v in args.context_sizes.split(",") if v.strip())
    except ValueError:
        parser.error(f"--context-sizes: comma-separated integers, got {args.context_sizes!r}")
    if not args.context_sizes or min(args.context_sizes) < 1:
        parser.error(f"--context-sizes: at least one size, each >= 1, got {args.context_sizes}")
    try:
        args.inflight_batches = tuple(int(v) for v in args.inflight_batches.split(",") if v.strip())
    except ValueError:
        parser.error(f"--inflight-batches: comma-separated integers, got {args.inflight_batches!r}")
    if not args.inflight_batches or min(args.inflight_batches) < 2:
        parser.error(f"--inflight-batches: at least one count, each >= 2, got {args.inflight_batches}")
    if not 0 <= args.min_slot_busy <= 1:
        parser.error(f"--min-slot-busy: a share in [0, 1], got {args.min_slot_busy}")
    if not 1 <= args.response_mean < args.response_max:
        parser.error(f"--response-mean must be in [1, --response-max), got {args.response_mean}")
    for name, kind in (("attention", AttentionKind), ("remat", RematPolicy), ("decode_attention", DecodeAttention)):
        values = tuple(v.strip() for v in getattr(args, name).split(",") if v.strip())
        unknown = [v for v in values if v not in {member.value for member in kind}]
        if not values or unknown:
            parser.error(f"--{name.replace('_', '-')}: {unknown or 'nothing'} given; choose from {', '.join(kind)}")
        setattr(args, name, tuple(kind(v) for v in values))
    return args


def verify_target(name: str, hardware_name: str) -> DryRunTarget:
    """`--verify-target`: auto is the --hardware GPU's CUDA target when JAX's CUDA plugin is installed (and the
    preset's GPU has one), else the CPU."""
    if name != "auto":
        return DryRunTarget(name)
    gpu = {"h100": DryRunTarget.CUDA_H100, "gh200": DryRunTarget.CUDA_GH200}.get(hardware_name)
    return gpu if gpu is not None and cuda_plugin_installed() else DryRunTarget.CPU


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help; the legend in the epilog keeps its line breaks."""


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


def table(rows: list[tuple[str, step_model.Prediction]]) -> str:
    """Metrics and per-stage seconds (rows) for each named plan (columns)."""
    names = [name for name, _ in rows]
    stage_names: list[str] = []
    for _, prediction in rows:
        stage_names += [s.name for s in prediction.stages if s.name not in stage_names]
    lines = [("", *names)]
    lines.append(("step time (s)", *(f"{p.step_seconds:.2f}" if p.fits else "does not fit" for _, p in rows)))
    lines.append(("tokens/s (generated)", *(f"{p.tokens_per_second:,.0f}" if p.fits else "-" for _, p in rows)))
    lines.append(("MFU", *(f"{100 * p.mfu:.1f}%" if p.fits else "-" for _, p in rows)))
    lines.append(("generation slots busy", *(_generation_detail(p, "slot_busy", "{:.0%}") for _, p in rows)))
    lines.append(("decode work on live rows / KV", *(_live_shares(p) for _, p in rows)))
    lines.append(("carried sequences", *(_generation_detail(p, "carried_sequences", "{:,.0f}") for _, p in rows)))
    lines.append(("token lag mean/max", *(_lag(p) for _, p in rows)))
    lines.append(("peak memory/GPU (GB)", *(_gb(p.needed_memory_bytes) for _, p in rows)))
    lines.append(("usable memory/GPU (GB)", *(_gb(p.memory_limit_bytes) for _, p in rows)))
    for stage in stage_names:
        values = []
        for _, p in rows:
            found = [s.seconds for s in p.stages if s.name == stage]
            values.append("-" if not found else f"{found[0]:.2f}" if math.isfinite(found[0]) else "does not fit")
        lines.append((f"  {stage} (s)", *values))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                     for line in lines)


def _generation_detail(prediction: step_model.Prediction, name: str, form: str) -> str:
    """A figure of the generate stage's detail (`-`: a plan without it, or that does not fit)."""
    stage = next((s for s in prediction.stages if s.kind == "generate"), None)
    value = None if stage is None or not prediction.fits else stage.detail.get(name)
    return "-" if value is None else form.format(value)


def _live_shares(prediction: step_model.Prediction) -> str:
    """The decode rows and cached keys read that are the running sequences' (`live_row_share`, `live_key_share`)."""
    rows, keys = (_generation_detail(prediction, name, "{:.0%}") for name in ("live_row_share", "live_key_share"))
    return "-" if "-" in (rows, keys) else f"{rows} / {keys}"


def _lag(prediction: step_model.Prediction) -> str:
    """Weights versions a trained token lags the trainer: k without partial rollouts, else the modelled ones."""
    if not prediction.fits:
        return "-"
    k = prediction.graph.async_bound
    if not prediction.graph.execution.partial_rollouts:
        return f"{k}/{k}"
    detail = next(s for s in prediction.stages if s.kind == "generate").detail
    return f"{k + detail['carry_lag_mean']:.2f}/{k + detail['carry_lag_max']:.0f}"


def _plan_json(name: str, plan: planner.Plan, search: planner.Planner) -> dict[str, Any]:
    return {"name": name, "description": plan.choice.describe(), "fits": plan.prediction.fits,
            "reason": plan.prediction.fit_reason, "untrusted": search.untrusted(plan) if plan.prediction.fits else None,
            "prediction": plan.prediction.to_dict(), "graph": plan.graph.to_dict()}


def verify(args: argparse.Namespace, model: ModelConfig, best: planner.Plan, hw: hardware.HardwareSpec):
    """The dry run of `best` (`rpegjax.train.dry_run`): the step batch padded to the longest response, the
    sampler with the slots the prediction gives generation."""
    from rpegjax.learners import GRPOConfig
    from rpegjax.train import dry_run
    from rpegjax.train.config import default_grpo, default_ppo

    choice, prediction, execution = best.choice, best.prediction, best.graph.execution
    kl = 0.04 if choice.use_reference else 0.0
    # the job's own defaults (decoupled PPO for the asynchrony bound...) with the plan's choices: what it would run
    if choice.algorithm is Algorithm.PPO:
        algorithm = dataclasses.replace(default_ppo(), critic=choice.critic_mode.value, kl_coef=kl,
                                        num_minibatches=choice.optimizer_steps)
    else:
        algorithm = GRPOConfig(**{field.name: getattr(default_grpo(), field.name) for field in dataclasses.fields(GRPOConfig)})
        algorithm = dataclasses.replace(algorithm, group_size=args.group_size, kl_coef=kl,
                                        num_minibatches=choice.optimizer_steps)
    generate = next(s for s in prediction.stages if s.kind == "generate")
    replicas = math.prod(size for axis, size in choice.generation_layout if axis != "tensor")
    batch = dry_run.Batch(rows=args.prompts * args.group_size, prompt=args.prompt_tokens, new=args.response_max,
                          slots=int(generate.detail["slots"]) * replicas, group_size=args.group_size)
    model = model.replace(param_dtype=execution.param_dtype, dtype=execution.dtype,
                          max_position_embeddings=max(model.max_position_embeddings, batch.prompt + batch.new))
    log = lambda line: print(line, file=sys.stderr, flush=True)
    devices = compile_devices(args.verify_target, best.graph.num_devices)
    return dry_run.dry_run(best.graph, model, algorithm, batch, capacity_bytes=hw.usable_memory_bytes,
                           predicted={s.name: s.peak_memory_bytes for s in prediction.stages},
                           predicted_step_seconds=prediction.step_seconds, devices=devices, log=log)


def load_hardware(args: argparse.Namespace) -> hardware.HardwareSpec:
    """The preset, with the measured figures of `--hardware-profile` when given (`rpegjax.perf.reference.profile`)."""
    if not args.hardware_profile:
        return presets.preset(args.hardware, args.gpus)
    try:
        measured = hardware_profile.load_profile(args.hardware_profile)
        if args.hardware == "cpu":
            if measured.platform != "cpu":
                raise hardware_profile.ProfileError(f"the hardware profile was measured on {measured.device_kind!r} "
                                                    f"({measured.platform}), not on a CPU")
            return hardware_profile.spec_from_profile(measured, dtype=args.dtype, num_devices=args.gpus, name="cpu")
        hardware_profile.fits_preset(measured, args.hardware)
        return hardware_profile.with_profile(presets.preset(args.hardware, args.gpus), measured, dtype=args.dtype)
    except hardware_profile.ProfileError as error:
        raise SystemExit(f"plan.py: --hardware-profile {args.hardware_profile}: {error}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify:
        prepare_host(args.verify_target)  # a CUDA target: this process itself on the CPU
    if args.verify and args.verify_target is DryRunTarget.CPU:
        from rpegjax.train.dry_run import ensure_devices

        ensure_devices(args.gpus)  # re-runs this script on virtual CPU devices when there are fewer devices
    model = load_model(args.model)
    capacities = (model.moe_capacity_factor,)  # the model's own expert mode, unless the search is given others
    if args.moe_capacity_factor is not None:
        if not model.num_experts:
            raise SystemExit(f"--moe-capacity-factor: --model {args.model} has no experts")
        capacities = tuple(dict.fromkeys(args.moe_capacity_factor))
    hw = load_hardware(args)
    workload = Workload(prompts=args.prompts, group_size=args.group_size, prompt_tokens=args.prompt_tokens,
                        responses=ResponseLengths.lognormal(args.response_mean, args.response_max))
    options = None
    if args.fitted_efficiencies:
        fitted = published_runs.FITTED_EFFICIENCIES
        hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, matmul_efficiency=fitted.matmul))
        options = ExecutionOptions(decode_memory_efficiency=fitted.decode_memory)
    # every plan is predicted as rpegjax's runtime executes it (its kernels, padding, micro-batching)
    evaluator = step_model.Evaluator.for_runtime(model, workload, hw, options)
    choices = {"false": (False,), "true": (True,), "both": (False, True)}
    space = planner.PlanSpace(attention=args.attention, remat=args.remat, decode_attention=args.decode_attention,
                              param_dtype=args.param_dtype, dtype=args.dtype,
                              async_bounds=args.async_bounds, context_sizes=args.context_sizes,
                              sequence_parallel=choices[args.sequence_parallel], packing=choices[args.packing],
                              partial_rollouts=choices[args.partial_rollouts], inflight_batches=args.inflight_batches,
                              moe_capacity_factors=capacities, min_slot_busy=args.min_slot_busy)
    use_reference = args.reference
    common = {"algorithm": args.algo, "num_devices": args.gpus, "use_reference": use_reference, "space": space,
              "optimizer_steps": args.optimizer_steps}
    try:
        search = planner.Planner(evaluator, **common)
        result = search.search(top=args.top + 1)
        verl = planner.verl_like(evaluator, **common)
        real = planner.real_like(evaluator, **common)
    except ValueError as error:  # nothing fits, or nothing the runtime can run: say why instead of a traceback
        raise SystemExit(f"plan.py: {error}") from None
    plans = [("best", result.best), ("verl-like", verl), ("ReaL-like", real)]
    for name, plan in [*plans, *((f"alternative {i + 1}", p) for i, p in enumerate(result.alternatives))]:
        try:  # never print a prediction for a plan the runtime cannot execute
            executable.require_executable(plan.graph, hw, follows_runtime=evaluator.follow_graph,
                                          sequences=workload.sequences, where=f"the {name} plan")
        except ValueError as error:
            raise SystemExit(f"plan.py: {error}") from None
    if args.gantt:
        traces = []
        for name, plan in plans:
            predicted = evaluator.predict(plan.graph)  # with its trace
            if predicted.trace is not None:
                predicted.trace.name = f"{name}: {plan.prediction.step_seconds:.1f} s/step"
                traces.append(predicted.trace)
        gantt_png(traces, args.gantt, title=f"{args.model} {args.algo} on {args.gpus} x {args.hardware} (predicted)")
    if model.num_experts:  # the expert mode the best plan chose is the run's (its execution's)
        model = model.replace(moe_capacity_factor=result.best.graph.execution.moe_capacity_factor)
    if args.json:
        document = {
            "model": args.model, "model_config": model_shape(model), "hardware": args.hardware, "hardware_profile": args.hardware_profile, "gpus": args.gpus,
            "algorithm": args.algo,
            "workload": {"prompts": workload.prompts, "group_size": workload.group_size,
                         "prompt_tokens": workload.prompt_tokens, "response_mean": args.response_mean,
                         "response_max": args.response_max},
            "plans": [_plan_json(name, plan, search) for name, plan in plans],
            "alternatives": [_plan_json(f"alternative {i + 1}", plan, search) for i, plan in enumerate(result.alternatives)],
            "search": {"evaluated": result.evaluated, "candidates": result.candidates, "seconds": result.seconds},
        }
        if args.explain:
            document["explain"] = explain.explain(result.best, plans[1:])
        report = verify(args, model, result.best, hw) if args.verify else None
        if report is not None:
            document["verify"] = {"fits": report.fits, "reason": report.refusal(), "capacity_bytes": report.capacity_bytes,
                                  "devices": report.devices,
                                  "programs": [{**dataclasses.asdict(p), "peak": p.peak} for p in report.programs]}
        json.dump(document, sys.stdout, allow_nan=False)  # strict JSON: a plan that does not fit has null times
        print()
        return 0 if report is None or report.fits else 3
    print(f"{args.model} ({model.num_params() / 1e9:.1f}B), {args.algo.upper()}, {args.gpus} x {hw.device.name}; "
          f"{workload.prompts} prompts x {workload.group_size}, prompt {workload.prompt_tokens}, responses log-normal "
          f"mean {args.response_mean:.0f} max {args.response_max}")
    print(f"planner: {result.evaluated} of {result.candidates} plans predicted in {result.seconds:.1f} s\n")
    print(table([(name, plan.prediction) for name, plan in plans]))
    print()
    for name, plan in plans:
        print(f"{name}: {plan.choice.describe()}")
        if not plan.prediction.fits:
            print(f"  {plan.prediction.fit_reason}")
        elif search.untrusted(plan) is not None:  # only a reference plan can be: the search ranks them out
            print(f"  {search.untrusted(plan)}")
    for index, plan in enumerate(result.alternatives):
        print(f"alternative {index + 1}: {plan.prediction.step_seconds:.2f} s/step — {plan.choice.describe()}")
    print()
    print(explain.LEGEND)
    if args.explain:
        print()
        print(explain.explain(result.best, plans[1:]))
    if args.gantt:
        print(f"\nGantt chart of the predicted schedules: {args.gantt}")
    if args.verify:
        report = verify(args, model, result.best, hw)
        print()
        print(report.table(), flush=True)
        if not report.fits:
            print(f"plan.py: {report.refusal()}", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
