"""The main job under several processes: `scripts/train_grpo.py` with the `distributed` section, two
processes on localhost (CPU, gloo) against one process with the same four devices, and resuming the
two-process run's checkpoint in one process. The fast tests cover the wiring (flags, JSON, resume),
the row split of host work and the weight fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from test_processes import FAST_COMPILE, free_port

from rpegjax import distributed
from rpegjax.distributed import CpuCollectives, DistributedConfig
from rpegjax.graph.ir import Algorithm
from rpegjax.sharding import make_mesh
from rpegjax.train.cli import parse_args
from rpegjax.train.config import RunConfig
from rpegjax.train.overrides import apply_overrides
from rpegjax.train.trainer import _fingerprint

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_grpo.py"
# tests/train/test_train_job.py's tiny job learns nothing in 3 steps (every reward 0, so every loss and gradient
# 0), which would make the comparison blind: here a 2-layer d=64 model is warm-started on countdown long
# enough that rewards differ within groups, so losses, gradients and the next rollouts all depend on
# every row's reward arriving in the right place.
SMALL = [
    "--model.hidden_size=64", "--model.num_layers=2", "--model.num_heads=2", "--model.num_kv_heads=2",
    "--model.head_dim=32", "--model.intermediate_size=128", "--task=countdown", "--data.train_size=64",
    "--data.eval_size=4", "--prompts-per-step=4", "--group-size=4", "--rollout.max_prompt_len=12",
    "--max-new-tokens=12", "--rollout.num_slots=16", "--temperature=1.0", "--warm-start-steps=60",
    "--warm_start.learning_rate=3e-3", "--train.reward_workers=1", "--mesh=data=2,tensor=2", "--async-bound=0",
]
# wall-clock figures differ between runs; a warm start loaded from the cache reports no loss
IGNORED = {"seconds", "tokens_per_second", "reward/seconds", "warm_start/seconds", "warm_start/cached",
           "warm_start/loss"}


# ---- wiring, in this process ------------------------------------------------------------------


def test_distributed_section_parses_from_flags_and_round_trips_through_json():
    config = apply_overrides(RunConfig(), {
        "distributed.coordinator_address": "10.0.0.1:1234", "distributed.num_processes": "4",
        "distributed.process_id": "3", "distributed.local_device_ids": "0,1", "distributed.heartbeat_timeout_s": "7",
        "distributed.cpu_collectives": "mpi",
    })
    assert config.distributed == DistributedConfig(
        coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3, local_device_ids=(0, 1),
        heartbeat_timeout_s=7, cpu_collectives=CpuCollectives.MPI)
    assert RunConfig.from_json(config.to_json()) == config
    assert RunConfig.from_json(RunConfig().to_json()) == RunConfig()
    with pytest.raises(ValueError, match="--distributed.process_id: expected int, got 'x'"):
        apply_overrides(RunConfig(), {"distributed.process_id": "x"})
    with pytest.raises(ValueError, match="local_device_ids must be non-negative"):
        apply_overrides(RunConfig(), {"distributed.local_device_ids": "-1"})


def test_resume_takes_the_run_but_not_the_launch_from_config_json(tmp_path):
    """config.json records process 0's launch; another process resuming must not become process 0."""
    saved = RunConfig(distributed=DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=0))
    saved = saved.replace(train=dataclasses.replace(saved.train, steps=5, run_dir=str(tmp_path)))
    (tmp_path / "config.json").write_text(saved.to_json())
    config, resume = parse_args(["--resume", str(tmp_path), "--distributed.heartbeat_timeout_s=9"], Algorithm.GRPO)
    assert resume == str(tmp_path) and config.train.steps == 5
    assert config.distributed == DistributedConfig(heartbeat_timeout_s=9)


def job_env(devices: int) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "SLURM_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
               PYTHONUNBUFFERED="1")
    return env


