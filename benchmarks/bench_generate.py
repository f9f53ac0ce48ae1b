"""W-gen (shared/WORKLOADS.md): rollout throughput of our sampler vs a full-recompute loop and transformers.generate.

    python benchmarks/bench_generate.py [--new-tokens 64 256] [--runs 5] [--long-tail-prompts 128]

Part 1, W-gen: the W-small model (random weights, float32), 32 sequences, prompts of 32 tokens, exactly
N new tokens (EOS ignored), greedy and temperature 1.0. Contenders, timed interleaved run by run so that
load from other processes hits all alike:
  * ours        `Sampler.generate` (KV cache, compiled decode loop), after one warm-up (compilation);
  * recompute   a plain loop without a cache: each step a jitted full forward of the sequence so far
                (lengths bucketed by 32 so it compiles a handful of shapes), then argmax / categorical;
  * transformers `generate` on torch CPU with the same weights (our `save_pretrained` -> from_pretrained).
Greedy outputs of all three are checked equal before timing.

Part 2, long tail: many prompts whose response lengths are drawn log-normal (sigma 1, max 8x the mean),
enforced with per-prompt budgets, on 32 slots: continuous batching (`stream`) vs static batching
(`generate_static`, fill all slots, wait for the slowest, refill), same key, same sequences; once per
refill granularity in --long-tail-chunk-steps.

Prints medians (min, max) of the timed runs (--runs for ours, fewer for the slow baselines), tokens/s, and ratios against the baselines of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.hf import save_pretrained

from timing import time_interleaved

BATCH, PROMPT = 32, 32


def _line(name: str, seconds: list[float], tokens: int) -> float:
    median = statistics.median(seconds)
    print(f"  {name:>13}: median {median:8.3f} s (min {min(seconds):.3f}, max {max(seconds):.3f}) "
          f"-> {tokens / median:9.0f} tokens/s")
    return tokens / median


def _fastest_torch_threads(torch, torch_model, cfg) -> int:
    """On a shared, loaded machine torch's spinning OpenMP threads can make 2 threads far slower than 1:
    give transformers whichever count is faster now (short greedy generates, best of 2 each)."""
    ids = torch.from_numpy(np.random.default_rng(9).integers(0, cfg.vocab_size, (BATCH, PROMPT)))
    best = {}
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            with torch.no_grad():
                torch_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - start)
        best[threads] = min(times)
    threads = min(best, key=best.get)
    torch.set_num_threads(threads)
    print("torch threads calibration (s for 8 new tokens): " + ", ".join(f"{t}: {v:.2f}" for t, v in best.items()))
    return threads


def make_recompute_loop(graphdef: nnx.GraphDef):
    """Generation without a KV cache: every step re-runs the whole sequence so far."""

    @jax.jit
    def next_token(params, tokens, length, key, greedy_temperature):
        model = nnx.merge(graphdef, params)
        logits = model(tokens)[jnp.arange(tokens.shape[0]), length - 1]
        greedy, temperature = greedy_temperature
        sampled = jax.random.categorical(key, logits / temperature).astype(jnp.int32)
        return jnp.where(greedy, jnp.argmax(logits, -1).astype(jnp.int32), sampled)

    def generate(params, prompts: np.ndarray, new_tokens: int, key, greedy: bool) -> np.ndarray:
        b, s = prompts.shape
        buffer = jnp.zeros((b, s + new_tokens), jnp.int32).at[:, :s].set(prompts)
        knobs = (jnp.asarray(greedy), jnp.float32(1.0))
        for step in range(new_tokens):
            length = s + step
            width = min(-(-length // 32) * 32, s + new_tokens)  # a few compiled widths, not one per step
            token = next_token(params, buffer[:, :width], jnp.full((b,), length), jax.random.fold_in(key, step), knobs)
            buffer = buffer.at[:, length].set(token)
        return np.asarray(buffer[:, s:])

    def warm(params, prompts: np.ndarray, new_tokens: int) -> None:
        """Compiles every width a run will use, so that timed runs exclude compilation."""
        b, s = prompts.shape
        for width in sorted({min(-(-(s + step) // 32) * 32, s + new_tokens) for step in range(new_tokens)}):
            next_token(params, jnp.zeros((b, width), jnp.int32), jnp.full((b,), s), jax.random.key(0),
                       (jnp.asarray(True), jnp.float32(1.0))).block_until_ready()

    return generate, warm


def part_wgen(args, cfg, graphdef, params, model, torch_model) -> None:
    import torch

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    prompt_list = prompts.tolist()
    recompute, recompute_warm = make_recompute_loop(graphdef)
    for new_tokens in args.new_tokens:
        sampler = Sampler(cfg, graphdef, num_slots=BATCH, max_prompt_len=PROMPT, max_new_tokens=new_tokens,
                          chunk_steps=args.chunk_steps)
        for greedy in (True, False):
            label = "greedy" if greedy else "temperature 1.0"
            sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=greedy, temperature=1.0, ignore_eos=True)
            key = jax.random.key(1)

            def ours():
                return sampler.generate(params, prompt_list, sampling, key=key)

            def plain():
                return recompute(params, prompts, new_tokens, key, greedy)

            def hf():
                with torch.no_grad():
                    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
                    return torch_model.generate(torch.from_numpy(prompts).long(), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                                                **kwargs)

            first = ours()  # compiles
            assert all(c.length == new_tokens for c in first)
            long = new_tokens > 64
            if greedy:  # the contenders agree before they race (recompute only where a run is cheap)
                ours_ids = np.stack([c.response_ids for c in first])
                if not long:
                    np.testing.assert_array_equal(plain(), ours_ids)
                if torch_model is not None:
                    np.testing.assert_array_equal(hf()[:, PROMPT:].numpy(), ours_ids)
            recompute_warm(params, prompts, new_tokens)
            calls = {"ours": ours, "recompute": plain}
            if torch_model is not None:
                calls["transformers"] = hf
            runs = {"ours": args.runs, "recompute": args.recompute_runs_long if long else args.baseline_runs,
                    "transformers": args.transformers_runs_long if long else args.baseline_runs}
            seconds = time_interleaved(calls, runs)
            tokens = BATCH * new_tokens
            print(f"W-gen, {BATCH} x prompt {PROMPT} + {new_tokens} new tokens, {label} "
                  f"(runs: {', '.join(f'{n} {len(s)}' for n, s in seconds.items())}):")
            rates = {name: _line(name, s, tokens) for name, s in seconds.items()}
            ratios = ", ".join(f"{rates['ours'] / rates[n]:.2f}x {n}" for n in rates if n != "ours")
            windows = ", ".join(f"{w}: {n}" for w, n in sorted(sampler.stats.chunks_per_window.items()))
            print(f"  ours / baselines: {ratios};  ours = {statistics.median(seconds['ours']) / new_tokens * 1e3:.2f} "
                  f"ms per token step (decode chunks per attention window so far: {windows})")


def part_long_tail(args, cfg, graphdef, params, chunk_steps: int) -> None:
    rng = np.random.default_rng(1)
    n, mean = args.long_tail_prompts, args.long_tail_mean
    raw = rng.lognormal(0.0, 1.0, n)
    budgets = np.clip(np.round(raw / raw.mean() * mean), 1, 8 * mean).astype(int)
    budgets[np.argmax(raw)] = 8 * mean  # the tail reaches its cap: max = 8 x the target mean
    prompts = rng.integers(0, cfg.vocab_size, (n, PROMPT)).tolist()
    sampler = Sampler(cfg, graphdef, num_slots=BATCH, max_prompt_len=PROMPT, max_new_tokens=8 * mean,
                      chunk_steps=chunk_steps)
    sampling = SamplingConfig(max_new_tokens=8 * mean, temperature=1.0, ignore_eos=True)
    key = jax.random.key(2)
    kwargs = dict(key=key, budgets=budgets.tolist())

    steps = {}

    def counted(name, run):
        def call():
            before = sampler.stats.decode_steps
            out = run()
            steps[name] = sampler.stats.decode_steps - before
            return out
        return call

    continuous = counted("continuous", lambda: list(sampler.stream(params, prompts, sampling, **kwargs)))
    static = counted("static", lambda: sampler.generate_static(params, prompts, sampling, **kwargs))

    streamed, batched = sorted(continuous(), key=lambda c: c.order), static()  # compiles, and checks equality
    assert [c.response_ids.tolist() for c in streamed] == [c.response_ids.tolist() for c in batched]
    waves = [budgets[i:i + BATCH].max() for i in range(0, n, BATCH)]
    print(f"Long tail: {n} prompts on {BATCH} slots, budgets log-normal: mean {budgets.mean():.1f}, "
          f"max {budgets.max()} ({budgets.max() / budgets.mean():.1f}x mean), chunks of {chunk_steps} steps; "
          f"static needs {sum(waves)} steps, the ideal {budgets.sum() / BATCH:.0f}")
    seconds = time_interleaved({"continuous": continuous, "static": static}, args.runs)
    tokens = int(budgets.sum())
    rates = {name: _line(name, s, tokens) for name, s in seconds.items()}
    print(f"  continuous / static: {rates['continuous'] / rates['static']:.2f}x; decode steps run: "
          f"{steps['continuous']} continuous, {steps['static']} static")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--runs", type=int, default=5, help="timed runs of ours and of the long-tail contenders")
    parser.add_argument("--baseline-runs", type=int, default=3, help="timed runs of each baseline at <= 64 new tokens")
    parser.add_argument("--transformers-runs-long", type=int, default=3, help="transformers runs above 64 new tokens")
    parser.add_argument("--recompute-runs-long", type=int, default=1,
                        help="recompute runs above 64 new tokens (quadratic: minutes per run on 2 cores)")
    parser.add_argument("--chunk-steps", type=int, default=16, help="decode steps per compiled chunk (W-gen)")
    parser.add_argument("--long-tail-chunk-steps", type=int, nargs="+", default=[8, 16],
                        help="refill granularity of the long-tail runs, one comparison each")
    parser.add_argument("--long-tail-prompts", type=int, default=128)
    parser.add_argument("--long-tail-mean", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-wgen", action="store_true")
    parser.add_argument("--skip-long-tail", action="store_true")
    args = parser.parse_args()

    cfg = ModelConfig.w_small()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; model {cfg.num_params():,} parameters, float32")
    torch_model = None
    if not args.skip_transformers and not args.skip_wgen:
        import torch
        import transformers

        with tempfile.TemporaryDirectory() as directory:
            save_pretrained(model, cfg, directory)
            torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        threads = _fastest_torch_threads(torch, torch_model, cfg)
        print(f"transformers {transformers.__version__}, torch {torch.__version__}, {threads} threads (the faster here)")
    if not args.skip_wgen:
        part_wgen(args, cfg, graphdef, params, model, torch_model)
    if not args.skip_long_tail:
        for chunk_steps in args.long_tail_chunk_steps:
            part_long_tail(args, cfg, graphdef, params, chunk_steps)


if __name__ == "__main__":
    main()
