"""Partial rollouts on a long tail (W-tail's lengths through W-small's GRPO step): seconds per step without
`--rollout.partial` and with it, carried sequences recomputed or keeping their KV pages (`--rollout.partial_carry`),
in one run, interleaved, with every program compiled before the timed steps.

The W-small model (shared/WORKLOADS.md), `--prompts` (4) prompts x 4 samples of 32-token prompts per step (few
prompts: few tokens trained per decode step, so the long tail, not the update, is what a plain step waits for),
temperature 1. Response lengths (`--lengths`):
- `lognormal` (default), W-tail's: every sample (prompt, j) has its own length, log-normal (sigma 1) scaled to
  `--mean`, clipped to [1, 8x the mean], the longest drawn at the cap (`tail_lengths`, as bench_generate.py's
  W-tail part draws them). A random model cannot end its responses by that law, so the length is the sample's
  token budget (`TailSampler`: one request per sample, each with its own budget and the PRNG stream the group
  would give it); a step's plain generation thus lasts its batch's longest sample.
- `geometric`: a response ends when it samples one of 1 / `--mean` of the vocabulary (lengths geometric with a mean
  near `--mean`) or at the budget of 8x that mean.
Modes (`--modes`, the first the ratios' baseline): plain, partial with carry=recompute or pages, each with weights
in flight (`-inflight`: the next version once half the groups a step lacks have completed), and `plain-no-tail`:
plain with every sample at the table's mean length (the same tokens without a tail: what no scheduling of the
tail can beat).
GRPO with a reference model, asynchrony bound `--async-bound` (1), the job's default graph (fused inference), the
paged KV cache (`--layout`) with live decode buckets. The modes share one learner and one sampler, so a program
compiled for one is compiled for all.

Order of work: `--warmup-rounds` untimed runs of every mode, `--skip` + `--warmup-steps` steps each (they compile
the programs the shapes of a run reach),
then `--rounds` rounds, each running every mode (the order rotating between rounds) for `--skip` untimed steps
(the pipeline fills: the partial pool is empty at step 0) and `--steps` timed steps. Reported per mode: the median,
min and max of the timed step times over every round and their ratio; the seconds a step spends generating
(the rollout stage's spans) and every other stage's spans (median, and their sum per step); the sampler's calls per
step (prefill calls, prompts prefilled, decode calls, decode steps, rows decoded x steps); programs compiled during
timed steps (every XLA backend compile, counted through `jax.monitoring`: in the first run of a shape, not after);
the response lengths trained; the steps' mean `generate/slot_occupancy`; the version lag; the carried sequences
recomputed and kept.

    python benchmarks/bench_partial_rollouts.py [--steps 10] [--rounds 2] [--prompts 4] [--mean 32] [--pack-tokens N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx
from jax._src import dispatch

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator
from rpegjax.generate.completion import FinishReason
from rpegjax.generate.requests import Request
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph import builders, transforms
from rpegjax.graph.trace import Trace
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.models import Decoder, ModelConfig
from rpegjax.options import CacheLayout
from rpegjax.rewards.runner import Isolation, RewardRunner, RewardRunnerConfig
from rpegjax.runtime.assembly import RolloutShape, place_models
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.partial_rollouts import CarryMode, PartialRolloutConfig
from rpegjax.runtime.programs import StagePrograms

GROUP, PROMPT_LEN = 4, 32
MODES = ("plain", "recompute", "pages")  # without partial rollouts, then with each carry
INFLIGHT = ("recompute-inflight", "pages-inflight")  # and weights in flight at half the batch (k >= 1; `--modes`)
NO_TAIL = "plain-no-tail"  # plain, every sample at the table's mean length: the same tokens without a tail
SAMPLER_COUNTERS = ("prefill_calls", "prefilled_prompts", "decode_calls", "decode_steps", "decoded_row_steps")


class CompileCounter:
    """XLA backend compiles of this process (every jitted program's first call per shape), with their seconds."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, seconds: float, **_) -> None:
        if event == dispatch.BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += seconds


def even_token_reward(text: str, example: Example) -> float:
    """A rule-based host reward: the fraction of response tokens with an even id."""
    ids = [int(x) for x in text.split()]
    return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def tail_lengths(n: int, mean: int, seed: int = 1) -> np.ndarray:
    """W-tail response lengths (shared/WORKLOADS.md): log-normal (sigma 1) scaled to `mean`, clipped to [1, 8 x mean],
    the longest at the cap (as benchmarks/bench_generate.py and bench_live_decode.py draw them)."""
    raw = np.random.default_rng(seed).lognormal(0.0, 1.0, n)
    lengths = np.clip(np.round(raw / raw.mean() * mean), 1, 8 * mean).astype(int)
    lengths[np.argmax(raw)] = 8 * mean
    return lengths


class TailSampler:
    """The shared sampler, with sample j of each prompt ending after its own W-tail length (`lengths[prompt][j]`
    new tokens): a random model's EOS cannot follow a log-normal law, a per-row budget can. Every call's group
    requests are served as one request per sample (same PRNG streams: key_index, first_sample + j), so each row gets
    its own budget; completions come back under the caller's (request, sample). A carried sequence is recognised
    by its context (prompt + the tokens handed out so far), recorded when it was handed out as a prefix; kept
    pages (`keep`) are re-keyed the same way. Everything else is the wrapped sampler's."""

    def __init__(self, sampler, lengths: dict[bytes, np.ndarray]):
        self.inner, self.lengths = sampler, lengths
        self.carried: dict[bytes, list[tuple[bytes, int]]] = {}  # context -> (prompt, sample) handed out partial

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, params, prompts, sampling, *, group_size: int = 1, key, version=None, stats=None, **rest):
        if rest:
            raise ValueError(f"TailSampler.stream: unsupported arguments {sorted(rest)}")
        requests = [Request(tokens=np.asarray(p, np.int32), budget=sampling.max_new_tokens, samples=group_size,
                            key_index=i) for i, p in enumerate(prompts)]
        return self.serve(params, requests, sampling, key=key, version=version, stats=stats)

    def _owner(self, request: Request, j: int) -> tuple[bytes, int]:
        context = request.tokens.tobytes()
        if request.samples == 1 and self.carried.get(context):
            return self.carried[context].pop(0)
        if request.tokens.size != PROMPT_LEN:
            raise RuntimeError("TailSampler: a continued context that was never handed out")
        return context, request.first_sample + j

    def serve(self, params, requests, sampling, *, key, version=None, interrupt=None, stats=None, keep=None):
        split, origin = [], []
        for index, request in enumerate(requests):
            for j in range(request.samples):
                prompt, sample = self._owner(request, j)
                left = int(self.lengths[prompt][sample]) - (request.size - PROMPT_LEN)
                split.append(dataclasses.replace(request, budget=left, samples=1,
                                                 first_sample=request.first_sample + j))
                origin.append((index, j, prompt, sample))
        return self._served(self.inner.serve(params, split, sampling, key=key, version=version, interrupt=interrupt,
                                             stats=stats, keep=keep), origin, keep)

    def _served(self, completions, origin, keep):
        for c in completions:
            index, j, prompt, sample = origin[c.prompt_index]
            if c.finish_reason == FinishReason.PARTIAL:
                context = np.concatenate([c.prompt_ids, c.response_ids]).astype(np.int32).tobytes()
                self.carried.setdefault(context, []).append((prompt, sample))
            yield dataclasses.replace(c, prompt_index=index, sample_index=j)
        if keep is not None:
            keep.kept = {origin[i][:2]: slot for (i, _), slot in keep.kept.items()}


