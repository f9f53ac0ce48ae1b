"""W-gen's decode attention alone: one token per row over a contiguous cache, W-small's shapes (32 rows,
2 KV heads of 2 query heads each, head dim 64, 4 layers), 16 steps in one jitted loop, against reading the same
keys and values once (a bound no attention that reads the cache once per step can beat).

Forms, each checked against the model's own (`models.full_attention.cached_attention`) before timing:
* `model: keys [b k e s]`: the model's decode attention (float32 multiply-and-sum, over the cache's layout: keys
  position-innermost, so the scores' sum over the head dim adds rows of positions);
* `keys [b k s e]`: the same sums over keys stored head-dim-innermost (the cache's earlier layout), whose
  scores reduce along the innermost axis;
* `keys [b k e s], values as a dot`: the model's scores, `probs @ values` as an einsum.

    python benchmarks/bench_decode_attention.py [--windows 128 288] [--runs 11]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rpegjax.models.full_attention import cached_attention

ROWS, KV_HEADS, GROUP, HEAD_DIM, LAYERS, STEPS = 32, 2, 2, 64, 4, 16
MODEL = "model: keys [b k e s]"


def _masked_softmax(scores, index, window: int):
    valid = jnp.arange(window)[None, :] <= index[:, None]
    return jax.nn.softmax(jnp.where(valid[:, None, None, :], scores, -1e30), axis=-1)


def model_form(q, keys_t, values, index):
    return cached_attention(q, keys_t, values, index[:, None])


def head_dim_innermost(q, keys, values, index):
    qg = q.reshape(ROWS, KV_HEADS, GROUP, 1, HEAD_DIM)
    scores = jnp.sum(qg * keys[:, :, None], axis=-1) / math.sqrt(HEAD_DIM)  # b k g s
    probs = _masked_softmax(scores, index, keys.shape[2])
    return jnp.sum(probs[..., None] * values[:, :, None], axis=3).reshape(q.shape)


def transposed_dot(q, keys_t, values, index):
    qg = q.reshape(ROWS, KV_HEADS, GROUP, HEAD_DIM)
    scores = jnp.einsum("bkge,bkes->bkgs", qg, keys_t) / math.sqrt(HEAD_DIM)
    probs = _masked_softmax(scores, index, keys_t.shape[-1])
    return jnp.einsum("bkgs,bkse->bkge", probs, values).reshape(q.shape)


def read_once(q, keys, values, index):
    """Every key (times the query, so nothing is skipped) and every value read once; not attention."""
    return q + 1e-9 * (jnp.sum(keys * q.reshape(ROWS, KV_HEADS, 1, GROUP * HEAD_DIM)[..., :HEAD_DIM]) + jnp.sum(values))


def steps_loop(attend):
    """STEPS steps of LAYERS layers, each layer's output feeding the next (no step is hoisted out)."""
    @jax.jit
    def run(q, keys, values, index):
        def body(_, q):
            for layer in range(LAYERS):
                q = q + 1e-3 * attend(q, keys[layer], values[layer], index)
            return q
        return jax.lax.fori_loop(0, STEPS, body, q)
    return run


def measure(window: int, runs: int) -> dict[str, float]:
    key_q, key_k, key_v = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key_q, (ROWS, 1, KV_HEADS * GROUP, HEAD_DIM))
    keys = jax.random.normal(key_k, (LAYERS, ROWS, KV_HEADS, window, HEAD_DIM))
    values = jax.random.normal(key_v, (LAYERS, ROWS, KV_HEADS, window, HEAD_DIM))
    keys_t = jnp.swapaxes(keys, -1, -2)
    index = jnp.arange(ROWS) % window + (window - ROWS)  # rows at different positions near the window's end
    reference = model_form(q, keys_t[0], values[0], index)
    for form, cache in ((head_dim_innermost, keys), (transposed_dot, keys_t)):
        np.testing.assert_allclose(form(q, cache[0], values[0], index), reference, rtol=1e-4, atol=1e-5)
    forms = {MODEL: (model_form, keys_t), "keys [b k s e]": (head_dim_innermost, keys),
             "keys [b k e s], values as a dot": (transposed_dot, keys_t), "read keys and values once": (read_once, keys)}
    loops = {name: (steps_loop(form), cache) for name, (form, cache) in forms.items()}
    for run, cache in loops.values():
        run(q, cache, values, index).block_until_ready()
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(runs):  # interleaved
        for name, (run, cache) in loops.items():
            start = time.perf_counter()
            run(q, cache, values, index).block_until_ready()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) / STEPS for name, times in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 288])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    for window in args.windows:
        step = measure(window, args.runs)
        cache_bytes = 2 * LAYERS * ROWS * KV_HEADS * window * HEAD_DIM * 4
        print(f"window {window}: {cache_bytes / 1e6:.1f} MB of keys and values per step; ms per step (medians of "
              f"{args.runs}), and each form over the model's")
        for name, seconds in step.items():
            print(f"  {name:<34} {seconds * 1e3:7.3f} ms   {seconds / step[MODEL]:5.2f}x")


if __name__ == "__main__":
    main()
