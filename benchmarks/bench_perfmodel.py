"""Predicted vs measured RL steps on this CPU: the performance model after `calibrate()` against a real execution.

    python benchmarks/bench_perfmodel.py [--steps 3] [--rounds 2] [--only NAME ...] [--json out.json]

For each configuration (model size, batch, response length, GRPO/PPO, fusion, asynchrony) the script
1. builds the RPEG with the builders and transforms (one CPU device, colocated),
2. predicts it as the runtime executes it (`Evaluator.for_runtime`: the graph's execution options, here the
   defaults: dense attention, no remat, float32; the fixed-slot decode loop, padded batches) on the spec
   calibrated in this same run (below), with `ExecutionOptions.rpegjax_xla()`'s traffic constants,
3. executes the graph with the real runtime (`Runtime` + `StagePrograms`, a `GRPOLearner` or `PPOLearner`, a
   `Sampler`, a host reward through a `RewardRunner`), set up as benchmarks/bench_grpo_step.py sets up W-small:
   random token prompts, `ignore_eos=True` so every response has exactly `new_tokens` tokens;
and prints per-stage and per-step predicted vs measured seconds, the relative errors, their median and maximum
over configurations, the Kendall tau of the two rankings of step times, and the pairs ranked the other way.
Measured stage seconds are the durations of the runtime's trace events per execution unit in the timed steps (the
runtime blocks on each stage's results inside its span); measured step seconds are the times between successive
`on_step` callbacks, medians over `--rounds` passes over all configurations (interleaved in time, so a drift of
the shared machine's load touches them alike). The machine is calibrated before every run and once at the end;
every prediction uses the field-wise median of those calibrations (`calibration.median_calibration`), so the
predicted ranking is the model's alone, not the noise of a calibration made at a busy moment.
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

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph import builders, transforms
from rpegjax.graph.ir import Graph
from rpegjax.graph.trace import Trace
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.ppo import PPOConfig
from rpegjax.models import Decoder, ModelConfig
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import ExecutionOptions, Workload
from rpegjax.perf.reference import calibration
from rpegjax.rewards.runner import Isolation, RewardRunner, RewardRunnerConfig
from rpegjax.runtime.assembly import RolloutShape, place_models
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.programs import StagePrograms


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    name: str
    model: ModelConfig
    prompts: int = 8
    group: int = 4
    prompt_tokens: int = 32
    new_tokens: int = 64
    algorithm: str = "grpo"
    fused: bool = False
    async_bound: int = 0
    shared_critic: bool = False

    def graph(self) -> Graph:
        if self.algorithm == "ppo":
            graph = builders.ppo_graph(use_reference=True, critic="shared" if self.shared_critic else "separate",
                                       async_bound=self.async_bound, num_devices=1, name=self.name)
        else:
            graph = builders.grpo_graph(use_reference=True, async_bound=self.async_bound, num_devices=1, name=self.name)
        graph = transforms.default_fusion(graph) if self.fused else graph
        if graph.has_stage("critic_update"):
            # PPOLearner steps actor and separate critic in one jitted program: one execution unit (training.build_graph)
            graph = transforms.fuse(graph, ["actor_update", "critic_update"])
        return graph

    def workload(self) -> Workload:
        return Workload(prompts=self.prompts, group_size=self.group, prompt_tokens=self.prompt_tokens,
                        responses=ResponseLengths.fixed(self.new_tokens))


W_SMALL = ModelConfig.w_small()
TINY = W_SMALL.replace(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=512)
WIDER = W_SMALL.replace(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1536)
CONFIGS = [
    Config(name="w-small grpo", model=W_SMALL),
    Config(name="w-small grpo fused", model=W_SMALL, fused=True),
    Config(name="w-small grpo fused k=1", model=W_SMALL, fused=True, async_bound=1),
    Config(name="w-small grpo 32 new", model=W_SMALL, new_tokens=32),
    Config(name="w-small grpo 128 new", model=W_SMALL, new_tokens=128),
    Config(name="w-small grpo batch 64", model=W_SMALL, prompts=16),
    Config(name="tiny grpo", model=TINY),
    Config(name="wider grpo", model=WIDER),
    Config(name="w-small ppo", model=W_SMALL, algorithm="ppo"),
    Config(name="w-small ppo shared fused", model=W_SMALL, algorithm="ppo", shared_critic=True, fused=True),
]


# ------------------------------------------------------------------------------------------ the runtime
def even_token_reward(text: str, example: Example) -> float:
    """A rule-based host reward (as in bench_grpo_step.py): the fraction of response tokens with an even id."""
    ids = [int(x) for x in text.split()]
    return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def run_runtime(config: Config, graph: Graph, steps: int, warmup: int) -> tuple[list[float], Trace]:
    """Runs `graph` through `Runtime` + `StagePrograms` with the configuration's learner and sampler, as
    bench_grpo_step.py does for W-small; returns the seconds of the `steps` timed steps (time between
    successive `on_step` callbacks) and the runtime's trace."""
    cfg = config.model
    b = config.prompts * config.group
    optimizer = OptimizerConfig(learning_rate=1e-5)
    if config.algorithm == "ppo":
        critic_cfg = cfg.replace(value_head=True)
        actor = Decoder(critic_cfg if config.shared_critic else cfg, rngs=nnx.Rngs(0))
        critic = None if config.shared_critic else Decoder(critic_cfg, rngs=nnx.Rngs(2))
        algorithm = PPOConfig(critic="shared" if config.shared_critic else "separate", kl_coef=0.04,
                              optimizer=optimizer)
    else:
        actor, critic = Decoder(cfg, rngs=nnx.Rngs(0)), None
        algorithm = GRPOConfig(group_size=config.group, kl_coef=0.04, clip_low=0.2, clip_high=0.2, optimizer=optimizer)
    learner, sampler = place_models(graph, actor, algorithm, RolloutShape(
        num_slots=b, max_prompt_len=config.prompt_tokens, max_new_tokens=config.new_tokens,
        chunk_steps=config.new_tokens), critic=critic)
    rewards = RewardRunner(even_token_reward, RewardRunnerConfig(timeout_s=10.0, workers=1, isolation=Isolation.THREAD))
    rng = np.random.default_rng(0)
    prompts = {f"p{i}": rng.integers(0, cfg.vocab_size, config.prompt_tokens).tolist() for i in range(8 * config.prompts)}
    examples = [Example(id=key, prompt=key, answer="0", task=config.name) for key in prompts]
    programs = StagePrograms(
        learner=learner, sampler=sampler,
        sampling=SamplingConfig(max_new_tokens=config.new_tokens, temperature=1.0, ignore_eos=True),
        group_size=config.group, rewards=rewards, decode=lambda ids: " ".join(str(int(i)) for i in ids), pad_id=0,
    )
    trace = Trace(config.name)
    runtime = Runtime(graph, programs, DataIterator(examples, batch_size=config.prompts, seed=0),
                      prompt_ids=lambda batch: [prompts[e.id] for e in batch], key=jax.random.key(0), trace=trace)
    ends: list[float] = []
    try:
        runtime.run(learner.init_state(), start_step=0, num_steps=warmup + steps,
                    on_step=lambda result, state: ends.append(time.perf_counter()))
    finally:
        rewards.close()
    return [float(t) for t in np.diff(ends)[warmup - 1:]], trace