BAD_SETTINGS = [
    (["--distributed.num_processes=2", "--distributed.process_id=0"], {},
     "DistributedConfig.coordinator_address ('host:port' of process 0) is required when num_processes=2"),
    ([], {"JAX_NUM_PROCESSES": "two"}, "environment variable JAX_NUM_PROCESSES='two' is not an integer"),
    (["--distributed.process_id=2", "--distributed.num_processes=2"], {},
     "DistributedConfig.process_id must be < num_processes=2, got 2"),
]


@pytest.mark.parametrize("flags, environment, message", BAD_SETTINGS)
def test_bad_distributed_settings_fail_before_joining(tmp_path, monkeypatch, capsys, flags, environment, message):
    """The job's entry point (in this process: a script start each cost ~8 s) refuses with exit status 2."""
    from rpegjax.train.cli import main

    for name in [key for key in os.environ if key.startswith(("JAX_", "SLURM_"))]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    try:
        code = main([f"--run-dir={tmp_path}", *flags], Algorithm.GRPO)
    except SystemExit as exit:  # a flag argparse refuses ends as the script would: exit status 2
        code = exit.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was built or written


def test_the_script_exits_2_on_bad_distributed_settings(tmp_path):
    """The same refusal from `scripts/train_grpo.py` itself, as a launcher sees it (one case of the three above)."""
    flags, environment, message = BAD_SETTINGS[1]
    result = subprocess.run([sys.executable, str(SCRIPT), f"--run-dir={tmp_path}", *flags],
                            env={**job_env(1), **environment}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("rows, count", [(8, 2), (7, 2), (3, 4), (16, 3), (1, 1)])
def test_process_rows_are_contiguous_blocks_covering_every_row_once(rows, count):
    blocks = [distributed.process_rows(rows, process, count) for process in range(count)]
    assert blocks[0].start == 0 and blocks[-1].stop == rows
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    sizes = [block.stop - block.start for block in blocks]
    assert max(sizes) - min(sizes) <= 1
    assert distributed.process_rows(rows) == slice(0, rows)  # this test runs as one process


def test_fingerprint_is_the_float64_sum_of_magnitudes_whatever_the_layout():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rng = np.random.default_rng(0)
    host = {"a": rng.normal(size=(8, 6)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32),
            "c": rng.normal(size=(2, 4, 4)).astype(np.float32)}
    expected = sum(np.abs(value.astype(np.float64)).sum() for value in host.values())
    layouts = [
        {"a": PartitionSpec(("data", "fsdp"), "tensor"), "b": PartitionSpec(), "c": PartitionSpec(None, "tensor")},
        {"a": PartitionSpec(), "b": PartitionSpec("fsdp"), "c": PartitionSpec("data", "fsdp", "tensor")},
    ]
    for layout in layouts:  # replicated shards are counted once
        placed = {name: jax.device_put(value, NamedSharding(mesh, layout[name])) for name, value in host.items()}
        assert _fingerprint(placed) == pytest.approx(expected, rel=1e-12)
    one_device = {name: jax.numpy.asarray(value) for name, value in host.items()}
    assert _fingerprint(one_device) == pytest.approx(expected, rel=1e-12)


# ---- several processes ------------------------------------------------------------------------


def start(run_dir: pathlib.Path, *flags: str, processes: int, devices: int | list[int]
          ) -> list[tuple[subprocess.Popen, str]]:
    """Starts the job as `processes` processes with `devices` CPU devices each (or process i `devices[i]`;
    `--distributed.*` flags); process i's stdout and stderr go to run_dir/../<name>.<i>.out / .err."""
    port = free_port()
    started = []
    counts = devices if isinstance(devices, list) else [devices] * processes
    for process_id in range(processes):
        launch = [] if processes == 1 else [
            f"--distributed.coordinator_address=127.0.0.1:{port}", f"--distributed.num_processes={processes}",
            f"--distributed.process_id={process_id}", "--distributed.initialization_timeout_s=120",
            "--distributed.heartbeat_timeout_s=30", "--distributed.shutdown_timeout_s=60",
        ]
        logs = str(run_dir.parent / f"{run_dir.name}.{process_id}")
        with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
            command = [sys.executable, str(SCRIPT), *SMALL, f"--run-dir={run_dir}", *launch, *flags]
            started.append((subprocess.Popen(command, env=job_env(counts[process_id]), stdout=out, stderr=err,
                                             cwd=run_dir.parent),
                            logs))
    return started


def finish_all(started, timeout: float) -> tuple[list[int], list[tuple[str, str]]]:
    """Each process's exit code and (stdout, stderr), waiting at most `timeout` and killing what still runs."""
    try:
        for child, _ in started:
            child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for child, _ in started:
            if child.poll() is None:
                child.kill()
                child.wait()
    outputs = [(pathlib.Path(f"{logs}.out").read_text(), pathlib.Path(f"{logs}.err").read_text())
               for _, logs in started]
    return [child.returncode for child, _ in started], outputs


def finish(started, timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of each process; fails with their logs unless every one exits 0 within `timeout`."""
    codes, outputs = finish_all(started, timeout)
    assert codes == [0] * len(started), "\n".join(f"--- process {i} (exit {code})\n{err[-3000:]}"
                                                  for i, (code, (_, err)) in enumerate(zip(codes, outputs)))
    return outputs


def summary(stdout: str) -> dict | None:
    """The summary line, or None: standard output carries nothing else (gloo's messages go to standard error)."""
    lines = stdout.splitlines()
    assert len(lines) <= 1, stdout
    return json.loads(lines[0]) if lines else None


def records(run_dir: pathlib.Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{key: value for key, value in json.loads(line).items() if key not in IGNORED} for line in lines]


def assert_same_records(ours: list[dict], theirs: list[dict]) -> None:
    """Both runs execute the same partitioned programs on the same four devices; only how cross-process
    reductions are carried out may differ, so float32 metrics agree to 1e-5 relative (1e-7 absolute for
    values that are sums cancelling to ~1e-8, such as a GRPO loss at ratio 1). The train/rollout mismatch metrics
    are themselves differences of two log-probs of magnitude ~1-10 that agree to rounding, so a one-ulp change in
    either (4.8e-7 at |log p| in [4, 8): a cross-process sum in another order) moves them by that much absolutely:
    they are compared to 1e-6."""
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys(), (a["step"], sorted(a.keys() ^ b.keys()))
        for key in a:
            atol = 1e-6 if key.startswith("mismatch/") else 1e-7
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=atol, err_msg=f"step {a['step']} {key}")


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_resumes_in_one(tmp_path):
    """2 processes x 2 CPU devices (mesh data=2 x tensor=2: batch rows and slots split across processes)
    run 2 GRPO steps; 1 process with the same 4 devices runs 3 steps from the same warm-start weights (the
    cache the two processes wrote). Steps 1-2 agree; then one process resumes the two-process run from its
    step-2 checkpoint and its step 3 agrees too."""
    two, one = tmp_path / "two", tmp_path / "one"
    outputs = finish(start(two, "--steps=2", "--checkpoint-every=1", f"--warm_start.cache_dir={tmp_path}/cache_two",
                           processes=2, devices=2), timeout=420)
    (out0, err0), (out1, err1) = outputs
    assert summary(out0)["steps"] == 2 and summary(out1) is None  # process 0 speaks for both
    assert "held-out accuracy at start" in err0 and "held-out accuracy" not in err1
    two_records = records(two)
    assert [r["step"] for r in two_records] == [0, 1, 2, 2]  # written once: process 1 writes no metrics
    assert len(list((two / "tensorboard").iterdir())) == 1
    assert json.loads((two / "config.json").read_text())["distributed"]["num_processes"] == 2
    # not a blind comparison: rewards differed within groups, so the policy moved
    assert any(r.get("reward", 0) > 0 for r in two_records)
    assert all(r["grad_norm"] > 0 for r in two_records if "loss" in r)

    shutil.copytree(tmp_path / "cache_two", tmp_path / "cache_one")  # the same warm-start weights, bit for bit
    single = start(one, "--steps=3", "--checkpoint-every=1", f"--warm_start.cache_dir={tmp_path}/cache_one",
                   processes=1, devices=4)
    resumed = start(two, "--resume", str(two), "--steps=3", processes=1, devices=4)
    finish(single, timeout=420)
    (_, resume_err), = finish(resumed, timeout=420)
    one_records = records(one)
    assert one_records[0].get("eval/accuracy") is not None and json.loads(
        (one / "metrics.jsonl").read_text().splitlines()[0])["warm_start/cached"] == 1.0
    assert_same_records(two_records[:3], one_records[:3])
    assert "resumed from step 2" in resume_err
    assert_same_records(records(two), one_records)


@pytest.mark.slow
def test_dynamic_sampling_decides_alike_in_every_process(tmp_path):
    """`--recipe dapo` with 2 processes x 2 devices against 1 process with the same 4 devices: the rollout stage
    gathers each round's rewards, so every process keeps the same groups and draws the same extra rounds, and
    every metric of every step agrees (rounds, kept and dropped groups, generated tokens, loss)."""
    two, one = tmp_path / "two", tmp_path / "one"
    flags = ["--recipe=dapo", "--steps=2", "--grpo.max_extra_rounds=8", f"--warm_start.cache_dir={tmp_path}/cache"]
    finish(start(two, *flags, processes=2, devices=2), timeout=600)
    finish(start(one, *flags, processes=1, devices=4), timeout=600)
    two_records = records(two)
    assert sum(r.get("dynamic_sampling/extra_rounds", 0) for r in two_records) > 0  # not a blind comparison
    assert_same_records(two_records, records(one))


@pytest.mark.slow
def test_a_disaggregated_run_over_four_processes_trains_like_one_process(tmp_path):
    """`--rollout-devices=4` as 4 processes x 2 CPU devices: processes 0-1 generate (data=2 x tensor=2), 2-3 train
    (data=4), bound 1. One process with the same 8 devices runs the same plan from the same warm-start weights.
    Every metric of every step agrees; the first training process writes the run and prints the summary, and the
    training processes checkpoint it."""
    split, one = tmp_path / "split", tmp_path / "one"
    flags = ["--steps=3", "--async-bound=1", "--rollout-devices=4", "--mesh=data=4", "--rollout-mesh=data=2,tensor=2",
             "--train.export_hf=false", "--checkpoint-every=2"]
    finish(start(one, *flags, f"--warm_start.cache_dir={tmp_path}/cache_one", processes=1, devices=8), timeout=420)
    shutil.copytree(tmp_path / "cache_one", tmp_path / "cache_split")  # the same warm-start weights, bit for bit
    outputs = finish(start(split, *flags, f"--warm_start.cache_dir={tmp_path}/cache_split", processes=4, devices=2),
                     timeout=420)
    assert [summary(out) is not None for out, _ in outputs] == [False, False, True, False]
    assert "held-out accuracy at start" in outputs[2][1] and "held-out accuracy" not in outputs[0][1]
    split_records, one_records = records(split), records(one)
    assert [r["step"] for r in split_records] == [0, 1, 2, 3, 3]
    assert [r["staleness"] for r in split_records if "staleness" in r] == [0, 1, 1]
    assert any(r.get("reward", 0) > 0 for r in split_records)  # not a blind comparison
    assert_same_records(split_records, one_records)
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["2", "3"]
    assert {e["name"] for e in json.loads((split / "trace.json").read_text())["traceEvents"] if "name" in e} >= {
        "actor_update", "weight_sync"}
    # the training processes' checkpoint restores in a colocated run of one process too (over process groups:
    # tests/distributed/test_group_failures.py), which trains on from it
    (_, resume_err), = finish(start(split, "--resume", str(split), "--steps=4", "--rollout-devices=0", "--mesh=data=8",
                                    processes=1, devices=8), timeout=420)
    assert "resumed from step 3" in resume_err
    assert [r["step"] for r in records(split)] == [0, 1, 2, 3, 4, 4]
