"""One process of the 4-process disaggregated GRPO test (tests/runtime/test_roles.py), or, with one process and 8
devices, its one-process reference.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=i \
        XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/runtime/roles_worker.py --out DIR

The plan: generation on devices 0-3 (processes 0-1, data=2 x tensor=2), every other stage on devices 4-7 (processes
2-3, data=4), asynchrony bound 1, a tiny model, STEPS steps. Every process builds the runtime tests' small setup
(`tiny_setup.py`) and runs the `Runtime`; each writes DIR/process<i>.json (its role, the trace with
wall-clock times, the versions it generated with, the metrics of each step, the weight transfers) and the lowest
training process DIR/params.npz (the trained parameters, gathered over the training processes only).

With `--partial` (2 processes x 1 device, or its one-process reference on 2 devices): generation on device 0,
training on device 1, partial rollouts (3 versions of token lag, long-tailed responses) for PARTIAL_STEPS steps;
each step's record then holds its trained sequences (tokens, per-token versions, behaviour log-probs) and its
carry. `--partial=inflight` takes weights in flight as they arrive; the generation process then emulates a slow
decode: between decode chunks it looks for newer weights for up to INFLIGHT_WAIT_S (a decode chunk that long), so
that the training processes' next version can arrive while a step still generates. `--partial=waiting` takes the
next one once half of the groups a step lacks have completed, waiting for it (reproducible).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import pathlib
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax import distributed
from rpegjax.data.iterator import DataIterator
from rpegjax.graph.ir import Graph
from rpegjax.graph.trace import Trace
from rpegjax.rewards.custom import WeightedReward
from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig
from rpegjax.runtime.roles import Role
from tiny_setup import TinyRun, TinySetup, built, built_on

STEPS, BOUND = 3, 1
PARTIAL_STEPS, TOKEN_LAG, INFLIGHT_WAIT_S = 5, 3, 0.5
PARTIAL_SETUP = TinySetup(async_bound=1, max_new_tokens=12, chunk_steps=2, rollout_devices=1,
                          train_mesh=(("data", 1),), rollout_mesh=(("data", 1),))


def setup_of(algorithm: str = "grpo", width: int = 32) -> TinySetup:
    """The run: GRPO, or PPO with a `separate` or `shared` critic (`ppo-separate`, `ppo-shared`), on the graph of
    the flags above. `width` (the hidden size) makes the model larger, to measure weight sync at a size where
    bandwidth, not latency, counts."""
    # 2 KV heads: the generation layout's tensor=2 splits them
    setup = TinySetup(width=width, num_kv_heads=2, async_bound=BOUND, rollout_devices=4, train_mesh=(("data", 4),),
                      rollout_mesh=(("data", 2), ("tensor", 2)))
    if algorithm.startswith("ppo-"):
        setup = setup.replace(ppo_critic=algorithm.removeprefix("ppo-"))
    return setup


def build(algorithm: str, plan: str | None, width: int) -> TinyRun:
    """The setup built on its own graph, or on the graph JSON `plan` (a graph, or `scripts/plan.py --json` output:
    its best plan)."""
    setup = setup_of(algorithm, width)
    if plan is None:
        return built(setup)
    data = json.loads(pathlib.Path(plan).read_text())
    if isinstance(data, dict) and "plans" in data:
        data = data["plans"][0]["graph"]
    return built_on(setup, Graph.from_dict(data).validate())


def length_reward(text, example):
    """A reward with signal for an untrained model (the task's would be 0 everywhere: a blind comparison)."""
    return float(len(text) % 3) / 2


def short_answers(prompts, completions, **columns):
    """A batched (TRL-form) second term, so that each function's metrics are compared across processes too."""
    return [float(len(completion) < 3) for completion in completions]


def _slow_decode(runtime: Runtime) -> None:
    """A generation process's decode chunks made INFLIGHT_WAIT_S long while newer weights may come (see above)."""
    newest = runtime.rollout_stage.newest

    def waiting(newer_than: int, at_most: int):
        deadline = time.monotonic() + INFLIGHT_WAIT_S
        while (found := newest(newer_than, at_most)) is None and newer_than < at_most and time.monotonic() < deadline:
            time.sleep(0.01)
        return found

    runtime.rollout_stage.newest = waiting


def _sequences(result) -> list[dict]:
    return [{"prompt": c.prompt_ids.tolist(), "response": c.response_ids.tolist(),
             "versions": c.versions().tolist(), "logprobs": c.behaviour_logprobs.tolist()} for c in result.completions]


def run(out: pathlib.Path, algorithm: str, plan: str | None, width: int, partial: str) -> None:
    parts = built(PARTIAL_SETUP) if partial != "off" else build(algorithm, plan, width)
    reward = WeightedReward.of(length_reward, (short_answers, 0.25))
    rewards = RewardRunner(reward, RewardRunnerConfig(timeout_s=10.0, workers=1, isolation="thread"))
    programs = parts.programs(rewards)
    options, steps = {}, STEPS
    if partial != "off":  # stop tokens (a third of the vocabulary): response lengths from 1 to the budget
        vocab = programs.sampler.cfg.vocab_size
        programs.rollout.sampling = dataclasses.replace(programs.rollout.sampling, stop_ids=tuple(range(1, vocab, 3)))
        options["partial"] = PartialRolloutConfig(max_token_lag=TOKEN_LAG, inflight_weights=partial != "fixed",
                                                  inflight_after=0.5 if partial == "waiting" else None)
        steps = PARTIAL_STEPS
    data = DataIterator(parts.train_examples, batch_size=parts.setup.prompts_per_step, seed=0)
    trace = Trace(clock=time.time)  # one host: the wall clock is shared by the processes
    runtime = Runtime(parts.graph, programs, data, prompt_ids=parts.prompt_ids, key=jax.random.key(7), trace=trace,
                      **options)
    role = runtime.role
    if partial == "inflight" and role == Role.GENERATE:
        _slow_decode(runtime)
    results = []
    state = None if role == Role.GENERATE else parts.learner.init_state()
    state = runtime.run(state, start_step=0, num_steps=steps, on_step=lambda result, _: results.append(result))
    rewards.close()
    me = jax.process_index()
    record = {
        "process": me, "role": None if role is None else role.value, "async_bound": runtime.async_bound,
        "events": [{"stage": e.stage, "step": e.step, "version": e.version, "start": e.start + trace.origin,
                    "end": e.end + trace.origin} for e in trace.events],
        "steps": [{"step": r.step, "version": r.version, "metrics": r.metrics,
                   "completion_versions": sorted({c.version for c in r.completions}),
                   "data_state": r.data_state,
                   **({"sequences": _sequences(r), "carry": r.carry} if partial != "off" else {})} for r in results],
    }
    if runtime.links is not None:
        links = runtime.links
        record["weight_offers"] = [dict(o, time=o["time"] + trace.origin) for o in links.weight_offers]
        record["weight_pulls"] = [dict(p, start=p["start"] + trace.origin, end=p["end"] + trace.origin)
                                  for p in links.weight_pulls]
        record["weights_bytes"] = links.weights_bytes
    if role != Role.GENERATE:
        # gathered by a program of the training processes only: no collective spans the two groups
        mesh = parts.learner.placement.mesh
        whole = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))(state.params)
        if me == min(d.process_index for d in mesh.devices.flat):
            np.savez(out / "params.npz", **{jax.tree_util.keystr(path): np.asarray(leaf.addressable_shards[0].data)
                                            for path, leaf in jax.tree_util.tree_flatten_with_path(whole)[0]})
    (out / f"process{me}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--algorithm", default="grpo", choices=["grpo", "ppo-separate", "ppo-shared"])
    parser.add_argument("--plan", default=None, help="a graph JSON to execute")
    parser.add_argument("--width", type=int, default=32, help="the model's hidden size (measurements)")
    parser.add_argument("--partial", default="off", choices=["off", "fixed", "inflight", "waiting"],
                        help="partial rollouts (the 2-device setup), with weights in flight or not")
    args = parser.parse_args()
    # a hang shows where each thread waits, then ends the process: before the test gives up (300 s), not while a
    # loaded machine still compiles
    faulthandler.dump_traceback_later(280, exit=True)
    distributed.initialize(distributed.DistributedConfig.from_env())
    run(args.out, args.algorithm, args.plan, args.width, args.partial)


if __name__ == "__main__":
    main()
