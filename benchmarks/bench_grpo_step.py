"""W-small (shared/WORKLOADS.md): seconds per GRPO step through the RPEG runtime.

Six graphs of the same step, measured in one run: synchronous unfused, synchronous fused (reference and
old log-probs in one program), asynchronous k=1 fused (generation of step t overlaps training of step t-1),
synchronous and asynchronous k=1 without the old-log-prob pass (one update per batch without the decoupled
correction: the old policy is the one being updated, ratio 1), and asynchronous k=1 fused with generation on a
device of its own (two XLA:CPU devices sharing the cores).
Each: 2 warm-up steps, then `--steps` timed steps; median / min / max seconds per step, the generation
stage's median and the rest (the step minus the part of generation that did not overlap), peak RSS, and
the step as a fraction of the compute floor recomputed from a matmul peak measured in the same run, and with
`--trl-seconds S` (TRL's median step of the same round: `../shared/peers/sidebyside.sh` prints it before this
bench) TRL's step over each graph's. Without it no peer ratio is printed: a figure from another run is no
comparison (machines differ by up to 2x from one session to the next).

    python benchmarks/bench_grpo_step.py [--steps 5] [--graphs "sync fused" ...] [--json FILE] [--trl-seconds S]

Each step's CPU seconds of the process (`time.process_time`, all threads; `cpu_median`) are recorded beside its
wall time: waiting for a core on a loaded machine inflates the wall time only.
"""

from __future__ import annotations

import os

# two XLA:CPU devices (same cores) for the disaggregated row; the other rows use the first only
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
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
from rpegjax.runtime.programs import StagePrograms

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 8, 4, 32, 64


def even_token_reward(text: str, example: Example) -> float:
    """A rule-based host reward: the fraction of response tokens with an even id."""
    ids = [int(x) for x in text.split()]
    return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def matmul_peak_flops(size: int = 1024, repeats: int = 10) -> float:
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def compute_floor_flops(cfg: ModelConfig) -> float:
    """FLOPs of one step: update 6·N·tokens, reference and old forward 2·N·tokens each, generation 2·N·new tokens."""
    n = cfg.num_params()
    rows = PROMPTS * GROUP
    tokens = rows * (PROMPT_LEN + NEW_TOKENS)
    return 6 * n * tokens + 2 * 2 * n * tokens + 2 * n * rows * NEW_TOKENS


