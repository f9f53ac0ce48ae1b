"""Sequence packing on long-tail lengths: the GRPO update packed against bucketed against padded, one run.

The W-small model and GRPO settings (shared/WORKLOADS.md: vocab 512, d 256, 4 layers, 8 prompts x 4 samples,
prompts of 32 tokens, k3 KL 0.04 in the loss, clip 0.2, AdamW lr 1e-5) with W-tail response lengths: log-normal
(sigma 1) scaled to mean `--mean` tokens, the longest at the cap 8 x mean, rows padded to 32 + 8 x mean as the
runtime packs them (`--seed` draws them). Four learners update the same batch:
* padded         rows at the whole length (length_bucket None);
* bucketed       rows cut to the longest real row rounded up to `--bucket` (rpegjax.learners.lengths);
* packed         sequences packed into rows of `--budget` tokens, one row per micro-batch (rpegjax.learners.packing);
* packed-narrow  packed, rows narrowed to the multiple of `--bucket` that pads the fewest tokens (length_bucket);
interleaved run by run (`timing.py`), min / median of `--runs` timed calls after a warm-up round; all four must
give the same loss and gradient norm.

    python benchmarks/bench_packing.py [--mean 64] [--budget 1024] [--bucket 64] [--runs 5] [--attention blockwise] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
from flax import nnx

from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig, pack_rollouts
from rpegjax.models import Decoder, ModelConfig
from timing import time_interleaved

PROMPTS, GROUP, PROMPT_LEN = 8, 4, 32


def tail_lengths(rng: np.random.Generator, rows: int, mean: int) -> np.ndarray:
    """W-tail response lengths: log-normal (sigma 1) scaled to `mean`, capped at 8 x mean, the longest at the cap."""
    raw = rng.lognormal(0.0, 1.0, rows)
    lengths = np.clip(np.round(raw / raw.mean() * mean), 1, 8 * mean).astype(int)
    lengths[np.argmax(raw)] = 8 * mean
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mean", type=int, default=64, help="mean response tokens")
    parser.add_argument("--budget", type=int, default=1024, help="packed: max_tokens_per_micro_batch")
    parser.add_argument("--bucket", type=int, default=64, help="bucketed: length_bucket")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--attention", default="blockwise", choices=["dense", "blockwise"])
    parser.add_argument("--block", type=int, default=128, help="blockwise attention's block size")
    parser.add_argument("--seed", type=int, default=0, help="draws the batch's lengths and tokens")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = PROMPTS * GROUP
    lengths = tail_lengths(rng, rows, args.mean)
    prompts = [list(rng.integers(1, 512, PROMPT_LEN)) for _ in range(rows)]
    responses = [list(rng.integers(1, 512, n)) for n in lengths]
    batch = pack_rollouts(prompts, responses, [np.full(n, -6.0) for n in lengths], pad_id=0,
                          length=PROMPT_LEN + 8 * args.mean, rewards=rng.integers(0, 2, rows).astype(np.float32))
    model = Decoder(ModelConfig.w_small(), rngs=nnx.Rngs(0)).with_execution(attention=args.attention,
                                                                            attention_block_size=args.block)
    real = int(batch.token_mask.sum())
    print(f"W-small model, {args.attention} attention (block {args.block}), {rows} rows, prompt {PROMPT_LEN}, W-tail "
          f"responses mean {lengths.mean():.1f}, longest {lengths.max()}, padded to {batch.length}: {real} real of "
          f"{batch.tokens.size} padded tokens; jax {jax.__version__}, {jax.device_count()} device(s); the machine is "
          f"shared and loaded")
    common = dict(group_size=GROUP, kl_coef=0.04, kl_kind="k3", clip_low=0.2, clip_high=0.2,
                  optimizer=OptimizerConfig(learning_rate=1e-5))
    contenders = {"padded": {}, "bucketed": dict(length_bucket=args.bucket),
                  "packed": dict(packing=True, max_tokens_per_micro_batch=args.budget),
                  "packed-narrow": dict(packing=True, max_tokens_per_micro_batch=args.budget, length_bucket=args.bucket)}
    calls, results, shapes = {}, {}, {}
    reference = None
    for name, options in contenders.items():
        learner = GRPOLearner(GRPOConfig(**common, **options), model)
        if reference is None:
            prepared, _ = learner.compute_advantages(batch)
            prepared = prepared.replace(ref_logprobs=np.asarray(learner.logprobs(learner.params, prepared)))
            reference = prepared
        inputs = learner._update_inputs(reference)
        shapes[name] = f"{inputs.tokens.shape[0]} x {inputs.tokens.shape[1]}"
        _, metrics = learner.update(learner.init_state(), reference)  # compile, and the figures to compare
        results[name] = (float(metrics["loss"]), float(metrics["grad_norm"]))
        states = [learner.init_state()]

        def update_step(learner=learner, states=states):  # the update donates its state: chain
            states[0], step_metrics = learner.update(states[0], reference)
            return jax.block_until_ready(step_metrics["loss"])

        calls[name] = update_step
    seconds = time_interleaved(calls, args.runs, warmup=1)
    print("| update | rows x columns | min s | median s | loss | grad norm |")
    print("|---|---|---|---|---|---|")
    for name, times in seconds.items():
        loss, norm = results[name]
        print(f"| {name} | {shapes[name]} | {min(times):.3f} | {statistics.median(times):.3f} | {loss:.6f} | {norm:.6f} |")
    padded = statistics.median(seconds["padded"])
    for name in ("bucketed", "packed", "packed-narrow"):
        print(f"{name}: padded / {name} median time = {padded / statistics.median(seconds[name]):.2f}x")


if __name__ == "__main__":
    main()
