"""One GRPO update on the W-small batch (shared/WORKLOADS.md): time, peak memory, ratios to baselines.

W-small: Qwen2-shaped model (vocab 512, d 256, 4 layers, 4 heads, 2 KV heads, MLP 1024, f32), 32 sequences of
32 prompt + 64 response tokens, GRPO with the reference KL (k3, coefficient 0.04) in the loss, clip 0.2, AdamW
lr 1e-5, one update on the whole batch (so pi_old = pi_theta: no old-log-prob pass, as TRL with one iteration).

Measured in one run, each as min / median / max of `--runs` timed calls after `--warmup` calls:
* update        GRPOLearner.update (forward + backward + AdamW), the figure this benchmark is about;
* ref_logprobs  GRPOLearner.logprobs (the reference forward the update needs);
* fwd_bwd       baseline: value_and_grad of the summed response log-probs, same model and batch,
                without the loss details and the optimiser (what any update must at least do);
* matmul        f32 [1024, 1024] @ [1024, 1024] to measure this machine's peak GFLOP/s now.
Reports update / fwd_bwd, the update's XLA FLOP count against that peak (fraction of the floor), and peak
resident memory (process maximum, which includes compilation) plus XLA's memory analysis of the update.

    python benchmarks/bench_update.py [--runs 7] [--warmup 2] [--microbatches 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wsmall_parts import GROUP, PROMPT_LEN, PROMPTS, RESPONSE_LEN, wsmall_batch  # noqa: E402

from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig  # noqa: E402
from rpegjax.learners.scoring import sequence_logprobs  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402


def timed(fn, runs: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def summary(name: str, times: list[float]) -> str:
    return f"{name:13s} min {min(times):7.4f} s  median {statistics.median(times):7.4f} s  max {max(times):7.4f} s"


def matmul_gflops(runs: int) -> float:
    a = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (1024, 1024), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    times = timed(lambda: matmul(a, b), runs=max(runs, 10), warmup=2)
    return 2 * 1024**3 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=1)
    args = parser.parse_args()

    model_cfg = ModelConfig.w_small()
    model = Decoder(model_cfg, rngs=nnx.Rngs(0))
    cfg = GRPOConfig(
        group_size=GROUP, clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3", num_microbatches=args.microbatches,
        optimizer=OptimizerConfig(learning_rate=1e-5, weight_decay=0.0, max_grad_norm=1.0),
    )
    learner = GRPOLearner(cfg, model)
    batch = wsmall_batch(learner, model_cfg)
    tokens, token_mask = jnp.asarray(batch.tokens), jnp.asarray(batch.token_mask)
    response_mask = jnp.asarray(batch.response_mask)

    state = learner.init_state()
    holder = {"state": state}

    def one_update():
        holder["state"], metrics = learner.update(holder["state"], batch)
        return metrics

    update_times = timed(one_update, args.runs, args.warmup)
    assert learner.update_traces == 1
    ref_times = timed(lambda: learner.logprobs(learner.params, batch), args.runs, args.warmup)

    graphdef = learner.placement.graphdef

    @jax.jit
    def forward_backward(params):
        def loss(p):
            logprobs = sequence_logprobs(nnx.merge(graphdef, p), tokens, token_mask, chunk_size=cfg.logprob_chunk_size)
            return jnp.sum(logprobs * response_mask)

        return jax.value_and_grad(loss)(params)

    baseline_times = timed(lambda: forward_backward(learner.params), args.runs, args.warmup)
    peak_gflops = matmul_gflops(args.runs)

    compiled = learner.lower_update(holder["state"], batch).compile()
    flops = (compiled.cost_analysis() or {}).get("flops", float("nan"))
    memory = compiled.memory_analysis()
    params = sum(x.size for x in jax.tree.leaves(learner.params))
    rows = PROMPTS * GROUP
    tokens_total = rows * (PROMPT_LEN + RESPONSE_LEN)
    update_median, baseline_median = statistics.median(update_times), statistics.median(baseline_times)

    print(f"W-small GRPO update: {rows} sequences x ({PROMPT_LEN} + {RESPONSE_LEN}) tokens, {params:,} parameters, "
          f"micro-batches {args.microbatches}, {args.runs} timed runs after {args.warmup} warm-up, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
    print(summary("update", update_times))
    print(summary("ref_logprobs", ref_times))
    print(summary("fwd_bwd", baseline_times))
    print(f"update / fwd_bwd baseline: {update_median / baseline_median:.2f}x")
    print(f"matmul peak now: {peak_gflops:.1f} GFLOP/s;  6 N tokens = {6 * params * tokens_total / 1e9:.1f} GFLOP;  "
          f"XLA count for the update = {flops / 1e9:.1f} GFLOP -> floor {flops / 1e9 / peak_gflops:.3f} s, "
          f"update at {flops / 1e9 / peak_gflops / update_median:.0%} of the floor")
    if memory is not None:
        print(f"XLA memory of the update: arguments {memory.argument_size_in_bytes / 2**20:.1f} MiB, "
              f"temporaries {memory.temp_size_in_bytes / 2**20:.1f} MiB, outputs {memory.output_size_in_bytes / 2**20:.1f} MiB")
    print(f"peak RSS of the process (includes compilation): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
