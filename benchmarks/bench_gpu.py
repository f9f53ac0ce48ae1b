"""The GPU check's measurements (benchmarks/gpu_check.sh), one part per call so that each runs under its own timeout.

    python benchmarks/bench_gpu.py --part calibrate --out DIR      # hardware profile -> DIR/profile.json
    python benchmarks/bench_gpu.py --part update --out DIR [--models 0.5b,1.5b] [--name update-1.5b]
    python benchmarks/bench_gpu.py --part decode --out DIR [--models 0.5b]
    python benchmarks/bench_gpu.py --part validate --out DIR       # predicted vs measured RL steps (needs the profile)
    python benchmarks/bench_gpu.py --table DIR                     # one table of every part's rows
    python benchmarks/bench_gpu.py --small --part all --out DIR    # everything, tiny, on any machine (the test)

Parts, each writing DIR/<part>.json (rows of part, metric, value, unit, note):
* calibrate: `calibration.measure_profile` (float32 and bfloat16 matmul and attention rates, stream bandwidth,
  dispatch and kernel overheads, the all-reduce over the local devices), written as a hardware profile; the rates
  as fractions of the datasheet of the preset whose device this is (`profile.preset_for_device_kind`).
* update: one GRPO update (forward, backward, AdamW) of a Qwen2.5-shaped model, float32 weights and bfloat16
  compute, cuDNN attention on a GPU (dense elsewhere), no rematerialisation; MFU = model FLOPs
  (`costs.model_flops`: 6·N·tokens + causal attention, no recomputation) / seconds / the datasheet bf16 peak.
* decode: the sampler's decode steps of the same shape in bfloat16, `--decode-slots` rows: the seconds of N more
  steps (generating 2N minus generating N tokens, so prefill cancels); fraction of the HBM roofline = bytes one step
  reads and writes (`costs.decode_step_bytes`: weights, the attended keys and values, activations) / step seconds /
  the datasheet HBM bandwidth.
* validate: benchmarks/bench_perfmodel.py's runtime steps (W-small GRPO, unfused and fused k=1) timed, and predicted
  with the profile's own figures (`profile.spec_from_profile`); the relative errors.
Without a preset for the device (a CPU, an unknown GPU) the references are this machine's measured rates instead
(the note says which). `--small`: a 2-layer model and tiny problems, for a check that everything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from rpegjax.models import Decoder, ModelConfig
from rpegjax.perf.model import costs
from rpegjax.perf.reference import calibration, presets
from rpegjax.perf.reference import profile as hardware_profile

PARTS = ("calibrate", "update", "decode", "validate")


def _row(part: str, metric: str, value: float | str, unit: str = "", note: str = "") -> dict:
    return {"part": part, "metric": metric, "value": value, "unit": unit, "note": note}


def references(measured: hardware_profile.HardwareProfile) -> tuple[float, float, str]:
    """(bf16 peak FLOP/s, memory bandwidth, where they come from): the datasheet of the device's preset, or this
    machine's measured bf16 matmul peak and stream bandwidth when no preset is of this device."""
    name = hardware_profile.preset_for_device_kind(measured.device_kind) if measured.platform == "gpu" else None
    if name is not None:
        device = presets.preset(name, 1).device
        return device.flops("bfloat16"), device.memory_bandwidth, f"datasheet {device.name}"
    rates = measured.dtype_rates("bfloat16")
    return max(rates.matmul_flops, rates.layer_matmul_flops), measured.memory_bandwidth, "measured here (no preset)"


def model_config(size: str, small: bool, **dtypes: str) -> ModelConfig:
    on_gpu = jax.default_backend() == "gpu"
    base = ModelConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256) if small else ModelConfig.qwen2p5(size)
    return base.replace(attention="cudnn" if on_gpu else "dense", remat="none", scan_layers=not small,
                        max_position_embeddings=max(base.max_position_embeddings, 4096), **dtypes)


# ------------------------------------------------------------------------------------------------ parts
def part_calibrate(args) -> list[dict]:
    sizes = calibration.Sizes.smoke() if args.small else calibration.Sizes.for_platform(jax.default_backend())
    start = time.perf_counter()
    # one round: a GPU is not shared the way a CPU is, and the part must stay within its minute
    measured = calibration.measure_profile(dtypes=("float32", "bfloat16"), rounds=1,
                                           repeats=2 if args.small else 5, sizes=sizes)
    measured.write(os.path.join(args.out, "profile.json"))
    peak, bandwidth, source = references(measured)
    rows = [_row("calibrate", "device", f"{measured.devices} x {measured.device_kind}", "",
                 f"profile.json in {time.perf_counter() - start:.0f} s")]
    for dtype, rates in measured.rates.items():
        for name, value in (("matmul", rates.matmul_flops), ("layer matmuls", rates.layer_matmul_flops),
                            ("attention (dense)", rates.attention_flops)):
            note = f"{value / peak:.0%} of bf16 peak ({source})" if dtype == "bfloat16" else ""
            rows.append(_row("calibrate", f"{name} {dtype}", value / 1e12, "TFLOP/s", note))
    rows.append(_row("calibrate", "memory bandwidth", measured.memory_bandwidth / 1e9, "GB/s",
                     f"{measured.memory_bandwidth / bandwidth:.0%} of {source}"))
    rows.append(_row("calibrate", "dispatch", measured.dispatch_overhead_s * 1e6, "us"))
    rows.append(_row("calibrate", "kernel overhead", measured.kernel_overhead_s * 1e6, "us"))
    if measured.all_reduce is None:
        rows.append(_row("calibrate", "all-reduce", "not measured", "", "one device: the preset's levels stay"))
    else:
        rows.append(_row("calibrate", f"all-reduce latency ({measured.all_reduce.devices} devices)",
                         measured.all_reduce.latency_s * 1e6, "us/step"))
        rows.append(_row("calibrate", "all-reduce bandwidth", measured.all_reduce.bandwidth / 1e9, "GB/s/device"))
    return rows


