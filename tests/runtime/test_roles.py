"""rpegjax.runtime.roles: which process takes which role (in this process, 8 virtual devices as 4 pretend
processes), and a disaggregated GRPO run over 4 processes (2 generation + 2 training processes of 2 CPU devices,
gloo) against the same plan run by one process on 8 devices (tests/runtime/roles_worker.py)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from rpegjax.graph import builders, transforms
from rpegjax.graph.ir import GraphError
from rpegjax.rewards.runner import TermStats, merge_terms
from rpegjax.runtime import roles

WORKER = pathlib.Path(__file__).with_name("roles_worker.py")
# values that are times, not results
TIMINGS = {"reward/seconds"}


class _Device:
    def __init__(self, id: int, process_index: int):
        self.id, self.process_index = id, process_index


@pytest.fixture
def four_processes(monkeypatch):
    """8 devices, 2 per process, as jax.devices() of a 4-process job would list them."""
    devices = [_Device(i, i // 2) for i in range(8)]
    monkeypatch.setattr(roles.jax, "process_count", lambda: 4)
    monkeypatch.setattr("rpegjax.runtime.meshes.jax.devices", lambda: devices)
    return devices


def _graph(rollout_devices: int | None):
    graph = builders.grpo_graph(use_reference=True, async_bound=1, num_devices=8, parallel={"data": 8})
    if rollout_devices is None:
        return graph
    return transforms.disaggregate(graph, rollout_devices, {"data": rollout_devices}, {"data": 8 - rollout_devices})


def test_roles_follow_the_processes_owning_each_placement(four_processes, monkeypatch):
    assert roles.process_groups(_graph(None)) is None  # colocated: every process runs every stage
    groups = roles.process_groups(_graph(4))
    assert groups == roles.ProcessGroups(generation=(0, 1), training=(2, 3))
    assert [groups.role_of(p) for p in range(4)] == ["generate", "generate", "train", "train"]
    monkeypatch.setattr(roles.jax, "process_index", lambda: 3)
    assert groups.role == roles.Role.TRAIN
    assert [d.id for d in roles.heads(_graph(4), "rollout")] == [0, 2]
    assert [d.id for d in roles.heads(_graph(4), "train")] == [4, 6]


def test_a_placement_splitting_a_process_between_roles_is_refused(four_processes):
    with pytest.raises(GraphError, match=r"stage 'generate' .* processes \[0, 1\] and stages .* on processes "
                                         r"\[1, 2, 3\]: process\(es\) \[1\] would hold devices of both"):
        roles.process_groups(_graph(3))


def test_host_records_round_trip_and_refuse_what_does_not_fit():
    record = {"status": "ok", "rewards": [float(np.float32(0.1)), 1.0], "rows": [[0, 1, 5, 3, 0, 2, 7, False]]}
    encoded = roles._encode(record, 256, "a piece")
    assert encoded.dtype == np.uint8 and roles._decode(encoded) == record
    assert np.float32(roles._decode(encoded)["rewards"][0]) == np.float32(0.1)  # float32 values exactly
    with pytest.raises(ValueError, match="a piece: .* bytes of host data do not fit the 32 bytes"):
        roles._encode(record, 32, "a piece")


def test_reward_terms_travel_in_the_host_records_and_add_up():
    """Each generation process's record carries its block's per-function reward sums; the trainer adds them."""
    records = [{"terms": [["m:f", 1.5, 3, 0], ["m:g", 0.0, 1, 2]]}, {"terms": [["m:f", 0.5, 1, 1], ["m:g", 2.0, 2, 0]]}]
    decoded = [roles._decode(roles._encode(record, 256, "a piece")) for record in records]
    merged = merge_terms(roles._record_terms(record) for record in decoded)
    assert merged == (TermStats(name="m:f", total=2.0, scored=4, errors=1), TermStats(name="m:g", total=2.0, scored=3, errors=2))


def _launch(out: pathlib.Path, processes: int, devices: int, args: list[str]) -> list[subprocess.Popen]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    children = []
    for process in range(processes):
        env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "SLURM_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(WORKER.parents[2]), env.get("PYTHONPATH")])))
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(process))
        with open(out / f"worker{process}.log", "w") as log:  # the child keeps its own descriptor
            children.append(subprocess.Popen([sys.executable, str(WORKER), "--out", str(out), *args], env=env,
                                             stdout=log, stderr=subprocess.STDOUT))
    return children


def _wait(out: pathlib.Path, children: list[subprocess.Popen], timeout: float) -> None:
    try:
        codes = [child.wait(timeout=timeout) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    logs = "\n".join((out / f"worker{p}.log").read_text()[-3000:] for p in range(len(children)))
    assert codes == [0] * len(children), logs


def _run_split_and_one(tmp_path: pathlib.Path, *args: str) -> tuple[list[dict], dict, pathlib.Path, pathlib.Path]:
    """The worker as 4 processes x 2 devices and as 1 process x 8 devices; their records and output directories.
    Checks what every plan must show: the roles, the bound, every metric and the trained parameters as one
    process computes them, and that each group ran only its own stages."""
    split, one = tmp_path / "split", tmp_path / "one"
    split.mkdir()
    one.mkdir()
    _wait(split, _launch(split, 4, 2, list(args)), timeout=300)
    _wait(one, _launch(one, 1, 8, list(args)), timeout=300)
    records = [json.loads((split / f"process{p}.json").read_text()) for p in range(4)]
    reference = json.loads((one / "process0.json").read_text())
    assert [r["role"] for r in records] == ["generate", "generate", "train", "train"] and reference["role"] is None
    bound, steps = reference["async_bound"], len(reference["steps"])
    for record in records[2:]:
        # the bound: step t generated with version t - k (0 for the first k + 1 steps), every sequence of it
        assert [s["version"] for s in record["steps"]] == [max(0, t - bound) for t in range(steps)]
        assert all(s["completion_versions"] == [s["version"]] for s in record["steps"])
        # the same numbers as one process: every metric of every step (and the data position), both trainers
        assert len(record["steps"]) == steps
        for mine, theirs in zip(record["steps"], reference["steps"]):
            assert mine["data_state"] == theirs["data_state"]
            assert mine["metrics"].keys() == theirs["metrics"].keys()
            for key, value in mine["metrics"].items():
                if key not in TIMINGS:
                    np.testing.assert_allclose(value, theirs["metrics"][key], rtol=1e-5, atol=1e-7,
                                               err_msg=f"step {mine['step']} {key}")
    assert any(s["metrics"]["reward"] > 0 for s in reference["steps"])  # not a blind comparison
    # each reward function's mean and errors, gathered from the generation processes' records
    assert all({"reward/__main__:length_reward", "reward/__main__:short_answers/errors"} <= s["metrics"].keys()
               for s in records[2]["steps"])
    ours, theirs = np.load(split / "params.npz"), np.load(one / "params.npz")
    assert sorted(ours.files) == sorted(theirs.files)
    for name in ours.files:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # the generation processes generated every step and trained none; the training processes the reverse
    for record in records[:2]:
        assert sorted(e["step"] for e in record["events"] if e["stage"] == "generate") == list(range(steps))
        assert not any("update" in e["stage"] for e in record["events"]) and not record["steps"]
    for record in records[2:]:
        assert not any(e["stage"] == "generate" for e in record["events"])
    return records, reference, split, one


@pytest.mark.slow
def test_four_processes_run_a_disaggregated_grpo_plan_like_one_process(tmp_path):
    """Processes 0-1 generate (data=2 x tensor=2), 2-3 train (data=4), bound 1, 3 GRPO steps; one process with the
    same 8 devices runs the same plan. Versions never exceed the bound, every metric and the trained parameters
    agree, and generation of step t+1 runs while step t trains, in other processes."""
    records, reference, _, _ = _run_split_and_one(tmp_path)
    assert reference["async_bound"] == 1
    assert all(s["metrics"]["grad_norm"] > 0 for s in reference["steps"])
    steps = len(reference["steps"])
    # overlap across processes, on the wall clock that processes of one host share: generation of step t + 1
    # (process 0) starts before the update of step t (process 2) ends, and each update starts after its rollout
    generate = {e["step"]: e for e in records[0]["events"] if e["stage"] == "generate"}
    update = {e["step"]: e for e in records[2]["events"] if e["stage"] == "actor_update"}
    for step in range(steps - 1):
        assert generate[step + 1]["start"] < update[step]["end"], (step, generate, update)
    for step in range(steps):
        assert update[step]["start"] > generate[step]["end"]
    # weight sync across the groups: each version a rollout reads, offered once by each trainer, pulled once by
    # each generator; seconds per GB from offer (or pull, if later) to arrival
    versions = sorted({max(0, t - 1) for t in range(steps)})
    offers = {p: {o["version"]: o["time"] for o in records[p]["weight_offers"]} for p in (2, 3)}
    assert all(sorted(offered) == versions for offered in offers.values())
    for record in records[:2]:
        pulls = record["weight_pulls"]
        assert [p["version"] for p in pulls] == versions
        # from the moment the last of its sources offered it (or the pull began, if later) to its arrival
        seconds = [p["end"] - max(p["start"], *(offers[source][p["version"]] for source in p["sources"]))
                   for p in pulls]
        gigabytes = pulls[0]["bytes"] / 1e9
        print(f"process {record['process']}: {pulls[0]['bytes'] / 1e6:.3f} MB of weights per version, "
              f"{min(seconds) * 1e3:.1f} ms at best: {min(seconds) / gigabytes:.1f} s/GB")


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_four_processes_run_disaggregated_ppo_like_one_process(tmp_path, critic):
    """PPO (a separate critic updated in the actor's program, or a value head on the shared trunk) over the same
    2 + 2 processes: the critic stages run in the training processes, with the numbers of one process."""
    records, reference, _, _ = _run_split_and_one(tmp_path, f"--algorithm=ppo-{critic}")
    assert all("value_loss" in s["metrics"] for s in reference["steps"])
    assert any(e["stage"].startswith("critic") or "value" in e["stage"] or "old_logprob" in e["stage"]
               for e in records[2]["events"])


@pytest.mark.slow
def test_the_planners_disaggregated_plan_runs_as_two_plus_two_processes(tmp_path):
    """The planner's best disaggregated plan for 8 devices (as tests/perf/planner/test_search.py runs it in one
    process), saved as JSON and executed through `graph.plan` by 2 generation + 2 training processes."""
    from rpegjax.models import ModelConfig
    from rpegjax.perf import planner
    from rpegjax.perf.model import step_model
    from rpegjax.perf.model.generation_cost import ResponseLengths
    from rpegjax.perf.model.stage_costs import Workload
    from rpegjax.perf.reference import presets

    shape = ModelConfig(vocab_size=99, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                        intermediate_size=64)
    workload = Workload(prompts=4, group_size=2, prompt_tokens=12, responses=ResponseLengths.fixed(6))
    evaluator = step_model.Evaluator.for_runtime(shape, workload, presets.gh200_quad(8))
    space = planner.PlanSpace(async_bounds=(0, 1), fusion=(False, True), microbatches=(1, 2), tensor_sizes=(1,),
                              generation_fractions=(0.5,), reshard_inference=(True,), dtype="float32")
    search = planner.Planner(evaluator, algorithm="grpo", num_devices=8, use_reference=True, space=space)
    best = search.search(top=1).best
    plan = tmp_path / "plan.json"
    plan.write_text(best.graph.to_json())
    generate = best.graph.stage("generate")
    assert set(best.graph.placements[generate.placement].device_indices) == {0, 1, 2, 3}
    records, reference, _, _ = _run_split_and_one(tmp_path, f"--plan={plan}")
    assert reference["async_bound"] == best.graph.async_bound
    executed = {e["stage"] for record in records for e in record["events"]}
    for unit in best.graph.execution_units():  # every unit of the plan ran, in the processes of its role
        assert "+".join(unit) in executed or set(unit) <= executed, (unit, executed)


def _run_partial(out: pathlib.Path, mode: str, processes: int) -> list[dict]:
    """The worker's partial-rollout run (`--partial=mode`) as `processes` processes (1 device each: generation
    and training) or one process of 2 devices; each process's record."""
    out.mkdir()
    _wait(out, _launch(out, processes, 2 // processes, ["--partial", mode]), timeout=300)
    return [json.loads((out / f"process{p}.json").read_text()) for p in range(processes)]


def _assert_within_the_token_bound(steps: list[dict], lag: int) -> None:
    """Every trained token lags at most `lag` versions, and the version-lag metrics are those of the tokens."""
    for step in steps:
        lags = np.concatenate([step["step"] - np.asarray(s["versions"]) for s in step["sequences"]])
        assert lags.max() <= lag and lags.min() >= 0, step["step"]
        assert step["metrics"]["version_lag/max"] == lags.max()
        assert step["metrics"]["version_lag/mean"] == pytest.approx(lags.mean())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "waiting"])