def measure(graph_name: str, graph, warmup: int, steps: int) -> dict:
    """Runs `graph`; the learner and the sampler live where its update and generate stages are placed."""
    cfg = ModelConfig.w_small()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    learner, sampler = place_models(
        graph, model, GRPOConfig(group_size=GROUP, kl_coef=0.04, clip_low=0.2, clip_high=0.2,
                                 optimizer=OptimizerConfig(learning_rate=1e-5)),
        RolloutShape(num_slots=PROMPTS * GROUP, max_prompt_len=PROMPT_LEN, max_new_tokens=NEW_TOKENS,
                     chunk_steps=NEW_TOKENS))
    rewards = RewardRunner(even_token_reward, RewardRunnerConfig(timeout_s=10.0, workers=1, isolation=Isolation.THREAD))
    rng = np.random.default_rng(0)
    prompts = {f"p{i}": rng.integers(0, cfg.vocab_size, PROMPT_LEN).tolist() for i in range(64)}
    examples = [Example(id=key, prompt=key, answer="0", task="w-small") for key in prompts]
    programs = StagePrograms(
        learner=learner, sampler=sampler,
        sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True), group_size=GROUP,
        rewards=rewards, decode=lambda ids: " ".join(str(int(i)) for i in ids), pad_id=0,
    )
    trace = Trace(graph_name)
    runtime = Runtime(graph, programs, DataIterator(examples, batch_size=PROMPTS, seed=0),
                      prompt_ids=lambda batch: [prompts[e.id] for e in batch], key=jax.random.key(0), trace=trace)
    ends, cpu_ends = [], []

    def on_step(result, state):
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())

    runtime.run(learner.init_state(), start_step=0, num_steps=warmup + steps, on_step=on_step)
    rewards.close()
    step_times = np.diff(ends)[warmup - 1:]
    cpu_times = np.diff(cpu_ends)[warmup - 1:]
    timed = {e.step for e in trace.events if e.step >= warmup}
    generation = [e.duration for e in trace.events if e.stage == "generate" and e.step in timed]
    tokens = [e for e in trace.events if e.stage == "generate"]
    return {
        "graph": graph_name,
        "median": statistics.median(step_times), "min": float(min(step_times)), "max": float(max(step_times)),
        "cpu_median": statistics.median(cpu_times),
        "generation_median": statistics.median(generation),
        "dispatches_per_step": runtime.dispatches_per_step[-1],
        "generated_tokens_per_step": PROMPTS * GROUP * NEW_TOKENS,
        "params": cfg.num_params(),
        "generate_events": len(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--graphs", nargs="+", help="only these graphs (names as printed); default all")
    parser.add_argument("--trl-seconds", type=float, help="TRL's median s/step measured in the same round")
    args = parser.parse_args()
    base = builders.grpo_graph(use_reference=True)
    graphs = {
        "sync unfused": base,
        "sync fused": transforms.default_fusion(base),
        "async k=1 fused": transforms.default_fusion(builders.grpo_graph(use_reference=True, async_bound=1)),
        # one update per batch on-policy: the sampler's log-probs are the old policy's, as TRL does it
        "sync, no old pass": builders.grpo_graph(use_reference=True, recompute_old_logprobs=False),
        # the same with asynchrony: without the decoupled correction one update's ratio is 1 at any k
        "async k=1, no old pass": builders.grpo_graph(use_reference=True, async_bound=1, recompute_old_logprobs=False),
        # generation on CPU device 0 and training on device 1 (two XLA:CPU devices on the same cores):
        # the sampler's small decode programs no longer queue behind the update's
        "async k=1 split": transforms.default_fusion(transforms.disaggregate(
            builders.grpo_graph(use_reference=True, async_bound=1, num_devices=2), 1, {"data": 1}, {"data": 1})),
    }
    if jax.device_count() < 2:
        print(f"only {jax.device_count()} device (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}): skipping 'async k=1 split'")
        del graphs["async k=1 split"]
    if args.graphs:
        unknown = set(args.graphs) - set(graphs)
        if unknown:
            raise SystemExit(f"--graphs: unknown or unavailable {sorted(unknown)}; choose from {list(graphs)}")
        graphs = {name: graphs[name] for name in args.graphs}
    results = [measure(name, graph, args.warmup, args.steps) for name, graph in graphs.items()]
    peak = matmul_peak_flops()
    floor = compute_floor_flops(ModelConfig.w_small()) / peak
    print(f"W-small GRPO step, {args.steps} timed steps after {args.warmup} warm-up; "
          f"matmul peak {peak / 1e9:.0f} GFLOP/s -> compute floor {floor:.2f} s")
    print(f"{'graph':<24}{'median s':>10}{'min':>8}{'max':>8}{'cpu s':>8}{'generate':>10}{'rest':>8}{'dispatch':>10}"
          f"{'vs TRL':>9}{'/floor':>8}")
    for r in results:
        r["rest_median"] = r["median"] - r["generation_median"]
        r["trl_step_over_ours"] = None if args.trl_seconds is None else args.trl_seconds / r["median"]
        r["fraction_of_floor"] = r["median"] / floor
        versus = "-" if r["trl_step_over_ours"] is None else f"{r['trl_step_over_ours']:.2f}x"
        print(f"{r['graph']:<24}{r['median']:>10.3f}{r['min']:>8.3f}{r['max']:>8.3f}{r['cpu_median']:>8.3f}"
              f"{r['generation_median']:>10.3f}"
              f"{r['rest_median']:>8.3f}{r['dispatches_per_step']:>10}{versus:>9}"
              f"{r['fraction_of_floor']:>7.2f}x")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the whole run (all configurations): {rss_mb:.0f} MB")
    if args.trl_seconds is None:
        print("vs TRL: pass --trl-seconds, TRL's median of the same round (../shared/peers/sidebyside.sh)")
    print("(with asynchrony the generation of step t+1 overlaps step t, so 'rest' can be below the training time)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": results, "matmul_peak_flops": peak, "floor_seconds": floor, "peak_rss_mb": rss_mb},
                      handle, indent=2)


if __name__ == "__main__":
    main()