def _profile(args) -> hardware_profile.HardwareProfile:
    return hardware_profile.load_profile(os.path.join(args.out, "profile.json"))


def part_update(args) -> list[dict]:
    from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig, pack_rollouts

    peak, _, source = references(_profile(args))
    rows = []
    for size in args.models:
        cfg = model_config(size, args.small, param_dtype="float32", dtype="bfloat16")
        group, prompt, response = 4, args.update_prompt, args.update_response
        sequences = args.update_rows
        learner = GRPOLearner(GRPOConfig(group_size=group, clip_low=0.2, clip_high=0.2, kl_coef=0.0,
                                         optimizer=OptimizerConfig(learning_rate=1e-6)), Decoder(cfg, rngs=nnx.Rngs(0)))
        rng = np.random.default_rng(0)
        prompts = np.repeat(rng.integers(0, cfg.vocab_size, (sequences // group, prompt)), group, axis=0)
        responses = rng.integers(0, cfg.vocab_size, (sequences, response))
        behaviour = rng.normal(-6.0, 0.5, (sequences, response))
        batch = pack_rollouts(prompts.tolist(), responses.tolist(), list(behaviour), pad_id=0,
                              rewards=rng.integers(0, 2, sequences).astype(np.float32))
        batch, _ = learner.compute_advantages(batch)
        holder = {"state": learner.init_state()}

        def update():
            holder["state"], metrics = learner.update(holder["state"], batch)
            return jax.block_until_ready(metrics)

        seconds = _median_seconds(update, args.runs)
        loss = float(update()["loss"])
        if not np.isfinite(loss):
            raise RuntimeError(f"update of {size}: the loss is {loss}")
        shape = costs.ModelShape.from_config(cfg)
        length = prompt + response
        flops = costs.model_flops(shape, tokens=sequences * length,
                                  pairs=sequences * costs.attention_pairs(length, costs.AttentionKernel.FLASH),
                                  backward=True)
        name = "tiny" if args.small else f"qwen2.5-{size}"
        rows.append(_row("update", f"{name} GRPO update", seconds, "s",
                         f"{sequences} x {length} tokens, {cfg.attention} attention, loss {loss:.3g}"))
        rows.append(_row("update", f"{name} MFU", flops / seconds / peak, "", f"of bf16 peak ({source})"))
    return rows


def part_decode(args) -> list[dict]:
    from rpegjax.generate import Sampler
    from rpegjax.generate.sampling import SamplingConfig

    _, bandwidth, source = references(_profile(args))
    rows = []
    for size in args.decode_models:
        cfg = model_config(size, args.small, param_dtype="bfloat16", dtype="bfloat16")
        graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
        slots, prompt, steps = args.decode_slots, args.decode_prompt, args.decode_steps
        sampler = Sampler(cfg, graphdef, num_slots=slots, max_prompt_len=prompt, max_new_tokens=2 * steps,
                          chunk_steps=steps)
        prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (slots, prompt)).tolist()
        timed = {}
        for new in (steps, 2 * steps):
            sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, ignore_eos=True)
            run = lambda sampling=sampling: sampler.generate(params, prompts, sampling, key=jax.random.key(0))
            assert all(c.length == new for c in run())  # compiles every window this length needs
            timed[new] = _fastest_seconds(run, args.runs)  # the least disturbed run: a difference of two is noisy
        step_seconds = (timed[2 * steps] - timed[steps]) / steps
        if step_seconds <= 0:
            raise RuntimeError(f"decode: {2 * steps} new tokens took no longer than {steps} ({timed}); use more "
                               f"--decode-steps")
        shape = costs.ModelShape.from_config(cfg)
        mean_keys = prompt + 1.5 * steps  # steps N..2N attend to prompt + N .. prompt + 2N keys
        step_bytes = costs.decode_step_bytes(shape, keys=slots * mean_keys, sequences=slots)
        name = "tiny" if args.small else f"qwen2.5-{size}"
        rows.append(_row("decode", f"{name} decode step", step_seconds * 1e3, "ms",
                         f"{slots} rows, prompt {prompt}, steps {steps}..{2 * steps}"))
        rows.append(_row("decode", f"{name} HBM roofline fraction", step_bytes / step_seconds / bandwidth, "",
                         f"{step_bytes / 1e9:.3f} GB per step vs bandwidth ({source})"))
    return rows


def part_validate(args) -> list[dict]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_perfmodel as perfmodel

    from rpegjax.perf.model import step_model
    from rpegjax.perf.model.stage_costs import ExecutionOptions

    measured = _profile(args)
    if args.small:
        configs = [perfmodel.Config(name="tiny grpo", model=perfmodel.TINY, prompts=2, group=2, prompt_tokens=8,
                                    new_tokens=8)]
    else:
        configs = [c for c in perfmodel.CONFIGS if c.name in ("w-small grpo", "w-small grpo fused k=1")]
    rows, errors = [], []
    for config in configs:
        spec = hardware_profile.spec_from_profile(measured, dtype=config.model.dtype)
        prediction = step_model.Evaluator.for_runtime(config.model, config.workload(), spec,
                                                      ExecutionOptions.rpegjax_xla()).predict(config.graph())
        steps, _ = perfmodel.run_runtime(config, config.graph(), args.validate_steps, warmup=1)
        seconds = statistics.median(steps)
        error = (prediction.step_seconds - seconds) / seconds
        errors.append(abs(error))
        rows.append(_row("validate", f"{config.name} step", seconds, "s",
                         f"predicted {prediction.step_seconds:.4f} s, error {error:+.0%}"))
    rows.append(_row("validate", "median |error|", statistics.median(errors), "", f"{len(errors)} configurations"))
    return rows


def _timed_runs(run, runs: int) -> list[float]:
    run()  # compile and warm up
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(run())
        samples.append(time.perf_counter() - start)
    return samples


def _median_seconds(run, runs: int) -> float:
    return statistics.median(_timed_runs(run, runs))


def _fastest_seconds(run, runs: int) -> float:
    return min(_timed_runs(run, runs))


# ------------------------------------------------------------------------------------------------ table
def table(directory: str) -> str:
    """The statuses gpu_check.sh recorded (DIR/status.txt: name, exit status or "skipped", seconds), then the rows of
    each named part (DIR/<name>.json) in that order, or of every part when there is no status file."""
    lines, names = [], []
    status_path = os.path.join(directory, "status.txt")
    if os.path.exists(status_path):
        for line in open(status_path):
            name, rc, seconds = line.split()
            state = ("skipped (time budget spent)" if rc == "skipped" else "ok" if rc == "0"
                     else "TIMED OUT" if rc in ("124", "137") else f"FAILED (exit {rc})")
            lines.append(("status", name, state, f"{float(seconds):.0f} s", ""))
            names.append(name)
    for name in names or PARTS:
        path = os.path.join(directory, f"{name}.json")
        if os.path.exists(path):
            for row in json.load(open(path)):
                value = row["value"]
                text = f"{value:.4g}" if isinstance(value, float) else str(value)
                lines.append((row["part"], row["metric"], text, row["unit"], row["note"]))
    widths = [max(len(line[i]) for line in lines) for i in range(5)] if lines else []
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--part", choices=(*PARTS, "all"))
    parser.add_argument("--out", help="directory for profile.json and each part's rows")
    parser.add_argument("--table", metavar="DIR", help="print the table of DIR's rows and exit")
    parser.add_argument("--name", help="file name of the part's rows (DIR/NAME.json; default: the part)")
    parser.add_argument("--small", action="store_true", help="tiny model and problems: a check that it all runs")
    parser.add_argument("--models", default="0.5b", help="Qwen2.5 sizes for the update, comma-separated")
    parser.add_argument("--decode-models", default="0.5b", help="Qwen2.5 sizes for decode, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="timed runs (median) after one warm-up")
    parser.add_argument("--update-rows", type=int, default=16)
    parser.add_argument("--update-prompt", type=int, default=256)
    parser.add_argument("--update-response", type=int, default=768)
    parser.add_argument("--decode-slots", type=int, default=64)
    parser.add_argument("--decode-prompt", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--validate-steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if not args.part or not args.out:
        parser.error("give --part and --out (or --table DIR)")
    if args.small:
        args.update_rows, args.update_prompt, args.update_response = 4, 8, 8
        args.decode_slots, args.decode_prompt, args.decode_steps = 2, 8, 32
        args.validate_steps, args.runs = 1, 2
    args.models = [m for m in args.models.split(",") if m]
    args.decode_models = [m for m in args.decode_models.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    functions = {"calibrate": part_calibrate, "update": part_update, "decode": part_decode, "validate": part_validate}
    if args.name and args.part == "all":
        parser.error("--name names one part's rows; not with --part all")
    for part in PARTS if args.part == "all" else (args.part,):
        rows = functions[part](args)
        with open(os.path.join(args.out, f"{args.name or part}.json"), "w") as file:
            json.dump(rows, file, indent=1)
    if args.part == "all":
        print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