def test_partial_rollouts_over_process_groups_train_what_one_process_trains(tmp_path, mode):
    """Partial rollouts with process 0 generating and process 1 training (bound 1, a token lag of 3; weights at step
    starts only, or in flight once half a step's groups have completed, waiting for them: no timing in the results)
    against the same plan in one process: the same trained sequences (prompts, tokens, each token's weights
    version, behaviour log-probs), the same groups carried after every step (what checkpoints hold) and every
    metric, partial rollouts' and version lags' included."""
    from roles_worker import TOKEN_LAG

    generation, training = _run_partial(tmp_path / "split", mode, 2)
    (reference,) = _run_partial(tmp_path / "one", mode, 1)
    assert (generation["role"], training["role"], reference["role"]) == ("generate", "train", None)
    assert not generation["steps"] and len(training["steps"]) == len(reference["steps"]) == 5
    for mine, theirs in zip(training["steps"], reference["steps"], strict=True):
        assert mine["data_state"] == theirs["data_state"]
        assert mine["carry"] == theirs["carry"]
        for ours, one in zip(mine["sequences"], theirs["sequences"], strict=True):
            assert (ours["prompt"], ours["response"], ours["versions"]) == (one["prompt"], one["response"],
                                                                              one["versions"])
            np.testing.assert_allclose(ours["logprobs"], one["logprobs"], atol=1e-6)
        assert mine["metrics"].keys() == theirs["metrics"].keys()
        for key, value in mine["metrics"].items():
            if key not in TIMINGS:
                np.testing.assert_allclose(value, theirs["metrics"][key], rtol=1e-5, atol=1e-7,
                                           err_msg=f"step {mine['step']} {key}")
    _assert_within_the_token_bound(training["steps"], TOKEN_LAG)
    steps = training["steps"]
    assert sum(s["metrics"]["partial/carried_sequences"] for s in steps) > 0  # sequences crossed steps
    assert any(group["samples"][0]["tokens"] for s in steps for group in s["carry"]["groups"])
    in_flight = sum(s["metrics"]["partial/weight_updates_in_flight"] for s in steps)
    assert in_flight == 0 if mode == "fixed" else in_flight > 0


@pytest.mark.slow
def test_weights_in_flight_over_process_groups_stay_within_the_token_bound(tmp_path):
    """The same split run taking weights in flight: the generation process picks up the version the training
    process offers while a step still generates (its decode chunks made slow), the sequences running continue
    with it, and no trained token lags beyond the bound."""
    from roles_worker import TOKEN_LAG

    generation, training = _run_partial(tmp_path / "split", "inflight", 2)
    steps = training["steps"]
    _assert_within_the_token_bound(steps, TOKEN_LAG)
    assert sum(s["metrics"]["partial/weight_updates_in_flight"] for s in steps) > 0
    # a token of step t sampled by version t: taken in flight (at step start only t - 1 is there, bound 1)
    assert any(max(seq["versions"], default=-1) == s["step"] for s in steps if s["step"] for seq in s["sequences"])
    pulled = [p["version"] for p in generation["weight_pulls"]]
    assert len(pulled) == len(set(pulled))  # every version pulled once