class Bench:
    """One learner and sampler (compiled once) shared by every run of both modes."""

    def __init__(self, mean: int, layout: CacheLayout, chunk_steps: int, length_bucket: int | None,
                 pack_tokens: int | None = None, prompts: int = 8, lengths: str = "lognormal", async_bound: int = 1):
        self.prompts_per_step = prompts
        self.cfg = ModelConfig.w_small()
        graph = transforms.default_fusion(builders.grpo_graph(use_reference=True, async_bound=async_bound))
        execution = dataclasses.replace(graph.execution, kv_cache=layout, packing=pack_tokens is not None,
                                        max_tokens_per_micro_batch=pack_tokens)
        self.graph = dataclasses.replace(graph, execution=execution)
        self.learner, self.sampler = place_models(
            self.graph, Decoder(self.cfg, rngs=nnx.Rngs(0)),
            GRPOConfig(group_size=GROUP, kl_coef=0.04, clip_low=0.2, clip_high=0.2, decoupled=True, importance_cap=5.0,
                       length_bucket=length_bucket, optimizer=OptimizerConfig(learning_rate=1e-5)),
            RolloutShape(num_slots=prompts * GROUP, max_prompt_len=PROMPT_LEN, max_new_tokens=8 * mean,
                         chunk_steps=chunk_steps))
        rng = np.random.default_rng(0)
        self.prompts = {f"p{i}": rng.integers(0, self.cfg.vocab_size, PROMPT_LEN).tolist() for i in range(512)}
        self.generator = self.sampler
        if lengths == "geometric":  # a response ends on 1 id in `mean` (lengths geometric) or at 8x the mean
            stops = tuple(range(1, self.cfg.vocab_size, mean))
        else:  # every sample's own W-tail length, as a per-row budget
            stops = ()
            table = tail_lengths(len(self.prompts) * GROUP, mean).reshape(len(self.prompts), GROUP)
            self.generator = self._tail_sampler(table)
            self.no_tail = self._tail_sampler(np.full_like(table, round(float(table.mean()))))
        self.sampling = SamplingConfig(max_new_tokens=8 * mean, temperature=1.0, ignore_eos=True, stop_ids=stops)
        self.examples = [Example(id=key, prompt=key, answer="0", task="w-tail") for key in self.prompts]
        self.compiles = CompileCounter()

    def _tail_sampler(self, table: np.ndarray) -> TailSampler:
        """The sampler serving prompt i's samples with the lengths of `table[i]`."""
        return TailSampler(self.sampler, {np.asarray(ids, np.int32).tobytes(): row
                                          for ids, row in zip(self.prompts.values(), table, strict=True)})

    def run(self, mode: str, steps: int, skip: int) -> dict:
        """`skip` + `steps` steps of one mode (`MODES`) from the initial weights; the figures of the last `steps`."""
        partial = None
        if mode not in ("plain", NO_TAIL):
            partial = PartialRolloutConfig(max_token_lag=self.graph.async_bound + 2, inflight_weights=mode in INFLIGHT,
                                           carry=CarryMode(mode.removesuffix("-inflight")))
        rewards = RewardRunner(even_token_reward, RewardRunnerConfig(timeout_s=10.0, workers=1,
                                                                      isolation=Isolation.THREAD))
        generator = self.no_tail if mode == NO_TAIL else self.generator
        programs = StagePrograms(learner=self.learner, sampler=generator, sampling=self.sampling, group_size=GROUP,
                                 rewards=rewards, decode=lambda ids: " ".join(str(int(i)) for i in ids), pad_id=0)
        trace = Trace(mode)
        runtime = Runtime(self.graph, programs, DataIterator(self.examples, batch_size=self.prompts_per_step, seed=0),
                          prompt_ids=lambda batch: [self.prompts[e.id] for e in batch], key=jax.random.key(0),
                          trace=trace, partial=partial)
        ends, results, compiles = [time.perf_counter()], [], []

        counters = []  # the sampler's calls (cumulative), at each step's end

        def on_step(result, state) -> None:
            ends.append(time.perf_counter())
            results.append(result)
            compiles.append((self.compiles.count, self.compiles.seconds))
            counters.append(np.array([getattr(self.sampler.stats, name) for name in SAMPLER_COUNTERS], float))

        try:
            runtime.run(self.learner.init_state(), start_step=0, num_steps=skip + steps, on_step=on_step)
        finally:
            rewards.close()
        timed = results[skip:]
        first, last = compiles[skip - 1] if skip else (0, 0.0), compiles[-1]
        generating = [e.duration for e in trace.events if e.kind == "generate" and e.step >= skip]
        spans: dict[str, list[float]] = {}
        for event in trace.events:
            if event.step >= skip:
                spans.setdefault(event.kind, []).append(event.duration)
        per_step = (counters[-1] - (counters[skip - 1] if skip else 0.0)) / steps
        lengths = np.array([c.length for r in timed for c in r.completions])
        if isinstance(generator, TailSampler):  # every trained sample has its own W-tail length
            wanted = [generator.lengths[c.prompt_ids.astype(np.int32).tobytes()][c.sample_index]
                      for r in results for c in r.completions]
            assert [c.length for r in results for c in r.completions] == wanted, "a sample missed its length"
        return {"step_seconds": np.diff(ends)[skip:].tolist(), "generate_seconds": generating, "spans": spans,
                "sampler_per_step": dict(zip(SAMPLER_COUNTERS, per_step.tolist(), strict=True)),
                "lengths": lengths.tolist(), "compiles": last[0] - first[0], "compile_seconds": last[1] - first[1],
                # a partial step whose batch completed before it decoded (carried groups) has no occupancy
                "slot_occupancy": [r.metrics["generate/slot_occupancy"] for r in timed
                                   if "generate/slot_occupancy" in r.metrics],
                "lag_max": max(r.metrics["version_lag/max"] for r in timed),
                "lag_mean": float(np.mean([r.metrics["version_lag/mean"] for r in timed])),
                "carried_sequences": sum(r.metrics.get("partial/carried_sequences", 0.0) for r in timed),
                "dropped_groups": sum(r.metrics.get("partial/dropped_groups", 0.0) for r in timed),
                **{name: sum(r.metrics.get(f"partial/{name}", 0.0) for r in timed)
                   for name in ("kept_sequences", "recomputed_sequences")}}


