"""W-gen and W-tail (shared/WORKLOADS.md): rollout throughput of our sampler vs a full-recompute loop and
transformers.generate; KV memory of the paged cache vs the static layout on a long tail.

    python benchmarks/bench_generate.py [--new-tokens 64 256] [--runs 5] [--long-tail-prompts 128] [--cpu-time]

Part 1, W-gen: the W-small model (random weights, float32), 32 sequences, prompts of 32 tokens, exactly
N new tokens (EOS ignored), greedy and temperature 1.0. Contenders, timed interleaved run by run so that
load from other processes hits all alike:
  * ours        `Sampler.generate` (KV cache, compiled decode loop), after one warm-up (compilation), with
                the contiguous cache (today's layout, "before") and the paged cache ("paged", "after");
  * recompute   a plain loop without a cache: each step a jitted full forward of the sequence so far
                (lengths bucketed by 32 so it compiles a handful of shapes), then argmax / categorical;
  * transformers `generate` on torch CPU with the same weights (our `save_pretrained` -> from_pretrained);
  * matmul floor  only the weight matmuls of the same steps in one compiled loop (no attention, cache or
                sampling): a lower bound on any decoder's time on this machine, hence an upper bound on the
                ratio any implementation can reach against the baselines; "floor + prompts" adds the prompts'
                matmuls (32 x 32 tokens, the prefill's), which every `generate` also runs; "floor + cache reads"
                adds to each step a read of every row's cached keys and values (prompt and earlier tokens), which
                every decoder with a KV cache also does: beyond the last-level cache together with the weights,
                it is the bound a KV-cache decoder can reach on this machine.
Greedy outputs of ours, recompute and transformers are checked equal before timing.

Part 2, W-tail: many prompts whose response lengths are drawn log-normal (sigma 1, max 8x the mean),
enforced with per-prompt budgets, on 32 slots: continuous batching (`stream`) vs static batching
(`generate_static`, fill all slots, wait for the slowest, refill), and continuous batching on the paged
cache with a pool of --tail-pool-tokens-per-slot x 32 tokens; same key, same sequences; once per refill
granularity in --long-tail-chunk-steps. KV memory, time-averaged over decode steps: tokens reserved
(static: slots x capacity; paged: the whole pool, and the pages held by sequences) over tokens cached.

Prints medians (min, max) of the timed runs (--runs for ours, fewer for the slow baselines), tokens/s, and ratios against the baselines of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import time_interleaved

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.generate.paged_cache import CacheConfig, kv_bytes_per_token
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.hf import save_pretrained

BATCH, PROMPT = 32, 32
FLOOR_READS = "floor + cache reads"
READ_SEGMENT = 16  # steps per segment of the "floor + cache reads" contender (its cache grows by segment)


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


def make_matmul_floor(cfg: ModelConfig, rows: int, prompt: int = 0, cache_reads: int = 0):
    """A lower bound on any decoder's step time on this machine: only the step's weight matmuls (`rows` tokens
    through every layer's projections, fused q|k|v and gate|up, and the output layer), `steps` steps in one
    compiled loop; no attention, no cache, no sampling. With `prompt` > 0 the prompts' matmuls come first (rows x
    prompt tokens through every layer, the output layer for the last token only), as a prefill does: the bound
    for a whole `generate` (prompts in). With `cache_reads` = the prompt length, every step also reads each row's
    cached keys and values once per layer (a sum weighted by the step's own projections, so it stays in the step),
    as any decoder with a KV cache must: the prompt and the tokens before the step, counted per READ_SEGMENT steps
    at the segment's first step (fewer bytes than a decoder reads, so still a bound), beside the weights in the
    same caches. Returns `run(steps)` and the matmul FLOPs per step (the prompts' not in)."""
    d, f, v, e = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    qkv, heads = (cfg.num_heads + 2 * cfg.num_kv_heads) * e, cfg.num_heads * e
    keys = iter(jax.random.split(jax.random.key(0), 4 * cfg.num_layers + 2))
    layers = [{name: jax.random.normal(next(keys), shape) * 0.02
               for name, shape in (("qkv", (d, qkv)), ("o", (heads, d)), ("gate_up", (d, 2 * f)), ("down", (f, d)))}
              for _ in range(cfg.num_layers)]
    head = jax.random.normal(next(keys), (d, v)) * 0.02
    cache_key = next(keys)

    def through_layers(x, cache=None):
        for index, layer in enumerate(layers):
            y = x @ layer["qkv"]
            if cache is not None:  # this layer's keys and values [rows, kv, 2e, positions], each read once
                y = y + 1e-9 * jnp.sum(cache[index] * y[:, None, : 2 * e, None])
            x = x + y[:, :heads] @ layer["o"]
            gate_up = x @ layer["gate_up"]
            x = x + (jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]) @ layer["down"]
        return x

    def steps_loop(x, steps, cache=None):
        def body(_, x):
            x = through_layers(x, cache)
            return x + 1e-3 * (x @ head)[:, :1]  # the output layer's result feeds the next step
        return jax.lax.fori_loop(0, steps, body, x)

    @partial(jax.jit, static_argnums=1)
    def loop(x, steps, cache):
        if prompt:  # the prompts' tokens, then each row's last one feeds the first step
            x = through_layers(jnp.repeat(x, prompt, axis=0)).reshape(rows, prompt, d)[:, -1]
        if not cache_reads:
            return steps_loop(x, steps)
        for start, segment in zip(range(0, steps, READ_SEGMENT), cache, strict=True):  # one loop per segment
            x = steps_loop(x, min(READ_SEGMENT, steps - start), segment)
        return x

    x = jnp.ones((rows, d), jnp.float32)
    caches = {}  # per step count: each segment's [layers, rows, kv, 2e, positions], made outside the timed call

    def run(steps):
        if cache_reads and steps not in caches:
            caches[steps] = tuple(
                jax.random.normal(jax.random.fold_in(cache_key, start),
                                  (cfg.num_layers, rows, cfg.num_kv_heads, 2 * e, cache_reads + start))
                for start in range(0, steps, READ_SEGMENT))
        return loop(x, steps, caches.get(steps)).block_until_ready()

    flops = 2 * rows * (cfg.num_layers * (d * qkv + heads * d + 3 * d * f) + d * v)
    return run, flops


def part_wgen(args, cfg, graphdef, params, model, torch_model) -> None:
    import torch

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    prompt_list = prompts.tolist()
    recompute, recompute_warm = make_recompute_loop(graphdef)
    floor, floor_flops = make_matmul_floor(cfg, BATCH)
    prompted_floor, _ = make_matmul_floor(cfg, BATCH, prompt=PROMPT)
    read_floor, _ = make_matmul_floor(cfg, BATCH, cache_reads=PROMPT)
    for new_tokens in args.new_tokens:
        shape = dict(num_slots=BATCH, max_prompt_len=PROMPT, max_new_tokens=new_tokens, chunk_steps=args.chunk_steps)
        sampler = Sampler(cfg, graphdef, **shape)
        paged = Sampler(cfg, graphdef, **shape, cache=CacheConfig.paged(page_size=args.page_size))
        for greedy in (True, False):
            label = "greedy" if greedy else "temperature 1.0"
            sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=greedy, temperature=1.0, ignore_eos=True)
            key = jax.random.key(1)

            def ours():
                return sampler.generate(params, prompt_list, sampling, key=key)

            def ours_paged():
                return paged.generate(params, prompt_list, sampling, key=key)

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
            first_paged = ours_paged()
            assert [c.response_ids.tolist() for c in first_paged] == [c.response_ids.tolist() for c in first]
            long = new_tokens > 64
            if greedy:  # the contenders agree before they race (recompute only where a run is cheap)
                ours_ids = np.stack([c.response_ids for c in first])
                if not long:
                    np.testing.assert_array_equal(plain(), ours_ids)
                if torch_model is not None:
                    np.testing.assert_array_equal(hf()[:, PROMPT:].numpy(), ours_ids)
            recompute_warm(params, prompts, new_tokens)
            floor(new_tokens)  # compiles
            prompted_floor(new_tokens)
            read_floor(new_tokens)

            def matmuls():
                return floor(new_tokens)

            def prompted_matmuls():
                return prompted_floor(new_tokens)

            def matmuls_and_reads():
                return read_floor(new_tokens)

            calls = {"ours": ours, "paged": ours_paged, "recompute": plain, "matmul floor": matmuls,
                     "floor + prompts": prompted_matmuls, FLOOR_READS: matmuls_and_reads}
            if torch_model is not None:
                calls["transformers"] = hf
            runs = {"ours": args.runs, "paged": args.runs, "matmul floor": args.runs, "floor + prompts": args.runs,
                    FLOOR_READS: args.runs,
                    "recompute": args.recompute_runs_long if long else args.baseline_runs,
                    "transformers": args.transformers_runs_long if long else args.baseline_runs}
            calls = {name: call for name, call in calls.items() if runs[name] > 0}  # a count of 0 skips one
            seconds = time_interleaved(calls, runs, clock=time.process_time if args.cpu_time else time.perf_counter)
            tokens = BATCH * new_tokens
            print(f"W-gen, {BATCH} x prompt {PROMPT} + {new_tokens} new tokens, {label} "
                  f"(runs: {', '.join(f'{n} {len(s)}' for n, s in seconds.items())}):")
            rates = {name: _line(name, s, tokens) for name, s in seconds.items()}
            baselines = [n for n in rates if n not in ("ours", "paged", "matmul floor", "floor + prompts", FLOOR_READS)]
            ratios = ", ".join(f"{rates['ours'] / rates[n]:.2f}x {n}" for n in baselines)
            ratios += "; paged / ours (after / before): " + f"{rates['paged'] / rates['ours']:.3f}"
            ratios += "; paged / baselines: " + ", ".join(f"{rates['paged'] / rates[n]:.2f}x {n}" for n in baselines)
            floor_step = statistics.median(seconds["matmul floor"]) / new_tokens
            ceiling = ", ".join(f"{rates['matmul floor'] / rates[n]:.2f}x {n}" for n in baselines)
            print(f"  matmul floor: {floor_step * 1e3:.2f} ms per step ({floor_flops / floor_step / 1e9:.1f} GFLOP/s); "
                  f"ours runs at {rates['ours'] / rates['matmul floor']:.2f} of it (paged "
                  f"{rates['paged'] / rates['matmul floor']:.2f}), at {rates['ours'] / rates['floor + prompts']:.2f} of "
                  f"the floor with the prompts' matmuls (paged {rates['paged'] / rates['floor + prompts']:.2f}); no "
                  f"decoder can beat the floor, "
                  f"so the most any can reach here is {ceiling}")
            print(f"  {FLOOR_READS}: {statistics.median(seconds[FLOOR_READS]) / new_tokens * 1e3:.2f} ms per step, "
                  f"{rates[FLOOR_READS] / rates['matmul floor']:.2f} of the matmul floor (the most a decoder that "
                  f"reads its cache reaches); ours at {rates['ours'] / rates[FLOOR_READS]:.2f} of it (paged "
                  f"{rates['paged'] / rates[FLOOR_READS]:.2f})")
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
    shape = dict(num_slots=BATCH, max_prompt_len=PROMPT, max_new_tokens=8 * mean, chunk_steps=chunk_steps)
    sampler = Sampler(cfg, graphdef, **shape)
    pool_pages = -(-args.tail_pool_tokens_per_slot * BATCH // args.page_size)
    paged = Sampler(cfg, graphdef, **shape, cache=CacheConfig.paged(page_size=args.page_size,
                                                                    pages_per_replica=pool_pages))
    sampling = SamplingConfig(max_new_tokens=8 * mean, temperature=1.0, ignore_eos=True)
    key = jax.random.key(2)
    kwargs = dict(key=key, budgets=budgets.tolist())

    steps, memory = {}, {}

    def counted(name, run, which):
        def call():
            stats = which.stats
            before = stats.decode_steps, stats.reserved_token_steps, stats.cached_token_steps, stats.preemptions
            out = run()
            steps[name] = stats.decode_steps - before[0]
            memory[name] = (stats.reserved_token_steps - before[1], stats.cached_token_steps - before[2],
                            stats.preemptions - before[3])
            return out
        return call

    continuous = counted("continuous", lambda: list(sampler.stream(params, prompts, sampling, **kwargs)), sampler)
    static = counted("static", lambda: sampler.generate_static(params, prompts, sampling, **kwargs), sampler)
    paged_run = counted("paged", lambda: list(paged.stream(params, prompts, sampling, **kwargs)), paged)

    streamed, batched = sorted(continuous(), key=lambda c: c.order), static()  # compiles, and checks equality
    assert [c.response_ids.tolist() for c in streamed] == [c.response_ids.tolist() for c in batched]
    paged_out = sorted(paged_run(), key=lambda c: c.order)
    assert [c.response_ids.tolist() for c in paged_out] == [c.response_ids.tolist() for c in batched]
    waves = [budgets[i:i + BATCH].max() for i in range(0, n, BATCH)]
    print(f"W-tail: {n} prompts on {BATCH} slots, budgets log-normal: mean {budgets.mean():.1f}, "
          f"max {budgets.max()} ({budgets.max() / budgets.mean():.1f}x mean), chunks of {chunk_steps} steps; "
          f"static needs {sum(waves)} steps, the ideal {budgets.sum() / BATCH:.0f}")
    seconds = time_interleaved({"continuous": continuous, "static": static, "paged": paged_run}, args.runs)
    tokens = int(budgets.sum())
    rates = {name: _line(name, s, tokens) for name, s in seconds.items()}
    print(f"  continuous / static: {rates['continuous'] / rates['static']:.2f}x; paged / continuous: "
          f"{rates['paged'] / rates['continuous']:.3f}; decode steps run: {steps['continuous']} continuous, "
          f"{steps['static']} static, {steps['paged']} paged")
    # KV memory, time-averaged over the decode steps of the last timed run of each
    per_token = kv_bytes_per_token(cfg)
    static_reserved, static_cached, _ = memory["continuous"]
    held, paged_cached, preemptions = memory["paged"]
    static_tokens = static_reserved / steps["continuous"]
    pool_tokens = pool_pages * args.page_size
    paged_cached_tokens = paged_cached / steps["paged"]
    print(f"  KV memory (time-averaged, {per_token} bytes per token):")
    print(f"    static layout: reserved {static_tokens * per_token / 2**20:8.2f} MiB, cached "
          f"{static_cached / steps['continuous'] * per_token / 2**20:8.2f} MiB -> reserved / cached "
          f"{static_reserved / static_cached:.2f}x")
    print(f"    paged, pool {pool_pages} pages of {args.page_size}: reserved (pool) {pool_tokens * per_token / 2**20:8.2f} MiB, "
          f"pages held {held / steps['paged'] * per_token / 2**20:8.2f} MiB, cached "
          f"{paged_cached_tokens * per_token / 2**20:8.2f} MiB -> pool / cached {pool_tokens / paged_cached_tokens:.2f}x, "
          f"held / cached {held / paged_cached:.2f}x; {preemptions} preemptions")
    print(f"    static reserved / paged pool: {static_tokens / pool_tokens:.2f}x")


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
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page of the paged cache")
    parser.add_argument("--tail-pool-tokens-per-slot", type=int, default=80,
                        help="W-tail paged pool: this many tokens per slot (static reserves prompt + 8 x mean)")
    parser.add_argument("--cpu-time", action="store_true", help="W-gen: time this process's CPU seconds instead of "
                        "wall seconds (on a loaded machine, waits for a core left out; torch's threads count too)")
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
