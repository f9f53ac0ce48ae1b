"""Issue 28's op-level changes, before and after, interleaved in one process (W-small shapes, float32):

  * projections: a layer's q, k, v and gate, up projections as five matmuls (before) or two, against the kernels
    side by side (after, `Attention._project_qkv` / `MLP`): the training rows (32 x 96 tokens, forward and
    backward) and a decode step's rows (32, forward, 16 steps in a loop as the decode chunk runs them);
  * paged attention: one decode token per row over its gathered pages, transposed to [b k w*n e] first (before)
    or in the gathered layout (after, `paged_cache._attend_pages`), 16 steps in a loop;
  * full bucket: a contiguous decode chunk (`generate.decode.decode`, W-gen's 32 rows all running, 16 steps) whose
    live rows are gathered from the slots and scattered back (before) or, every slot in slot order, sliced and
    written back in place (after, `live_rows.take_rows` / `put_rows`), at attention windows 96 and 288 (W-gen's
    capacity at 64 and 256 new tokens), greedy and at temperature 1.

    python benchmarks/bench_fused_ops.py [--runs 7] [--cpu-time] [--parts projections paged bucket]

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
from timing import time_interleaved  # noqa: E402

from flax import nnx  # noqa: E402

from rpegjax.generate import SamplingConfig  # noqa: E402
from rpegjax.generate import decode as decode_module  # noqa: E402
from rpegjax.generate import live_rows as live_module  # noqa: E402
from rpegjax.generate.decode import DecodeState  # noqa: E402
from rpegjax.generate.paged_cache import _attend_pages  # noqa: E402
from rpegjax.generate.sampling import sampling_arrays  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402
from rpegjax.models.transformer import _cached_attention  # noqa: E402

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
                return _attend_pages(qi, keys, values, positions)
            flat = [x.transpose(1, 0, 2, 3, 4).reshape(rows, kv, pages * page_size, e) for x in (keys, values)]
            return _cached_attention(qi, *flat, positions)

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


def full_bucket_chunk(cfg: ModelConfig, window: int, greedy: bool, sliced: bool):
    """One decode chunk of STEPS steps on 32 running slots (every slot: a full bucket) attending to `window` cache
    positions of a cache of `window` positions (rows at window - STEPS - 1 cached tokens, random cache contents)."""
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    rows = 32
    sampling = sampling_arrays(SamplingConfig(max_new_tokens=window, greedy=greedy, temperature=1.0, ignore_eos=True),
                               vocab_size=cfg.vocab_size, default_eos_id=None)
    state = DecodeState.empty(cfg, rows, window, window)
    keys = iter(jax.random.split(jax.random.key(4), 2 * cfg.num_layers))
    cache = state.cache.replace(k=tuple(jax.random.normal(next(keys), x.shape) for x in state.cache.k),
                                v=tuple(jax.random.normal(next(keys), x.shape) for x in state.cache.v),
                                lengths=jnp.full((rows,), window - STEPS - 1, jnp.int32))
    state = state.replace(cache=cache, done=jnp.zeros((rows,), bool), budget=jnp.full((rows,), window, jnp.int32),
                          prompt_index=jnp.arange(rows, dtype=jnp.int32))
    every = jnp.asarray(live_module.live_rows(range(rows), num_slots=rows, replicas=1))
    run = jax.jit(lambda state: decode_module.decode(graphdef, params, state, every, jax.random.key(1), sampling,
                                              jnp.int32(STEPS), window=window - 1))  # < capacity: the windowed path
    if not sliced:  # trace (once, now) with the gather and scatter of before
        saved = (live_module.take_rows, live_module.put_rows, decode_module.take_rows, decode_module.put_rows)
        live_module.take_rows = decode_module.take_rows = _gathered_rows
        live_module.put_rows = decode_module.put_rows = _scattered_rows
        try:
            run = run.lower(state).compile()
        finally:
            live_module.take_rows, live_module.put_rows, decode_module.take_rows, decode_module.put_rows = saved
    return lambda: jax.block_until_ready(run(state))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time this process's CPU seconds (a loaded machine's waits for a core left out)")
    parser.add_argument("--parts", nargs="+", default=["projections", "paged", "bucket"],
                        choices=["projections", "paged", "bucket"])
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
    seconds = time_interleaved(calls, args.runs, warmup=1,
                               clock=time.process_time if args.cpu_time else time.perf_counter)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, median in medians.items():
        print(f"{name:<30} median {median * 1e3:8.2f} ms (min {min(seconds[name]) * 1e3:.2f}, "
              f"max {max(seconds[name]) * 1e3:.2f})")
    print(f"({'CPU' if args.cpu_time else 'wall'} seconds)")
    for part in parts:
        print(f"{part}: before / after {medians[f'{part} before'] / medians[f'{part} after']:.2f}")


if __name__ == "__main__":
    main()
