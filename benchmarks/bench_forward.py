"""Forward throughput of the W-small model: our jitted forward vs transformers (torch CPU), same weights.

    python benchmarks/bench_forward.py [--batch 32] [--seq 96] [--runs 7]

Builds `ModelConfig.w_small()` with random weights, writes it with our `save_pretrained`, loads the
directory into `transformers.AutoModelForCausalLM`, checks both give the same logits, then times the
full-sequence forward (float32 logits [b, t, v]) of each: warm-up, then `--runs` timed calls; prints
the median (min, max) seconds, tokens/s and the ratio ours / transformers, all from this one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import time_interleaved

from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.hf import save_pretrained


def _summary(name: str, seconds: list[float], tokens: int) -> float:
    median = statistics.median(seconds)
    print(f"{name:>14}: median {median * 1e3:8.1f} ms (min {min(seconds) * 1e3:.1f}, max {max(seconds) * 1e3:.1f}) "
          f"-> {tokens / median:10.0f} tokens/s")
    return tokens / median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=96)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be at least 5 (figures are medians of several runs)")

    import torch
    import transformers

    cfg = ModelConfig.w_small()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(args.batch, args.seq))
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(model, cfg, directory + "/w_small")
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory + "/w_small", dtype=torch.float32)
    reference.eval()

    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    jax_tokens = jnp.asarray(tokens)
    torch_tokens = torch.tensor(tokens)

    def ours():
        return forward(state, jax_tokens).block_until_ready()

    def theirs():
        with torch.inference_mode():
            return reference(input_ids=torch_tokens).logits

    difference = np.abs(np.asarray(ours()) - theirs().numpy()).max()
    print(f"W-small forward: {cfg.num_params():,} parameters, batch {args.batch} x {args.seq} tokens, float32, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"max |logits ours - transformers| = {difference:.2e}")
    count = args.batch * args.seq
    seconds = time_interleaved({"rpegjax (jit)": ours, "transformers": theirs}, args.runs, warmup=args.warmup)
    ours_rate = _summary("rpegjax (jit)", seconds["rpegjax (jit)"], count)
    theirs_rate = _summary("transformers", seconds["transformers"], count)
    print(f"ratio rpegjax / transformers tokens/s: {ours_rate / theirs_rate:.2f}x")


if __name__ == "__main__":
    main()
