"""Partial rollouts on a long tail (W-tail's lengths through W-small's GRPO step): seconds per step with and
without `--rollout.partial`, in one run, interleaved.

The W-small model (shared/WORKLOADS.md), 8 prompts x 4 samples of 32-token prompts per step, temperature 1; a
response ends when it samples one of `--stop-fraction` of the vocabulary (so lengths are geometric-like with a
mean near 1 / fraction) or at the budget of 8x that mean: W-tail's long tail (max 8x mean). GRPO with a reference
model, asynchrony bound 1, the job's default graph (fused inference). Each round runs both modes from the same
initial weights (the order alternates between rounds): `--warmup` steps, then `--steps` timed steps; the figures
are the medians of the timed step times over every round, their ratio, and the response lengths trained.

    python benchmarks/bench_partial_rollouts.py [--steps 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph import builders, transforms
from rpegjax.graph.trace import Trace
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.models import Decoder, ModelConfig
from rpegjax.rewards.runner import Isolation, RewardRunner, RewardRunnerConfig
from rpegjax.runtime.assembly import RolloutShape, place_models
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig
from rpegjax.runtime.programs import StagePrograms

PROMPTS, GROUP, PROMPT_LEN = 8, 4, 32


def even_token_reward(text: str, example: Example) -> float:
    """A rule-based host reward: the fraction of response tokens with an even id."""
    ids = [int(x) for x in text.split()]
    return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


class Bench:
    """One learner and sampler (compiled once) shared by every run of both modes."""

    def __init__(self, mean: int):
        self.cfg = ModelConfig.w_small()
        self.graph = transforms.default_fusion(builders.grpo_graph(use_reference=True, async_bound=1))
        self.learner, self.sampler = place_models(
            self.graph, Decoder(self.cfg, rngs=nnx.Rngs(0)),
            GRPOConfig(group_size=GROUP, kl_coef=0.04, clip_low=0.2, clip_high=0.2, decoupled=True, importance_cap=5.0,
                       optimizer=OptimizerConfig(learning_rate=1e-5)),
            RolloutShape(num_slots=PROMPTS * GROUP, max_prompt_len=PROMPT_LEN, max_new_tokens=8 * mean, chunk_steps=8))
        stride = mean  # one id in `mean` ends a response
        self.sampling = SamplingConfig(max_new_tokens=8 * mean, temperature=1.0, ignore_eos=True,
                                       stop_ids=tuple(range(1, self.cfg.vocab_size, stride)))
        rng = np.random.default_rng(0)
        self.prompts = {f"p{i}": rng.integers(0, self.cfg.vocab_size, PROMPT_LEN).tolist() for i in range(256)}
        self.examples = [Example(id=key, prompt=key, answer="0", task="w-tail") for key in self.prompts]

    def run(self, partial: bool, steps: int) -> dict:
        rewards = RewardRunner(even_token_reward, RewardRunnerConfig(timeout_s=10.0, workers=1,
                                                                      isolation=Isolation.THREAD))
        programs = StagePrograms(learner=self.learner, sampler=self.sampler, sampling=self.sampling, group_size=GROUP,
                                 rewards=rewards, decode=lambda ids: " ".join(str(int(i)) for i in ids), pad_id=0)
        runtime = Runtime(self.graph, programs, DataIterator(self.examples, batch_size=PROMPTS, seed=0),
                          prompt_ids=lambda batch: [self.prompts[e.id] for e in batch], key=jax.random.key(0),
                          trace=Trace("partial" if partial else "plain"),
                          partial=PartialRolloutConfig(max_token_lag=3) if partial else None)
        ends, results = [time.perf_counter()], []

        def on_step(result, state) -> None:
            ends.append(time.perf_counter())
            results.append(result)

        try:
            runtime.run(self.learner.init_state(), start_step=0, num_steps=steps, on_step=on_step)
        finally:
            rewards.close()
        lengths = np.array([c.length for r in results for c in r.completions])
        return {"step_seconds": np.diff(ends).tolist(), "lengths": lengths.tolist(),
                "lag_max": max(r.metrics["version_lag/max"] for r in results),
                "carried": sum(r.metrics.get("partial/carried_sequences", 0.0) for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mean", type=int, default=32, help="mean response length; the budget is 8x")
    args = parser.parse_args()
    bench = Bench(args.mean)
    times = {False: [], True: []}
    lengths = {False: [], True: []}
    extra = {}
    for round_index in range(args.rounds):
        for partial in ((False, True) if round_index % 2 == 0 else (True, False)):
            out = bench.run(partial, args.warmup + args.steps)
            times[partial] += out["step_seconds"][args.warmup:]
            lengths[partial] += out["lengths"]
            extra[partial] = {"lag_max": out["lag_max"], "carried_sequences": out["carried"]}
            print(f"round {round_index} partial={partial}: median {statistics.median(out['step_seconds'][args.warmup:]):.2f} s/step",
                  flush=True)
    summary = {}
    for partial, name in ((False, "without"), (True, "partial")):
        trained = np.array(lengths[partial])
        summary[name] = {"median_s": statistics.median(times[partial]), "min_s": min(times[partial]),
                         "max_s": max(times[partial]), "timed_steps": len(times[partial]),
                         "trained_length_mean": float(trained.mean()), "trained_length_max": int(trained.max()),
                         **extra[partial]}
    summary["speedup"] = summary["without"]["median_s"] / summary["partial"]["median_s"]
    summary["budget"] = 8 * args.mean
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
