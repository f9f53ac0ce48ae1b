"""W-small with generation and training in separate processes, each pinned to one core, against both colocated in
one process on both cores; asynchrony bound 1 in both.

    python benchmarks/bench_roles.py [--steps 7] [--warmup 2] [--rounds 1]

* split:      `scripts/train_grpo.py --rollout-devices=1` as 2 processes of one CPU device each (`taskset -c 0` and
              `taskset -c 1`): process 0 generates, process 1 trains (reference log-probs, update, weight sync) and
              writes the run; weights and rollouts cross through `jax.experimental.transfer`.
* colocated:  the same job as one process with one CPU device on both cores; its rollout thread generates step
              t + 1 while step t trains, on the same device.
The two are run alternately (`--rounds` times each) so that load from other processes hits both alike.

Figures: seconds per step (the job's `seconds` metric, steps after `--warmup`: median, min, max), the ratio
split / colocated of the same round, and the overlap fraction: the share of the training process's busy time
(its stage spans) during which generation of a later step was running, from the run's trace (both processes
record on the host's wall clock).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_grpo.py"
# W-small (shared/WORKLOADS.md) as the job builds it: the built-in tokenizer's vocabulary instead of 512 tokens
W_SMALL = [
    "--model.hidden_size=256", "--model.num_layers=4", "--model.num_heads=4", "--model.num_kv_heads=2",
    "--model.head_dim=64", "--model.intermediate_size=1024", "--prompts-per-step=8", "--group-size=4",
    "--max-new-tokens=64", "--temperature=1.0", "--warm-start-steps=0", "--data.eval_size=8",
    "--train.export_hf=false", "--train.reward_workers=1", "--async-bound=1",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT))
    return env


def run(run_dir: pathlib.Path, steps: int, *, split: bool) -> None:
    flags = [*W_SMALL, f"--steps={steps}", f"--run-dir={run_dir}", f"--checkpoint-every={steps + 1}"]
    if not split:
        commands = [[sys.executable, str(SCRIPT), *flags]]
    else:
        port = _free_port()
        commands = [["taskset", "-c", str(core), sys.executable, str(SCRIPT), *flags, "--rollout-devices=1",
                     "--mesh=data=1", "--rollout-mesh=data=1", f"--distributed.coordinator_address=127.0.0.1:{port}",
                     "--distributed.num_processes=2", f"--distributed.process_id={core}"] for core in (0, 1)]
    logs = [run_dir.parent / f"{run_dir.name}.{i}.err" for i in range(len(commands))]
    children = [subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                 cwd=run_dir.parent) for command, log in zip(commands, logs)]
    codes = [child.wait(timeout=1800) for child in children]
    if any(codes):
        tails = "\n".join(f"--- {log.name} (exit {code})\n{log.read_text()[-2000:]}" for code, log in zip(codes, logs))
        raise SystemExit(f"{'split' if split else 'colocated'} run failed:\n{tails}")


def step_seconds(run_dir: pathlib.Path, warmup: int) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["seconds"] for r in records if "seconds" in r and r.get("step", 0) > warmup]


def _events(path: pathlib.Path) -> list[dict]:
    """The "X" events of a trace file with ts on the wall clock (ts + the trace's origin, microseconds)."""
    document = json.loads(path.read_text())
    origin = document.get("otherData", {}).get("origin", 0.0) * 1e6
    return [dict(e, ts=e["ts"] + origin) for e in document["traceEvents"] if e.get("ph") == "X"]


def overlap_fraction(run_dir: pathlib.Path, warmup: int) -> float | None:
    """Share of the training stages' time during which a generate span of a later step was running (a split run's
    generation process writes its spans to trace.generation-<process>.json)."""
    events = [e for path in sorted(run_dir.glob("trace*.json")) for e in _events(path)]

    def step(event) -> int:
        return int(event.get("args", {}).get("step", -1))

    generate = [(e["ts"], e["ts"] + e["dur"], step(e)) for e in events if e["name"] == "generate"]
    training = [(e["ts"], e["ts"] + e["dur"], step(e)) for e in events
                if e["name"] not in ("generate", "reward") and step(e) >= warmup]
    if not generate or not training:
        return None
    busy = sum(end - start for start, end, _ in training)
    covered = 0.0
    for start, end, s in training:
        later = sorted((max(start, g0), min(end, g1)) for g0, g1, gs in generate if gs > s and g0 < end and g1 > start)
        reach = start
        for lo, hi in later:  # the union of the later generations' spans within this training span
            lo = max(lo, reach)
            if hi > lo:
                covered += hi - lo
                reach = hi
    return covered / busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="steps per run (the first --warmup are not timed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin each process to one core")
    results: dict[str, list[dict]] = {"colocated": [], "split": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name in ("colocated", "split"):
                run_dir = pathlib.Path(scratch) / f"{name}-{round_index}"
                run(run_dir, args.steps, split=name == "split")
                seconds = step_seconds(run_dir, args.warmup)
                results[name].append({"seconds": seconds, "overlap": overlap_fraction(run_dir, args.warmup)})
                s = seconds
                overlap = results[name][-1]["overlap"]
                print(f"round {round_index} {name:>9}: {statistics.median(s):.3f} s/step (min {min(s):.3f}, max "
                      f"{max(s):.3f}, {len(s)} steps); overlap "
                      f"{'n/a' if overlap is None else f'{overlap:.0%}'}", flush=True)
            split_median = statistics.median(results["split"][-1]["seconds"])
            colocated_median = statistics.median(results["colocated"][-1]["seconds"])
            print(f"round {round_index}: split / colocated = {split_median / colocated_median:.3f}", flush=True)


if __name__ == "__main__":
    main()
