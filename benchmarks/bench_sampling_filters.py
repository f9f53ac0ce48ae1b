"""The sampler alone with top-k and top-p on, before and after its filters rank only the top-k (interleaved, one
process): before, every decode step sorted the whole vocabulary (`lax.top_k(logits, vocab)`) and took top-p's
softmax and prefix sum over it; after, `lax.top_k(logits, k)` and top-p over those k (`sampling.kept_threshold`).
32 rows, 16 draws in a loop (the decode chunk's steps), float32 logits that change with each draw.

    python benchmarks/bench_sampling_filters.py [--runs 7] [--vocab 512 151936] [--top-k 50] [--top-p 0.9]

Prints the medians and before / after (above 1: the change is faster). Same-run ratios; the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_interleaved  # noqa: E402

from rpegjax.generate import sampling as sampling_module  # noqa: E402
from rpegjax.generate.sampling import SamplingConfig, sample_tokens, sampling_arrays  # noqa: E402

ROWS, STEPS = 32, 16


def full_sort_threshold(logits, *, top_k=0, top_p=None, min_p=None):
    """Before: `sampling.kept_threshold` sorting the whole vocabulary whatever top-k is."""
    if not top_k and top_p is None and min_p is None:
        return None
    vocab = logits.shape[-1]
    sorted_logits = jax.lax.top_k(logits, vocab)[0]
    ranks = jnp.arange(vocab)
    kept = jnp.full(logits.shape[:-1], vocab, jnp.int32)
    if top_k:
        kept = jnp.minimum(kept, top_k)
    if top_p is not None:
        probs = jax.nn.softmax(jnp.where(ranks < kept[:, None], sorted_logits, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.minimum(kept, jnp.maximum(jnp.sum(mass_before < top_p, axis=-1), 1))
    if min_p is not None:
        relative = sorted_logits - sorted_logits[:, :1]
        kept = jnp.minimum(kept, jnp.maximum(jnp.sum(relative >= jnp.log(min_p), axis=-1), 1))
    return jnp.take_along_axis(sorted_logits, (kept - 1)[:, None], axis=-1)


def sampler_loop(vocab: int, config: SamplingConfig, full_sort: bool):
    """STEPS draws of ROWS tokens, compiled with the filters of before (`full_sort`) or of now; returns the call and
    its drawn tokens' sum (both versions must draw the same)."""
    sampling = sampling_arrays(config, vocab_size=vocab, default_eos_id=None)

    def run(logits, key):
        def step(i, carry):
            logits, total = carry
            keys = jax.random.split(jax.random.fold_in(key, i), ROWS)
            tokens, _ = sample_tokens(logits, keys, sampling)
            return logits + 1e-3 * tokens[:, None], total + tokens.sum()

        return jax.lax.fori_loop(0, STEPS, step, (logits, jnp.int32(0)))[1]

    logits, key = 3 * jax.random.normal(jax.random.key(5), (ROWS, vocab)), jax.random.key(6)
    saved = sampling_module.kept_threshold
    if full_sort:
        sampling_module.kept_threshold = full_sort_threshold
    try:
        compiled = jax.jit(run).lower(logits, key).compile()
    finally:
        sampling_module.kept_threshold = saved
    return (lambda: compiled(logits, key).block_until_ready()), int(compiled(logits, key))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 151936], help="W-small's, Qwen2.5's")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    config = SamplingConfig(max_new_tokens=STEPS, top_k=args.top_k, top_p=args.top_p)
    calls, parts = {}, []
    for vocab in args.vocab:
        part = f"v{vocab} top-k {args.top_k} top-p {args.top_p}"
        parts.append(part)
        drawn = {}
        for full_sort in (True, False):
            tag = "before" if full_sort else "after"
            calls[f"{part} {tag}"], drawn[tag] = sampler_loop(vocab, config, full_sort)
        if drawn["before"] != drawn["after"]:
            raise RuntimeError(f"{part}: before and after drew different tokens ({drawn})")
    seconds = time_interleaved(calls, args.runs, warmup=1)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, median in medians.items():
        print(f"{name:<40} median {median * 1e3:9.2f} ms (min {min(seconds[name]) * 1e3:.2f}, "
              f"max {max(seconds[name]) * 1e3:.2f})")
    print("(wall seconds)")
    for part in parts:
        print(f"{part}: before / after {medians[f'{part} before'] / medians[f'{part} after']:.2f}")


if __name__ == "__main__":
    main()
