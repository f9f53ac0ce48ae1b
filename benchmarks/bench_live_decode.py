"""W-tail with live buckets: generation time when decode chunks run only the running slots, against every slot.

    python benchmarks/bench_live_decode.py [--runs 3] [--mean 32] [--chunk-steps 8]

The W-small model (random weights, float32), prompts of 32 tokens, response budgets log-normal (sigma 1, mean
--mean, max 8x the mean, as W-tail), EOS ignored, temperature 1. Two shapes:
  * step: one RL step's batch, every sequence in its own slot from the start (64 prompts on 64 slots): the
    replica decodes until its longest sequence ends, most slots idle in the tail (W-plan's case);
  * queue: 128 prompts on 32 slots, continuous batching (freed slots refilled while prompts wait).
Each on the contiguous and the paged cache, with live buckets ("live", the default) and without ("every": every
slot decoded every step, the sampler before live buckets). Same key: the sequences are checked equal. Timed
interleaved run by run (load from other processes hits all alike); medians, tokens/s and live / every ratios;
the decoded rows' occupancy (running sequence-steps / rows decoded x steps) and the slots' (/ slots x steps).

`--shapes rows`: what one paged decode step costs on this machine, by rows and window: 1-16 prompts of 32 tokens
decode `--mean` x 4 and x 8 tokens each (no tail), and the difference over the second half's steps gives the ms per
step: its fixed part, and what each row adds at that window.

`--shapes batches`: what a schedule of the tail can save in decode on this machine. The same 256 W-tail sequences
on 16 slots, decoded batch by batch (16 at a time, each batch lasting its longest: a plain RL step's generation)
and as one continuous queue (a freed slot takes the next sequence: what partial rollouts approach once their pool
is full), against the same count of tokens with no tail (every budget at the mean: what no schedule can beat).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
from flax import nnx
from timing import time_interleaved

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig
from rpegjax.models import Decoder, ModelConfig

PROMPT = 32
SHAPES = {"step": (64, 64), "queue": (128, 32)}  # prompts, slots


def tail_budgets(n: int, mean: int, seed: int = 1) -> np.ndarray:
    """W-tail budgets: log-normal (sigma 1) scaled to `mean`, clipped to [1, 8 x mean], the longest at the cap."""
    raw = np.random.default_rng(seed).lognormal(0.0, 1.0, n)
    budgets = np.clip(np.round(raw / raw.mean() * mean), 1, 8 * mean).astype(int)
    budgets[np.argmax(raw)] = 8 * mean
    return budgets


def run_shape(args, cfg, graphdef, params, name: str) -> None:
    prompts_count, slots = SHAPES[name]
    budgets = tail_budgets(prompts_count, args.mean)
    prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (prompts_count, PROMPT)).tolist()
    sampling = SamplingConfig(max_new_tokens=8 * args.mean, temperature=1.0, ignore_eos=True)
    shape = dict(num_slots=slots, max_prompt_len=PROMPT, max_new_tokens=8 * args.mean, chunk_steps=args.chunk_steps)
    layouts = {"contiguous": None, "paged": CacheConfig.paged(page_size=args.page_size)}
    samplers = {f"{layout} {mode}": Sampler(cfg, graphdef, **shape, cache=cache, live_buckets=mode == "live")
                for layout, cache in layouts.items() for mode in ("live", "every")}
    kwargs = dict(key=jax.random.key(3), budgets=budgets.tolist())
    calls = {label: (lambda s=sampler: s.generate(params, prompts, sampling, **kwargs))
             for label, sampler in samplers.items()}
    outputs = {label: call() for label, call in calls.items()}  # compiles every program; checks equality
    reference = [c.response_ids.tolist() for c in outputs["contiguous every"]]
    for label, out in outputs.items():
        assert [c.response_ids.tolist() for c in out] == reference, f"{label}: other sequences than contiguous every"
    tokens = int(budgets.sum())
    print(f"{name}: {prompts_count} prompts on {slots} slots, budgets mean {budgets.mean():.1f}, max {budgets.max()}, "
          f"chunks of {args.chunk_steps} steps; {tokens} tokens")
    before = {label: sampler.stats.decoded_row_steps for label, sampler in samplers.items()}
    seconds = time_interleaved(calls, args.runs)
    rates = {}
    for label, values in seconds.items():
        stats = samplers[label].stats
        median = statistics.median(values)
        rates[label] = tokens / median
        print(f"  {label:>16}: median {median:7.3f} s (min {min(values):.3f}, max {max(values):.3f}) -> "
              f"{rates[label]:7.0f} tokens/s; rows decoded busy {100 * stats.bucket_occupancy():5.1f}%, "
              f"slots busy {100 * stats.slot_occupancy():5.1f}%; "
              f"{(stats.decoded_row_steps - before[label]) // args.runs} row-steps per run")
    for layout in layouts:
        print(f"  {layout}: live / every {rates[f'{layout} live'] / rates[f'{layout} every']:.2f}x")


def run_rows(args, cfg, graphdef, params) -> None:
    """ms per paged decode step by rows: the second half of 8 x mean new tokens (contexts of 32 + 4..8 x mean)."""
    budget = 8 * args.mean
    sampler = Sampler(cfg, graphdef, num_slots=16, max_prompt_len=PROMPT, max_new_tokens=budget,
                      chunk_steps=args.chunk_steps, cache=CacheConfig.paged(page_size=args.page_size))
    sampling = SamplingConfig(max_new_tokens=budget, temperature=1.0, ignore_eos=True)
    prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (16, PROMPT)).tolist()
    calls = {(rows, n): (lambda rows=rows, n=n: sampler.generate(params, prompts[:rows], sampling,
                                                                 key=jax.random.key(3), budgets=[n] * rows))
             for rows in (1, 2, 4, 8, 16) for n in (budget // 2, budget)}
    seconds = time_interleaved(calls, args.runs, warmup=1)
    print(f"rows: ms per decode step over contexts {PROMPT + budget // 2}..{PROMPT + budget} (medians of {args.runs})")
    for rows in (1, 2, 4, 8, 16):
        short, long = (statistics.median(seconds[(rows, n)]) for n in (budget // 2, budget))
        step = (long - short) / (budget // 2) * 1e3
        print(f"  {rows:2d} rows: {step:6.3f} ms a step, {step / rows:6.3f} ms a row-step")


def run_batches(args, cfg, graphdef, params) -> None:
    """Seconds to decode the same W-tail sequences batch by batch and as one queue, and without a tail."""
    batches, slots = 16, 16
    budgets = tail_budgets(batches * slots, args.mean)
    flat = np.full_like(budgets, round(float(budgets.mean())))
    prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (batches * slots, PROMPT)).tolist()
    sampler = Sampler(cfg, graphdef, num_slots=slots, max_prompt_len=PROMPT, max_new_tokens=8 * args.mean,
                      chunk_steps=args.chunk_steps, cache=CacheConfig.paged(page_size=args.page_size))
    sampling = SamplingConfig(max_new_tokens=8 * args.mean, temperature=1.0, ignore_eos=True)

    def by_batch(table):
        return lambda: [sampler.generate(params, prompts[i: i + slots], sampling, key=jax.random.key(3),
                                         budgets=table[i: i + slots].tolist()) for i in range(0, len(table), slots)]

    calls = {"batch by batch": by_batch(budgets), "one queue": lambda: sampler.generate(
        params, prompts, sampling, key=jax.random.key(3), budgets=budgets.tolist()), "no tail": by_batch(flat)}
    seconds = time_interleaved(calls, args.runs, warmup=1)
    base = statistics.median(seconds["batch by batch"])
    print(f"batches: {batches} x {slots} W-tail sequences on {slots} slots, budgets mean {budgets.mean():.1f}, max "
          f"{budgets.max()}, {budgets.sum()} tokens (no tail: {flat.sum()}); medians of {args.runs}")
    for label, values in seconds.items():
        median = statistics.median(values)
        print(f"  {label:>14}: {median:7.3f} s, batch by batch / this {base / median:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mean", type=int, default=32, help="mean response budget (max 8x)")
    parser.add_argument("--chunk-steps", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=[*SHAPES, "rows", "batches"])
    args = parser.parse_args()
    cfg = ModelConfig.w_small()
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; model {cfg.num_params():,} parameters, float32")
    parts = {"rows": run_rows, "batches": run_batches}  # the parts that are not a shape of `run_shape`
    for name in args.shapes:
        if name in parts:
            parts[name](args, cfg, graphdef, params)
        else:
            run_shape(args, cfg, graphdef, params, name)


if __name__ == "__main__":
    main()