# ------------------------------------------------------------------------------------------------ report
def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Rank agreement of two lists (None with fewer than two entries: no pair to rank)."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return None
    score = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in pairs)
    return float(score / len(pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="passes over all configurations (interleaved in time)")
    parser.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error(f"--warmup, --steps and --rounds must be >= 1, got {args.warmup}, {args.steps}, {args.rounds}")
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    # measure: every configuration once per round, a calibration before each run and one at the end, so that a
    # slow drift of the shared machine's load touches every configuration alike
    calibrations = []
    steps: dict[str, list[float]] = {c.name: [] for c in configs}
    units: dict[str, dict[str, list[float]]] = {c.name: {} for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            calibrations.append(calibration.measure(matmul_size=768, stream_mib=32, repeats=3))
            step_seconds, trace = run_runtime(config, config.graph(), args.steps, args.warmup)
            steps[config.name] += step_seconds
            per_step: dict[str, list[float]] = {}
            for event in trace.events:  # the runtime blocks on each stage's results inside its span
                if event.step >= args.warmup:
                    per_step.setdefault(event.stage, [0.0] * args.steps)[event.step - args.warmup] += event.duration
            for unit, seconds in per_step.items():
                units[config.name].setdefault(unit, []).extend(seconds)
    calibrations.append(calibration.measure(matmul_size=768, stream_mib=32, repeats=3))
    # predict: one spec, from the median calibration, for every configuration
    measured_hw = calibration.median_calibration(calibrations)
    spec = calibration.spec_from_calibration(measured_hw)
    rates = [c.layer_matmul_flops / 1e9 for c in calibrations]
    print(f"{len(calibrations)} calibrations: layer matmul {min(rates):.0f} .. {max(rates):.0f} GFLOP/s (median "
          f"{statistics.median(rates):.0f}); predictions use the field-wise median calibration")
    options = ExecutionOptions.rpegjax_xla()
    rows = []
    for config in configs:
        graph = config.graph()
        prediction = step_model.Evaluator.for_runtime(config.model, config.workload(), spec, options,
                                                      critic=config.model.replace(value_head=True)).predict(graph)
        measured = steps[config.name]
        step_errors = [_error(prediction.step_seconds, m) for m in measured]
        row = {"name": config.name, "predicted_step": prediction.step_seconds, "measured_step": statistics.median(measured),
               "measured_steps": measured, "step_error": _error(prediction.step_seconds, statistics.median(measured)),
               "units": {}}
        print(f"\n{config.name}: predicted {row['predicted_step']:.3f} s, measured median {row['measured_step']:.3f} s "
              f"(min {min(measured):.3f}, max {max(measured):.3f}, {len(measured)} steps); error "
              f"{row['step_error']:+.1%} (per step {min(step_errors):+.1%} .. {max(step_errors):+.1%})")
        for unit in graph.execution_units():
            name = "+".join(unit)
            predicted = sum(prediction.stage(stage).seconds for stage in unit) - (len(unit) - 1) * spec.device.dispatch_overhead_s
            seconds = statistics.median(units[config.name].get(name, [0.0]))
            row["units"][name] = {"predicted": predicted, "measured": seconds,
                                  "error": _error(predicted, seconds) if seconds > 0 else None}
            error = f"{_error(predicted, seconds):+7.1%}" if seconds > 0 else "      -"
            print(f"    {name:45s} predicted {predicted:8.4f}  measured {seconds:8.4f}  error {error}")
        rows.append(row)
    step_errors = [abs(r["step_error"]) for r in rows]
    big_units = [abs(u["error"]) for r in rows for u in r["units"].values() if u["measured"] > 0.01]
    predicted, measured = [r["predicted_step"] for r in rows], [r["measured_step"] for r in rows]
    tau = kendall_tau(predicted, measured)
    ranking = "n/a (one configuration)" if tau is None else f"{tau:.2f}"
    print(f"\nwhole steps over {len(rows)} configurations: median |error| {statistics.median(step_errors):.1%}, "
          f"max {max(step_errors):.1%}; Kendall tau of predicted vs measured step times {ranking}")
    if big_units:
        print(f"stages over 10 ms ({len(big_units)}): median |error| {statistics.median(big_units):.1%}, "
              f"max {max(big_units):.1%}")
    for i in range(len(rows)):  # the pairs ranked the other way round, with how far apart they measured
        for j in range(i + 1, len(rows)):
            if (predicted[i] - predicted[j]) * (measured[i] - measured[j]) < 0:
                print(f"  discordant: {rows[i]['name']!r} vs {rows[j]['name']!r}: measured ratio "
                      f"{measured[i] / measured[j]:.3f}, predicted {predicted[i] / predicted[j]:.3f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"rows": rows, "kendall_tau": tau, "calibration": dataclasses.asdict(measured_hw),
                       "calibrations": [dataclasses.asdict(c) for c in calibrations]}, file, indent=1)


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


if __name__ == "__main__":
    main()