def summarise(runs: list[dict]) -> dict:
    times = [t for run in runs for t in run["step_seconds"]]
    generating = [t for run in runs for t in run["generate_seconds"]]
    lengths = np.array([n for run in runs for n in run["lengths"]])
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "timed_steps": len(times),
            "generate_median_s": statistics.median(generating),
            "span_median_s": {kind: round(statistics.median([t for run in runs for t in run["spans"].get(kind, [])]), 3)
                              for kind in sorted({k for run in runs for k in run["spans"]})},
            "span_total_per_step_s": {kind: round(sum(sum(run["spans"].get(kind, [])) for run in runs) / len(times), 3)
                                      for kind in sorted({k for run in runs for k in run["spans"]})},
            "sampler_per_step": {name: round(float(np.mean([run["sampler_per_step"][name] for run in runs])), 1)
                                 for name in SAMPLER_COUNTERS},
            "compiles_in_timed_steps": sum(run["compiles"] for run in runs),
            "compile_seconds_in_timed_steps": round(sum(run["compile_seconds"] for run in runs), 2),
            "slot_occupancy_mean": float(np.mean([x for run in runs for x in run["slot_occupancy"]])),
            "trained_length_mean": float(lengths.mean()), "trained_length_max": int(lengths.max()),
            "version_lag_mean": float(np.mean([run["lag_mean"] for run in runs])),
            "version_lag_max": max(run["lag_max"] for run in runs),
            "carried_sequences": sum(run["carried_sequences"] for run in runs),
            "dropped_groups": sum(run["dropped_groups"] for run in runs),
            **{name: sum(run[name] for run in runs) for name in ("kept_sequences", "recomputed_sequences")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    parser.add_argument("--skip", type=int, default=2, help="untimed steps that start each run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed runs of both modes (compiles)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps of each warm-up run (after --skip)")
    parser.add_argument("--mean", type=int, default=32, help="mean response length; the budget is 8x")
    parser.add_argument("--layout", choices=[x.value for x in CacheLayout], default=CacheLayout.PAGED.value)
    parser.add_argument("--chunk-steps", type=int, default=8)
    parser.add_argument("--length-bucket", type=int, default=None, help="the learner's length bucket (None: full)")
    parser.add_argument("--pack-tokens", type=int, default=None,
                        help="sequence packing into rows of this many tokens (None: rows padded)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x 4 samples)")
    parser.add_argument("--lengths", choices=("lognormal", "geometric"), default="lognormal",
                        help="W-tail's log-normal lengths per sample (budgets), or stop ids (geometric)")
    parser.add_argument("--async-bound", type=int, default=1, choices=(0, 1))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, *INFLIGHT, NO_TAIL],
                        help="the first is the baseline of the ratios")
    args = parser.parse_args()
    if NO_TAIL in args.modes and args.lengths != "lognormal":
        parser.error(f"--modes {NO_TAIL} evens out the log-normal lengths: it needs --lengths lognormal")
    if set(INFLIGHT) & set(args.modes) and args.async_bound == 0:
        parser.error(f"--modes {' / '.join(INFLIGHT)} take newer weights mid-step: they need --async-bound 1")
    modes = tuple(args.modes)
    bench = Bench(args.mean, CacheLayout(args.layout), args.chunk_steps, args.length_bucket, args.pack_tokens,
                  args.prompts, args.lengths, args.async_bound)
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    for index in range(args.warmup_rounds):
        for mode in modes:
            start = time.perf_counter()
            bench.run(mode, args.warmup_steps, args.skip)
            print(f"warm-up {index} {mode}: {time.perf_counter() - start:.1f} s, "
                  f"{bench.compiles.count} programs compiled so far", flush=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for index in range(args.rounds):
        for mode in modes[index % len(modes):] + modes[:index % len(modes)]:
            out = bench.run(mode, args.steps, args.skip)
            runs[mode].append(out)
            print(f"round {index} {mode}: median {statistics.median(out['step_seconds']):.2f} s/step, "
                  f"generating {statistics.median(out['generate_seconds']):.2f} s, {out['compiles']} compiles",
                  flush=True)
    summary = {mode: summarise(runs[mode]) for mode in modes}
    summary["speedup"] = {mode: summary[modes[0]]["median_s"] / summary[mode]["median_s"] for mode in modes[1:]}
    summary["async_bound"] = args.async_bound
    summary["budget"] = 8 * args.mean
    summary["lengths"] = args.lengths
    summary["layout"] = args.layout
    summary["load_average_end"] = open("/proc/loadavg").read().split()[:3]
    summary["sampler_compiles"] = bench.sampler.compile_counts()
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
