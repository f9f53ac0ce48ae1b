"""Issue 28's op-level changes, before and after, interleaved in one process (W-small shapes, float32):

  * projections: a layer's q, k, v and gate, up projections as five matmuls (before) or two, against the kernels
    side by side (after, `Attention._project_qkv` / `MLP`): the training rows (32 x 96 tokens, forward and
    backward) and a decode step's rows (32, forward, 16 steps in a loop as the decode chunk runs them);
  * paged attention: one decode token per row over its gathered pages, transposed to [b k w*n e] first (before)
    or in the gathered layout (after, `paged_cache._attend_pages`), 16 steps in a loop.

    python benchmarks/bench_fused_ops.py [--runs 7]

Prints the medians and before / after (above 1: the change is faster). Same-run ratios; the machine is shared.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_interleaved  # noqa: E402

from rpegjax.generate.paged_cache import _attend_pages  # noqa: E402
from rpegjax.models import ModelConfig  # noqa: E402
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
            keys, values = pool_k[table], pool_v[table]  # b w k n e
            if in_place:
                return _attend_pages(qi, keys, values, positions)
            flat = [x.transpose(0, 2, 1, 3, 4).reshape(rows, kv, pages * page_size, e) for x in (keys, values)]
            return _cached_attention(qi, *flat, positions)

        return jax.lax.fori_loop(0, STEPS, step, jnp.zeros((rows, 1, h, e)))

    keys = jax.random.split(jax.random.key(1), 3)
    pool = (rows * pages, kv, page_size, e)
    args = (jax.random.normal(keys[0], pool), jax.random.normal(keys[1], pool),
            jnp.arange(rows * pages).reshape(rows, pages), jax.random.normal(keys[2], (rows, 1, h, e)),
            jnp.full((rows, 1), pages * page_size - 3))
    return lambda: run(*args).block_until_ready()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    cfg = ModelConfig.w_small()
    weights = weights_of(cfg)
    train_x = jax.random.normal(jax.random.key(2), (32 * 96, cfg.hidden_size))
    decode_x = jax.random.normal(jax.random.key(3), (32, cfg.hidden_size))
    calls = {}
    for fused in (False, True):
        grad = jax.jit(jax.value_and_grad(projections(cfg, fused)))
        loop = jax.jit(lambda w, x, apply=projections(cfg, fused): jax.lax.fori_loop(
            0, STEPS, lambda i, x: x + 1e-6 * apply(w, x), x))
        tag = "after" if fused else "before"
        calls[f"train projections {tag}"] = lambda grad=grad: jax.block_until_ready(grad(weights, train_x))
        calls[f"decode projections {tag}"] = lambda loop=loop: loop(weights, decode_x).block_until_ready()
    for in_place in (False, True):
        tag = "after" if in_place else "before"
        calls[f"paged attention {tag}"] = paged_attention(cfg, rows=32, pages=6, page_size=16, in_place=in_place)
    seconds = time_interleaved(calls, args.runs, warmup=1)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, median in medians.items():
        print(f"{name:<30} median {median * 1e3:8.2f} ms (min {min(seconds[name]) * 1e3:.2f}, "
              f"max {max(seconds[name]) * 1e3:.2f})")
    for part in ("train projections", "decode projections", "paged attention"):
        print(f"{part}: before / after {medians[f'{part} before'] / medians[f'{part} after']:.2f}")


if __name__ == "__main__":
    main()
