"""Reward-checking latency for one W-small batch (32 completions): in-process loop vs the RewardRunner.

    python benchmarks/bench_rewards.py [--batch 32] [--runs 15] [--workers 2]

For each reward (the built-in arithmetic and countdown verifiers; math-verify on GSM8K-style answers) the
batch is half reference solutions, half wrong answers. Contenders: a plain loop calling the reward in this
thread (the baseline: no timeout, no isolation), the runner with `Isolation.THREAD`, and the runner with
`Isolation.PROCESS`. Runs alternate contender by contender (a shared machine's load hits all alike);
prints the median (min, max) milliseconds per batch and each runner's ratio to the loop measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rpegjax.data.example import Example
from rpegjax.rewards.math import math_reward
from rpegjax.rewards.runner import Isolation, RewardRunner, RewardRunnerConfig
from rpegjax.rewards.tasks import make_task


def _batches(batch: int) -> dict[str, tuple]:
    batches = {}
    for name in ("arithmetic", "countdown"):
        task = make_task(name, "easy")
        examples = task.train_examples(batch, seed=0)
        texts = [task.reference_solution(e) if i % 2 == 0 else f"A:{int(e.answer) + 1}" for i, e in enumerate(examples)]
        batches[name] = (task.reward, texts, examples)
    examples = [Example(id=f"g{i}", prompt=f"q{i}", answer=str(17 * i), task="math") for i in range(batch)]
    texts = [f"Work... so the total is {17 * i + i % 2}.\n#### {17 * i + i % 2}" for i in range(batch)]
    batches["math-verify"] = (math_reward, texts, examples)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    for name, (fn, texts, examples) in _batches(args.batch).items():
        runners = {
            isolation: RewardRunner(fn, RewardRunnerConfig(timeout_s=30.0, workers=args.workers, isolation=isolation))
            for isolation in Isolation
        }
        calls = {"loop": lambda: [fn(t, e) for t, e in zip(texts, examples)]}
        calls.update({f"runner/{iso.value}": (lambda r=runner: r.score(texts, examples)) for iso, runner in runners.items()})
        expected = calls["loop"]()
        for call_name, call in calls.items():  # warm-up (starts worker processes) and a correctness check
            result = call()
            rewards = result if call_name == "loop" else result[0].tolist()
            assert rewards == expected, (name, call_name)
        seconds = {call_name: [] for call_name in calls}
        for _ in range(args.runs):
            for call_name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[call_name].append(time.perf_counter() - start)
        for runner in runners.values():
            runner.close()
        baseline = statistics.median(seconds["loop"])
        print(f"{name}: batch {args.batch}, mean reward {sum(expected) / len(expected):.2f}, {args.runs} runs")
        for call_name, values in seconds.items():
            median = statistics.median(values)
            print(
                f"  {call_name:16s} median {1e3 * median:8.2f} ms  (min {1e3 * min(values):7.2f}, max {1e3 * max(values):7.2f})"
                f"  ratio to loop {median / baseline:6.2f}"
            )


if __name__ == "__main__":
    main()
