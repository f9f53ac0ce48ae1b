"""Predicted vs measured RL steps on this CPU: the performance model after `calibrate()` against a real execution.

    python benchmarks/bench_perfmodel.py [--steps 3] [--only NAME ...] [--json out.json]

For each configuration (model size, batch, response length, GRPO/PPO, fusion, asynchrony) the script
1. builds the RPEG with the builders and transforms (one CPU device, colocated),
2. predicts it with `perfmodel.predict` on the spec that `hardware.calibrate()` measured in this same run,
   with `ExecutionOptions.rpegjax_xla()` (dense masked attention, a fixed-slot KV-cache decode loop, padded batches),
3. executes the graph: every execution unit (a fused group or a stage) is one jit-compiled function built
   from `rpegjax.models` (decode loop with a KV cache, chunked log-probs, value head, AdamW update) run in the
   graph's order, each timed into a `Trace` after blocking on its results;
and prints per-stage and per-step predicted vs measured seconds, the relative errors, their median and maximum
over configurations, and the Kendall tau of the two rankings of step times. The machine is shared and its
load changes by the second, so every timed step is preceded by a short calibration and predicted from it;
a configuration's error is the median of its per-step errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rpegjax.graph import builders, hardware, perfmodel, transforms
from rpegjax.graph.generation_cost import ResponseLengths
from rpegjax.graph.ir import Graph, StageKind
from rpegjax.graph.stage_costs import ExecutionOptions, Workload
from rpegjax.graph.trace import Trace
from rpegjax.models import Decoder, KVCache, ModelConfig
from rpegjax.models.logprobs import logprobs_from_hidden

CHUNK = 256


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
        return transforms.default_fusion(graph) if self.fused else graph

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


# ------------------------------------------------------------------------------------------- stage programs
def _decode_program(graphdef, cfg: ModelConfig, prompt: int, new: int):
    """Prefill + `new` sampled tokens through a fixed-slot KV cache (what the STATIC decode kernel models)."""

    def run(state, prompts, key):
        model = nnx.merge(graphdef, state)
        b = prompts.shape[0]
        cache = KVCache.zeros(cfg, b, prompt + new)
        positions = jnp.broadcast_to(jnp.arange(prompt), (b, prompt))
        hidden, cache = model.hidden_states(prompts, positions, cache=cache)
        logits = model.logits(hidden[:, -1:])[:, 0]
        tokens = jnp.zeros((b, new), jnp.int32)
        logps = jnp.zeros((b, new), jnp.float32)

        def step(i, carry):
            cache, logits, tokens, logps, key = carry
            key, sub = jax.random.split(key)
            token = jax.random.categorical(sub, logits)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
            tokens, logps = tokens.at[:, i].set(token), logps.at[:, i].set(logp)
            hidden, cache = model.hidden_states(token[:, None], (prompt + i) * jnp.ones((b, 1), jnp.int32), cache=cache)
            return cache, model.logits(hidden)[:, 0], tokens, logps, key

        _, _, tokens, logps, _ = jax.lax.fori_loop(0, new, step, (cache, logits, tokens, logps, key))
        return jnp.concatenate([prompts, tokens], axis=1), logps

    return jax.jit(run)


def _forward(graphdef, state, tokens, *, logprobs: bool, values: bool):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model.hidden_states(tokens, positions)
    out = {}
    if logprobs:
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        out["logprobs"] = logprobs_from_hidden(hidden, model.output_kernel(), targets, chunk_size=CHUNK)[0]
    if values:
        out["values"] = model.values(hidden)
    return out


def _update_program(graphdef, optimizer, *, policy: bool, value: bool):
    """One AdamW step on the whole batch: clipped-ratio policy loss with a k3 KL term and/or a value loss."""

    def loss(state, batch):
        model = nnx.merge(graphdef, state)
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        hidden, _ = model.hidden_states(tokens, positions)  # one trunk pass, shared by the policy and value heads
        total = 0.0
        if policy:
            targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
            logp = logprobs_from_hidden(hidden, model.output_kernel(), targets, chunk_size=CHUNK)[0]
            ratio = jnp.exp(logp - batch["old"])
            adv = batch["advantages"][:, None]
            total = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv))
            log_ratio = batch["ref"] - logp
            total = total + 0.04 * jnp.mean(jnp.exp(log_ratio) - log_ratio - 1)
        if value:
            total = total + jnp.mean((model.values(hidden) - batch["returns"]) ** 2)
        return total

    def step(state, opt_state, batch):
        value_, grads = jax.value_and_grad(loss)(state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, value_

    return jax.jit(step, donate_argnums=(0, 1))


class Executor:
    """Runs a one-device graph with real jitted stage programs and records a measured trace."""

    def __init__(self, config: Config):
        cfg = config.model
        self.config = config
        self.graph = config.graph()
        critic_cfg = cfg.replace(value_head=True)
        actor_cfg = critic_cfg if config.shared_critic else cfg
        self.graphdef, self.actor = nnx.split(Decoder(actor_cfg, rngs=nnx.Rngs(0)))
        _, self.reference = nnx.split(Decoder(actor_cfg, rngs=nnx.Rngs(1)))
        self.critic_graphdef, self.critic = nnx.split(Decoder(critic_cfg, rngs=nnx.Rngs(2)))
        self.optimizer = optax.adamw(1e-5)
        self.actor_opt = self.optimizer.init(self.actor)
        self.critic_opt = self.optimizer.init(self.critic)
        self.generate = _decode_program(self.graphdef, actor_cfg, config.prompt_tokens, config.new_tokens)
        self.programs: dict[tuple[str, ...], Callable] = {}
        self.trace = Trace(config.name)
        rng = np.random.default_rng(0)
        b = config.prompts * config.group
        self.prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, config.prompt_tokens)), jnp.int32)
        self.key = jax.random.key(0)
        self.values: dict[str, jax.Array] = {}

    def _inference(self, unit: tuple[str, ...]):
        kinds = [set(self.graph.stage(name).kinds) for name in unit]
        jobs = []  # (output name, which params, logprobs?, values?)
        for name, stage_kinds in zip(unit, kinds):
            if StageKind.REF_LOGPROB in stage_kinds:
                jobs.append((name, "reference", True, False))
            elif StageKind.OLD_LOGPROB in stage_kinds:
                jobs.append((name, "actor", True, StageKind.CRITIC_VALUE in stage_kinds))
            elif StageKind.CRITIC_VALUE in stage_kinds:
                jobs.append((name, "critic", False, True))
        graphdefs = {"reference": self.graphdef, "actor": self.graphdef, "critic": self.critic_graphdef}

        def run(params, tokens):
            return {name: _forward(graphdefs[which], params[which], tokens, logprobs=lp, values=v)
                    for name, which, lp, v in jobs}

        return jax.jit(run)

    def run_unit(self, unit: tuple[str, ...], step: int) -> None:
        kinds = set().union(*(self.graph.stage(name).kinds for name in unit))
        v = self.values
        if StageKind.GENERATE in kinds:
            self.key, sub = jax.random.split(self.key)
            v["tokens"], v["behaviour"] = jax.block_until_ready(self.generate(self.actor, self.prompts, sub))
        elif StageKind.REWARD in kinds:
            tokens = np.asarray(v["tokens"])[:, self.config.prompt_tokens:]
            v["rewards"] = jnp.asarray((tokens % 2 == 0).mean(axis=1), jnp.float32)  # a rule on the host
        elif kinds & {StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB, StageKind.CRITIC_VALUE}:
            program = self.programs.setdefault(unit, self._inference(unit))
            params = {"reference": self.reference, "actor": self.actor, "critic": self.critic}
            out = jax.block_until_ready(program(params, v["tokens"]))
            for name, result in out.items():
                v.update({f"{name}:{key}": value for key, value in result.items()})
        elif StageKind.ADVANTAGE in kinds:
            program = self.programs.setdefault(unit, jax.jit(lambda r: (r.reshape(-1, self.config.group)
                                               - r.reshape(-1, self.config.group).mean(1, keepdims=True)).reshape(-1)))
            v["advantages"] = jax.block_until_ready(program(v["rewards"]))
        elif StageKind.ACTOR_UPDATE in kinds:
            shared = StageKind.CRITIC_UPDATE in kinds
            program = self.programs.setdefault(unit, _update_program(self.graphdef, self.optimizer, policy=True, value=shared))
            batch = self._batch(with_returns=shared)
            self.actor, self.actor_opt, _ = jax.block_until_ready(program(self.actor, self.actor_opt, batch))
        elif StageKind.CRITIC_UPDATE in kinds:
            program = self.programs.setdefault(unit, _update_program(self.critic_graphdef, self.optimizer, policy=False, value=True))
            self.critic, self.critic_opt, _ = jax.block_until_ready(program(self.critic, self.critic_opt, self._batch(with_returns=True)))
        elif StageKind.WEIGHT_SYNC in kinds:
            jax.block_until_ready(self.actor)  # one device, one layout: the generation weights are the training weights

    def _batch(self, *, with_returns: bool) -> dict:
        v = self.values
        tokens = v["tokens"]
        old = next((value for key, value in v.items() if key.endswith(":logprobs") and key.startswith("old")), None)
        ref = next(value for key, value in v.items() if key.endswith(":logprobs") and key.startswith("ref"))
        batch = {"tokens": tokens, "old": old if old is not None else jnp.zeros(tokens.shape), "ref": ref,
                 "advantages": v["advantages"]}
        if with_returns:
            values = next(value for key, value in v.items() if key.endswith(":values"))
            batch["returns"] = values + v["advantages"][:, None]
        return batch

    def run(self, steps: int, warmup: int, before_step: Callable[[int], None]) -> tuple[list[float], Trace]:
        """Warm-up steps, then `steps` timed steps, each preceded by `before_step(index)` (the calibration)."""
        step_seconds = []
        for step in range(warmup + steps):
            if step >= warmup:
                before_step(step - warmup)
            start = time.perf_counter()
            for unit in self.graph.execution_units():
                if step < warmup:
                    self.run_unit(unit, step)
                    continue
                with self.trace.span("+".join(unit), step - warmup, None, "cpu"):
                    self.run_unit(unit, step)
            if step >= warmup:
                step_seconds.append(time.perf_counter() - start)
        return step_seconds, self.trace


# ------------------------------------------------------------------------------------------------ report
def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    score = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in pairs)
    return float(score / len(pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    options = ExecutionOptions.rpegjax_xla()
    rows = []
    for config in CONFIGS:
        if args.only and config.name not in args.only:
            continue
        graph = config.graph()
        critic = config.model.replace(value_head=True)
        units = ["+".join(unit) for unit in graph.execution_units()]
        predictions: list[dict] = []

        def calibrate_and_predict(index: int) -> None:
            # this machine is shared: measure its rates right before each timed step and predict that step
            spec, measured_hw = hardware.calibrate(matmul_size=768, stream_mib=32, repeats=3)
            prediction = perfmodel.predict(graph, config.model, config.workload(), spec, options, critic=critic)
            per_unit = {"+".join(unit): sum(prediction.stage(name).seconds for name in unit)
                        - (len(unit) - 1) * spec.device.dispatch_overhead_s for unit in graph.execution_units()}
            predictions.append({"step": prediction.step_seconds, "units": per_unit,
                                "calibration": dataclasses.asdict(measured_hw)})

        executor = Executor(config)
        step_seconds, trace = executor.run(args.steps, args.warmup, calibrate_and_predict)
        measured_units = {unit: [0.0] * args.steps for unit in units}
        for event in trace.events:
            measured_units[event.stage][event.step] += event.duration
        step_errors = [_error(p["step"], m) for p, m in zip(predictions, step_seconds)]
        row = {"name": config.name, "predicted_step": statistics.median(p["step"] for p in predictions),
               "measured_step": statistics.median(step_seconds), "step_error": statistics.median(step_errors),
               "steps": [{"predicted": p["step"], "measured": m} for p, m in zip(predictions, step_seconds)],
               "calibrations": [p["calibration"] for p in predictions], "units": {}}
        rates = [p["calibration"]["layer_matmul_flops"] / 1e9 for p in predictions]
        print(f"\n{config.name}: predicted {row['predicted_step']:.3f} s, measured {row['measured_step']:.3f} s "
              f"(min {min(step_seconds):.3f}, max {max(step_seconds):.3f}); per-step error median "
              f"{row['step_error']:+.1%} (range {min(step_errors):+.1%} .. {max(step_errors):+.1%}); "
              f"layer matmul rate {min(rates):.0f}..{max(rates):.0f} GFLOP/s")
        for unit in units:
            errors = [_error(p["units"][unit], m) for p, m in zip(predictions, measured_units[unit])]
            predicted = statistics.median(p["units"][unit] for p in predictions)
            measured = statistics.median(measured_units[unit])
            row["units"][unit] = {"predicted": predicted, "measured": measured, "error": statistics.median(errors)}
            print(f"    {unit:45s} predicted {predicted:8.4f}  measured {measured:8.4f}  "
                  f"per-step error median {statistics.median(errors):+7.1%}")
        rows.append(row)
    step_errors = [abs(r["step_error"]) for r in rows]
    big_units = [abs(u["error"]) for r in rows for u in r["units"].values() if u["measured"] > 0.01]
    tau = kendall_tau([r["predicted_step"] for r in rows], [r["measured_step"] for r in rows])
    print(f"\nwhole steps over {len(rows)} configurations: median |error| {statistics.median(step_errors):.1%}, "
          f"max {max(step_errors):.1%}; Kendall tau of predicted vs measured step times {tau:.2f}")
    print(f"stages over 10 ms ({len(big_units)}): median |error| {statistics.median(big_units):.1%}, max {max(big_units):.1%}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"rows": rows, "kendall_tau": tau}, file, indent=1)


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


if __name__ == "__main__":
    main()
