"""Op-level changes of the W-small step, before and after, interleaved in one process (W-small shapes, float32):

  * projections: a layer's q, k, v and gate, up projections as five matmuls (before) or two, against the kernels
    side by side (after, `Attention._project_qkv` / `MLP`): the training rows (32 x 96 tokens, forward and
    backward) and a decode step's rows (32, forward, 16 steps in a loop as the decode chunk runs them);
  * paged attention: one decode token per row over its gathered pages, transposed to [b k w*n e] first (before)
    or in the gathered layout (after, `full_attention.attend_pages`), 16 steps in a loop;
  * full bucket: a contiguous decode chunk (`generate.decode.decode`, W-gen's 32 rows all running, 16 steps) whose
    live rows are gathered from the slots and scattered back (before) or, every slot in slot order, sliced and
    written back in place (after, `live_rows.take_rows` / `put_rows`), at attention windows 96 and 288 (W-gen's
    capacity at 64 and 256 new tokens), greedy and at temperature 1;
  * sampling: temperature-1 tokens by Gumbel-max (`jax.random.categorical`: v uniforms and 2 v logarithms per row,
    before) or by two-level inverse CDF on the log-prob's own exponentials (after, `sampling.sample_tokens`):
    the sampler alone on 32 rows of W-small's vocabulary (16 steps in a loop), and the real decode chunk of 32
    running rows (16 steps) at windows 96 and 288;
  * wgen: W-gen's whole `Sampler.generate` at temperature 1 (32 x 32-token prompts, `--new-tokens`, contiguous and
    paged cache) with either sampler, beside the matmul floor (`bench_generate.make_matmul_floor`) of the same run.

    python benchmarks/bench_fused_ops.py [--runs 7] [--cpu-time] [--parts projections paged bucket sampling wgen] \
        [--new-tokens 64 256]

Prints the medians and before / after (above 1: the change is faster). Same-run ratios; the machine is shared.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import make_matmul_floor  # noqa: E402
from timing import time_interleaved  # noqa: E402

from flax import nnx  # noqa: E402

from rpegjax.generate import Sampler, SamplingConfig  # noqa: E402
from rpegjax.generate import decode as decode_module  # noqa: E402
from rpegjax.generate import live_rows as live_module  # noqa: E402
from rpegjax.generate.decode import DecodeState  # noqa: E402
from rpegjax.generate.paged_cache import CacheConfig  # noqa: E402
from rpegjax.generate.sampling import filter_logits, sample_tokens, sampling_arrays  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402
from rpegjax.models.full_attention import attend_pages, cached_attention  # noqa: E402

STEPS = 16


def projections(cfg: ModelConfig, fused: bool):
    """x [n d] -> sum of q, k, v, gate and up outputs (a scalar, so that a gradient can be taken)."""
    d, h, kv, e, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    g = h // kv

    def apply(weights, x):
        wq, wk, wv, wg, wu = weights
        if fused:
            qkv = jnp.concatenate([wq.reshape(d, kv, g, e), wk[:, :, None], wv[:, :, None]], axis=2)
            y = (x @ qkv.reshape(d, -1)).reshape(-1, kv, g + 2, e)
            gate_up = (x @ jnp.stack([wg, wu], axis=1).reshape(d, -1)).reshape(-1, 2, f)
            return y[:, :, :g].sum() + y[:, :, g].sum() + y[:, :, g + 1].sum() + (gate_up[:, 0] * gate_up[:, 1]).sum()
        q, k, v = (x @ w.reshape(d, -1) for w in (wq, wk, wv))
        return q.sum() + k.sum() + v.sum() + ((x @ wg) * (x @ wu)).sum()

    return apply


def weights_of(cfg: ModelConfig):
    d, h, kv, e, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    keys = jax.random.split(jax.random.key(0), 5)
    shapes = ((d, h, e), (d, kv, e), (d, kv, e), (d, f), (d, f))
    return tuple(jax.random.normal(k, s) / math.sqrt(d) for k, s in zip(keys, shapes, strict=True))


def paged_attention(cfg: ModelConfig, rows: int, pages: int, page_size: int, in_place: bool):
    """STEPS decode steps of one layer's attention over `pages` gathered pages per row."""
    kv, e, h = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads

    @jax.jit
    def run(pool_k, pool_v, table, q, positions):
        def step(i, out):
            qi = q + 1e-3 * out  # each step depends on the last, as in the decode loop
            keys, values = pool_k[:, table], pool_v[:, table]  # k b w n e (the pool's layout, KV head first)
            if in_place:
                return attend_pages(qi, keys, values, positions)
            flat = [x.transpose(1, 0, 2, 3, 4).reshape(rows, kv, pages * page_size, e) for x in (keys, values)]
            return cached_attention(qi, *flat, positions)

        return jax.lax.fori_loop(0, STEPS, step, jnp.zeros((rows, 1, h, e)))

    keys = jax.random.split(jax.random.key(1), 3)
    pool = (kv, rows * pages, page_size, e)
    args = (jax.random.normal(keys[0], pool), jax.random.normal(keys[1], pool),
            jnp.arange(rows * pages).reshape(rows, pages), jax.random.normal(keys[2], (rows, 1, h, e)),
            jnp.full((rows, 1), pages * page_size - 3))
    return lambda: run(*args).block_until_ready()


