"""Length bucketing on W-small-like lengths: update and reference log-probs, padded against trimmed, one run.

The W-small model and GRPO settings (shared/WORKLOADS.md: vocab 512, d 256, 4 layers, 32 rows, prompts of 32
tokens, k3 KL 0.04, AdamW) with responses of varying length, as sampling with EOS gives them: log-normal with
mean `--mean` tokens, capped at `--max-new` (rows padded to 32 + max-new, as the runtime packs them). Times
`GRPOLearner.update` and `GRPOLearner.logprobs`-like inference (the runtime's trimmed path) with
`length_bucket=None` (padded) and `--bucket`, interleaved run by run (`timing.py`), min / median of `--runs`
timed calls after a warm-up round, and checks that both give the same loss.

    python benchmarks/bench_buckets.py [--mean 64] [--max-new 256] [--bucket 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig, pack_rollouts
from rpegjax.learners.lengths import pad_columns
from rpegjax.models import Decoder, ModelConfig
from timing import time_interleaved

ROWS, GROUP, PROMPT_LEN = 32, 4, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mean", type=float, default=64.0, help="mean response tokens (log-normal, sigma 0.6)")
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--bucket", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sigma = 0.6
    lengths = np.clip(rng.lognormal(np.log(args.mean) - sigma**2 / 2, sigma, ROWS).astype(int), 1, args.max_new)
    prompts = [list(rng.integers(1, 512, PROMPT_LEN)) for _ in range(ROWS)]
    responses = [list(rng.integers(1, 512, n)) for n in lengths]
    batch = pack_rollouts(prompts, responses, [np.full(n, -6.0) for n in lengths], pad_id=0,
                          length=PROMPT_LEN + args.max_new, rewards=rng.integers(0, 2, ROWS).astype(np.float32))
    model = Decoder(ModelConfig.w_small(), rngs=nnx.Rngs(0))
    print(f"W-small model, {ROWS} rows, prompt {PROMPT_LEN}, responses log-normal mean {args.mean:.0f} (longest "
          f"{lengths.max()}, mean {lengths.mean():.1f}) padded to {batch.length}; jax {jax.__version__}, "
          f"{jax.device_count()} device(s)")
    print("| program | length_bucket | ran at | min s | median s | loss |")
    print("|---|---|---|---|---|---|")
    calls, losses, lengths_run = {}, {}, {}
    for bucket in (None, args.bucket):
        cfg = GRPOConfig(group_size=GROUP, kl_coef=0.04, kl_kind="k3", clip_low=0.2, clip_high=0.2, length_bucket=bucket,
                         optimizer=OptimizerConfig(learning_rate=1e-5))
        learner = GRPOLearner(cfg, model)
        prepared, _ = learner.compute_advantages(batch)
        prepared = prepared.replace(ref_logprobs=np.asarray(learner.logprobs(learner.params, prepared)))
        length = lengths_run[bucket] = learner.trimmed_length(batch.token_mask)
        logprobs = jax.jit(lambda p, t, m, learner=learner, full=batch.length: pad_columns(learner.logprobs_fn(p, t, m), full))
        tokens, mask = jnp.asarray(batch.tokens[:, :length]), jnp.asarray(batch.token_mask[:, :length])
        _, metrics = learner.update(learner.init_state(), prepared)  # compile, and the loss to compare
        losses[bucket] = float(metrics["loss"])
        states = [learner.init_state()]

        def update_step(learner=learner, prepared=prepared, states=states):  # the update donates its state: chain
            states[0], step_metrics = learner.update(states[0], prepared)
            return jax.block_until_ready(step_metrics["loss"])

        calls["ref_logprobs", bucket] = (lambda f=logprobs, p=learner.params, t=tokens, m=mask:
                                         jax.block_until_ready(f(p, t, m)))
        calls["update", bucket] = update_step
    seconds = time_interleaved(calls, args.runs, warmup=1)  # contenders alternate run by run
    for (name, bucket), times in seconds.items():
        print(f"| {name} | {bucket} | {lengths_run[bucket]} | {min(times):.4f} | {statistics.median(times):.4f} | "
              f"{losses[bucket] if name == 'update' else ''} |")
    for name in ("ref_logprobs", "update"):
        ratio = statistics.median(seconds[name, args.bucket]) / statistics.median(seconds[name, None])
        print(f"{name}: bucketed / padded median time = {ratio:.2f}")

if __name__ == "__main__":
    main()
