"""The parts of a W-small step (shared/WORKLOADS.md), timed interleaved in one process: the GRPO update, the
log-prob pass and generation (64 new tokens at temperature 1, contiguous and paged cache), plus a matmul floor of
the same decode steps (`bench_generate.make_matmul_floor`). Prints one JSON line of medians (seconds): each part's
wall time, and as `<part>_cpu` its CPU time of the process (`time.process_time`, all threads), which waiting for a
core on a loaded machine does not inflate.

    python benchmarks/bench_wsmall_parts.py [--runs 5] [--parts update logprobs generate paged floor]

Uses only the package's public API, so `benchmarks/ab_trees.py` can run it against another source tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import make_matmul_floor  # noqa: E402
from timing import time_interleaved  # noqa: E402

from rpegjax.generate import Sampler, SamplingConfig  # noqa: E402
from rpegjax.generate.paged_cache import CacheConfig  # noqa: E402
from rpegjax.learners import GRPOConfig, GRPOLearner, OptimizerConfig, pack_rollouts  # noqa: E402
from rpegjax.models import Decoder, ModelConfig  # noqa: E402

PROMPTS, GROUP, PROMPT_LEN, RESPONSE_LEN = 8, 4, 32, 64
PARTS = ("update", "logprobs", "generate", "paged", "floor")


def wsmall_batch(learner: GRPOLearner, cfg: ModelConfig):
    """W-small's batch (random prompts and responses of W-small's shape, rewards 0/1) with its reference
    log-probs and advantages, as the update receives it."""
    rng = np.random.default_rng(0)
    rows = PROMPTS * GROUP
    prompts = np.repeat(rng.integers(0, cfg.vocab_size, size=(PROMPTS, PROMPT_LEN)), GROUP, axis=0)
    responses = rng.integers(0, cfg.vocab_size, size=(rows, RESPONSE_LEN))
    behaviour = rng.normal(-6.2, 0.5, size=(rows, RESPONSE_LEN))
    batch = pack_rollouts(prompts.tolist(), responses.tolist(), list(behaviour), pad_id=0,
                          rewards=rng.integers(0, 2, size=rows).astype(np.float32))
    batch = batch.replace(ref_logprobs=learner.logprobs(learner.params, batch))
    batch, _ = learner.compute_advantages(batch)
    return batch


def training_programs(cfg: ModelConfig):
    """The W-small learner, batch and train state: (learner, batch, holder of the state)."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    learner = GRPOLearner(GRPOConfig(group_size=GROUP, clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3",
                                     optimizer=OptimizerConfig(learning_rate=1e-5)), model)
    return learner, wsmall_batch(learner, cfg), {"state": learner.init_state()}


def training_calls(cfg: ModelConfig) -> dict:
    learner, batch, holder = training_programs(cfg)

    def update():
        holder["state"], metrics = learner.update(holder["state"], batch)
        return jax.block_until_ready(metrics)

    params = learner.params
    return {"update": update, "logprobs": lambda: jax.block_until_ready(learner.logprobs(params, batch))}


def generation_calls(cfg: ModelConfig) -> dict:
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (PROMPTS, PROMPT_LEN)).tolist()
    sampling = SamplingConfig(max_new_tokens=RESPONSE_LEN, temperature=1.0, ignore_eos=True)
    shape = dict(num_slots=PROMPTS * GROUP, max_prompt_len=PROMPT_LEN, max_new_tokens=RESPONSE_LEN, chunk_steps=16)
    samplers = {"generate": Sampler(cfg, graphdef, **shape),
                "paged": Sampler(cfg, graphdef, **shape, cache=CacheConfig.paged(page_size=16))}
    floor, _ = make_matmul_floor(cfg, PROMPTS * GROUP)
    calls = {name: (lambda s=sampler: s.generate(params, prompts, sampling, group_size=GROUP, key=jax.random.key(1)))
             for name, sampler in samplers.items()}
    calls["floor"] = lambda: floor(RESPONSE_LEN)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    args = parser.parse_args()
    cfg = ModelConfig.w_small()
    calls = {}
    if {"update", "logprobs"} & set(args.parts):
        calls.update(training_calls(cfg))
    if {"generate", "paged", "floor"} & set(args.parts):
        calls.update(generation_calls(cfg))
    cpu: dict[str, list[float]] = {name: [] for name in args.parts}

    def cpu_timed(name):
        def call():
            start = time.process_time()
            calls[name]()
            cpu[name].append(time.process_time() - start)
        return call

    seconds = time_interleaved({name: cpu_timed(name) for name in args.parts}, args.runs, warmup=1)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    # The warm-up round is timed on the CPU clock too: drop it.
    medians.update({f"{name}_cpu": statistics.median(values[1:]) for name, values in cpu.items()})
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
