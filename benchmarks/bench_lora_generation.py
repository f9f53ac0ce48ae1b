"""Generation from a LoRA policy: the base model on merged weights (W + s A B, computed once per weight sync) vs
the adapted model (two extra rank-r matmuls per projection and token). Decides `LoRASection.generation`'s default.

Both samplers decode the same prompts greedily to the full budget (no EOS), alternating, `--repeats` times each
in alternating order after a compiling warm-up; reported: median decode tokens/s of each, their ratio, and the merge's own time (what
a merged weight sync adds, jitted, median of `--repeats`).

    python benchmarks/bench_lora_generation.py [--model w-small|job] [--rank 8] [--slots 64] [--new-tokens 64]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rpegjax.generate import Sampler, SamplingConfig  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402
from rpegjax.models.lora import LoRAConfig, LoRAParam, merge_adapters  # noqa: E402

MODELS = {
    "w-small": ModelConfig.w_small,
    # the main job's built-in model (rpegjax.train.config.ModelSection defaults, character vocabulary)
    "job": lambda: ModelConfig(vocab_size=99, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                               intermediate_size=384, attention_bias=True),
}


def timed(fn) -> float:
    started = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="w-small", choices=sorted(MODELS))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = MODELS[args.model]()
    lora = LoRAConfig(rank=args.rank)
    adapted = Decoder(cfg, rngs=nnx.Rngs(0)).with_lora(lora, seed=1)
    rng = np.random.default_rng(0)
    for _, variable in nnx.to_flat_state(nnx.state(adapted, LoRAParam)):  # a trained adapter: B != 0
        variable.set_value(0.05 * rng.standard_normal(variable.get_value().shape).astype(np.float32))
    params = nnx.state(adapted)
    base = adapted.without_lora()
    shape = dict(num_slots=args.slots, max_prompt_len=args.prompt, max_new_tokens=args.new_tokens, chunk_steps=16)
    merge = jax.jit(lambda p: merge_adapters(p, lora.scale))
    merged_params = merge(params)
    runs = {
        "adapters": (Sampler(cfg, nnx.graphdef(adapted), lora=lora, **shape), params),
        "merged": (Sampler(cfg, nnx.graphdef(base), **shape), merged_params),
    }
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt).tolist() for _ in range(args.slots)]
    greedy = SamplingConfig(max_new_tokens=args.new_tokens, greedy=True, ignore_eos=True)
    tokens = args.slots * args.new_tokens
    for sampler, weights in runs.values():  # compile
        sampler.generate(weights, prompts, greedy, key=jax.random.key(0))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]  # neither always runs first
        for name in order:
            sampler, weights = runs[name]
            started = time.perf_counter()
            sampler.generate(weights, prompts, greedy, key=jax.random.key(0))  # returns host arrays: finished
            seconds[name].append(time.perf_counter() - started)
    merge_seconds = statistics.median(timed(lambda: merge(params)) for _ in range(args.repeats))
    rates = {name: tokens / statistics.median(values) for name, values in seconds.items()}
    print(f"model {args.model} ({cfg.num_layers} layers, d {cfg.hidden_size}), LoRA rank {args.rank} on every "
          f"projection, {args.slots} slots x {args.new_tokens} new tokens, {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s), median of {args.repeats}")
    print("| generation | decode tokens/s | per-sync merge s |")
    print("|---|---|---|")
    print(f"| adapters | {rates['adapters']:.0f} | - |")
    print(f"| merged | {rates['merged']:.0f} | {merge_seconds:.4f} |")
    print(f"merged / adapters throughput: {rates['merged'] / rates['adapters']:.2f}x")


if __name__ == "__main__":
    main()