def _gathered_rows(x, live, window=None):
    """Before: `live_rows.take_rows` as a gather whatever the bucket."""
    r, q = live.shape
    blocks = x.reshape(r, x.shape[0] // r, *x.shape[1:])
    blocks = blocks if window is None else blocks[:, :, :, :window]
    taken = jax.vmap(lambda block, rows: block[rows])(blocks, live)
    return taken.reshape(r * q, *taken.shape[2:])


def _scattered_rows(x, live, new, window=None):
    """Before: `live_rows.put_rows` as a scatter whatever the bucket."""
    r, q = live.shape
    blocks, parts = x.reshape(r, x.shape[0] // r, *x.shape[1:]), new.reshape(r, q, *new.shape[1:])

    def put(block, rows, part):
        return block.at[rows].set(part) if window is None else block.at[rows, :, :window].set(part)

    return jax.vmap(put)(blocks, live, parts).reshape(x.shape)


def gumbel_sample_tokens(logits, keys, sampling):
    """Before: `sampling.sample_tokens` by Gumbel-max over the filtered logits, log-probs from log_softmax."""
    logits = logits.astype(jnp.float32)
    scaled = logits / sampling.temperature
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        filtered = filter_logits(scaled, top_k=sampling.top_k,
                                 top_p=sampling.top_p if sampling.filter_top_p else None,
                                 min_p=sampling.min_p if sampling.filter_min_p else None)
        tokens = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def sampler_loop(cfg: ModelConfig, rows: int, inverse_cdf: bool):
    """STEPS temperature-1 draws of `rows` tokens from logits that change with each draw."""
    sample = sample_tokens if inverse_cdf else gumbel_sample_tokens
    sampling = sampling_arrays(SamplingConfig(max_new_tokens=STEPS), vocab_size=cfg.vocab_size, default_eos_id=None)

    @jax.jit
    def run(logits, key):
        def step(i, carry):
            logits, total = carry
            keys = jax.random.split(jax.random.fold_in(key, i), rows)
            tokens, logprobs = sample(logits, keys, sampling)
            return logits + 1e-3 * tokens[:, None], total + logprobs.sum()

        return jax.lax.fori_loop(0, STEPS, step, (logits, jnp.float32(0)))[1]

    logits = 3 * jax.random.normal(jax.random.key(5), (rows, cfg.vocab_size))
    return lambda: run(logits, jax.random.key(6)).block_until_ready()


def full_bucket_chunk(cfg: ModelConfig, window: int, greedy: bool, sliced: bool, inverse_cdf: bool = True):
    """One decode chunk of STEPS steps on 32 running slots (every slot: a full bucket) attending to `window` cache
    positions of a cache of `window` positions (rows at window - STEPS - 1 cached tokens, random cache contents)."""
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    rows = 32
    sampling = sampling_arrays(SamplingConfig(max_new_tokens=window, greedy=greedy, temperature=1.0, ignore_eos=True),
                               vocab_size=cfg.vocab_size, default_eos_id=None)
    state = DecodeState.empty(cfg, rows, window, window)
    keys = iter(jax.random.split(jax.random.key(4), 2 * cfg.num_layers))
    layers = tuple(layer.replace(k=jax.random.normal(next(keys), layer.k.shape),
                                 v=jax.random.normal(next(keys), layer.v.shape)) for layer in state.cache.layers)
    cache = state.cache.replace(layers=layers, lengths=jnp.full((rows,), window - STEPS - 1, jnp.int32))
    state = state.replace(cache=cache, done=jnp.zeros((rows,), bool), budget=jnp.full((rows,), window, jnp.int32),
                          prompt_index=jnp.arange(rows, dtype=jnp.int32))
    every = jnp.asarray(live_module.live_rows(range(rows), num_slots=rows, replicas=1))
    run = jax.jit(lambda state: decode_module.decode(graphdef, params, state, every, jax.random.key(1), sampling,
                                              jnp.int32(STEPS), window=window - 1))  # < capacity: the windowed path
    if not inverse_cdf:  # trace (once, now) with the Gumbel-max sampler of before
        saved_sampler, decode_module.sample_tokens = decode_module.sample_tokens, gumbel_sample_tokens
        try:
            run = run.lower(state).compile()
        finally:
            decode_module.sample_tokens = saved_sampler
    if not sliced:  # trace (once, now) with the gather and scatter of before
        saved = (live_module.take_rows, live_module.put_rows, decode_module.take_rows, decode_module.put_rows)
        live_module.take_rows = decode_module.take_rows = _gathered_rows
        live_module.put_rows = decode_module.put_rows = _scattered_rows
        try:
            run = run.lower(state).compile()
        finally:
            live_module.take_rows, live_module.put_rows, decode_module.take_rows, decode_module.put_rows = saved
    return lambda: jax.block_until_ready(run(state))


def wgen_calls(cfg: ModelConfig, new_tokens: int) -> dict:
    """W-gen at temperature 1, Gumbel-max (before) and inverse CDF (after), both cache layouts, and its floor."""
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    prompts = jax.random.randint(jax.random.key(0), (32, 32), 0, cfg.vocab_size).tolist()
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    shape = dict(num_slots=32, max_prompt_len=32, max_new_tokens=new_tokens, chunk_steps=16)
    calls, drawn = {}, {}
    for layout, cache in (("contiguous", None), ("paged", CacheConfig.paged(page_size=16))):
        for inverse_cdf in (False, True):
            sampler = Sampler(cfg, graphdef, **shape, cache=cache)
            run = (lambda s=sampler: s.generate(params, prompts, sampling, key=jax.random.key(1)))
            saved = decode_module.sample_tokens
            decode_module.sample_tokens = sample_tokens if inverse_cdf else gumbel_sample_tokens
            try:  # compiles every program this generate runs, with this sampler
                drawn[inverse_cdf] = [c.response_ids.tolist() for c in run()]
            finally:
                decode_module.sample_tokens = saved
            calls[f"wgen {new_tokens} {layout} {'after' if inverse_cdf else 'before'}"] = run
        if drawn[False] == drawn[True]:  # each sampler compiled its own programs: the draws differ
            raise RuntimeError(f"wgen {layout}: the two samplers drew the same tokens (a shared compiled program?)")
    floor, _ = make_matmul_floor(cfg, 32)
    floor(new_tokens)
    calls[f"wgen {new_tokens} floor"] = lambda: floor(new_tokens)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time this process's CPU seconds (a loaded machine's waits for a core left out)")
    parser.add_argument("--parts", nargs="+", default=["projections", "paged", "bucket", "sampling"],
                        choices=["projections", "paged", "bucket", "sampling", "wgen"])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256], help="W-gen's lengths (--parts wgen)")
    args = parser.parse_args()
    cfg = ModelConfig.w_small()
    weights = weights_of(cfg)
    train_x = jax.random.normal(jax.random.key(2), (32 * 96, cfg.hidden_size))
    decode_x = jax.random.normal(jax.random.key(3), (32, cfg.hidden_size))
    calls, parts = {}, []
    for fused in (False, True) if "projections" in args.parts else ():
        grad = jax.jit(jax.value_and_grad(projections(cfg, fused)))
        loop = jax.jit(lambda w, x, apply=projections(cfg, fused): jax.lax.fori_loop(
            0, STEPS, lambda i, x: x + 1e-6 * apply(w, x), x))
        tag = "after" if fused else "before"
        calls[f"train projections {tag}"] = lambda grad=grad: jax.block_until_ready(grad(weights, train_x))
        calls[f"decode projections {tag}"] = lambda loop=loop: loop(weights, decode_x).block_until_ready()
    if "projections" in args.parts:
        parts += ["train projections", "decode projections"]
    for in_place in (False, True) if "paged" in args.parts else ():
        tag = "after" if in_place else "before"
        calls[f"paged attention {tag}"] = paged_attention(cfg, rows=32, pages=6, page_size=16, in_place=in_place)
    parts += ["paged attention"] if "paged" in args.parts else []
    for window, greedy in ((97, True), (97, False), (289, True), (289, False)) if "bucket" in args.parts else ():
        part = f"full bucket w{window - 1} {'greedy' if greedy else 'T=1'}"
        parts.append(part)
        for sliced in (False, True):
            calls[f"{part} {'after' if sliced else 'before'}"] = full_bucket_chunk(cfg, window, greedy, sliced)
    if "sampling" in args.parts:
        parts.append("sampler alone")
        for inverse_cdf in (False, True):
            calls[f"sampler alone {'after' if inverse_cdf else 'before'}"] = sampler_loop(cfg, 32, inverse_cdf)
    for window in (97, 289) if "sampling" in args.parts else ():
        part = f"sampled chunk w{window - 1}"
        parts.append(part)
        for inverse_cdf in (False, True):
            calls[f"{part} {'after' if inverse_cdf else 'before'}"] = full_bucket_chunk(
                cfg, window, greedy=False, sliced=True, inverse_cdf=inverse_cdf)
    for new_tokens in args.new_tokens if "wgen" in args.parts else ():
        calls.update(wgen_calls(cfg, new_tokens))
        parts += [f"wgen {new_tokens} contiguous", f"wgen {new_tokens} paged"]
    seconds = time_interleaved(calls, args.runs, warmup=1,
                               clock=time.process_time if args.cpu_time else time.perf_counter)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, median in medians.items():
        print(f"{name:<30} median {median * 1e3:8.2f} ms (min {min(seconds[name]) * 1e3:.2f}, "
              f"max {max(seconds[name]) * 1e3:.2f})")
    print(f"({'CPU' if args.cpu_time else 'wall'} seconds)")
    for part in parts:
        print(f"{part}: before / after {medians[f'{part} before'] / medians[f'{part} after']:.2f}")
        if part.startswith("wgen"):
            floor = medians[f"wgen {part.split()[1]} floor"]
            print(f"  share of the matmul floor: before {floor / medians[f'{part} before']:.2f}, "
                  f"after {floor / medians[f'{part} after']:.2f}")


if __name__ == "__main__":
    main()
