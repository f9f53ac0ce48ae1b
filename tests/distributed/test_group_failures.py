"""A disaggregated run over process groups that loses a process, and its resume in another layout.

Four processes of `scripts/train_grpo.py` on localhost with 2 CPU devices each (0-1 generate, data=2 x tensor=2;
2-3 train, data=4); process 3 is killed (SIGKILL) once the step-1 checkpoint is committed. Every survivor stops
within 15 s with one line naming process 3, the checkpoints stay whole, and the run resumes as three processes
(the training state on one process of 2 devices, data=2: a layout other than the saved one, and fewer training
than generation devices) to its last step, with the Hugging Face export at the end. Every metric of every step
equals one process running the saved plan on 8 devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_distributed_job import SCRIPT, SMALL, assert_same_records, job_env, records
from test_processes import free_port

from rpegjax.distributed import DEAD_PEER_EXIT

FLAGS = ["--steps=3", "--async-bound=1", "--rollout-devices=4", "--mesh=data=4", "--rollout-mesh=data=2,tensor=2",
         "--checkpoint-every=1", "--train.keep_checkpoints=3"]


def start(run_dir: pathlib.Path, devices: list[int], *flags: str) -> list[tuple[subprocess.Popen, pathlib.Path]]:
    """One process of the job per entry of `devices` (its CPU device count), on localhost."""
    port = free_port()
    started = []
    for process, count in enumerate(devices):
        launch = [f"--distributed.coordinator_address=127.0.0.1:{port}", f"--distributed.num_processes={len(devices)}",
                  f"--distributed.process_id={process}", "--distributed.initialization_timeout_s=120",
                  "--distributed.heartbeat_timeout_s=60", "--distributed.shutdown_timeout_s=60"]
        log = run_dir.parent / f"{run_dir.name}.{len(devices)}.{process}.err"
        with open(log, "w") as err:
            child = subprocess.Popen([sys.executable, str(SCRIPT), *SMALL, f"--run-dir={run_dir}", *launch, *flags],
                                     env=job_env(count), stdout=subprocess.DEVNULL, stderr=err, cwd=run_dir.parent)
        started.append((child, log))
    return started


def wait(started, timeout: float) -> tuple[list[int | None], list[float]]:
    """Exit codes and wall-clock exit times (polled every 50 ms); what still runs after `timeout` is killed."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(started) and time.monotonic() < deadline:
        for index, (child, _) in enumerate(started):
            if index not in ended and child.poll() is not None:
                ended[index] = time.time()
        time.sleep(0.05)
    for child, _ in started:
        if child.poll() is None:
            child.kill()
            child.wait()
    return [child.returncode for child, _ in started], [ended.get(i, float("inf")) for i in range(len(started))]


def logs(started) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for _, log in started)


@pytest.mark.slow
def test_a_killed_training_process_stops_the_run_which_resumes_on_fewer_processes(tmp_path):
    run, one = tmp_path / "run", tmp_path / "one"
    reference = subprocess.run([sys.executable, str(SCRIPT), *SMALL, f"--run-dir={one}", *FLAGS,
                                "--train.export_hf=false", f"--warm_start.cache_dir={tmp_path}/cache_one"],
                               env=job_env(8), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    shutil.copytree(tmp_path / "cache_one", tmp_path / "cache_run")  # the same warm-start weights, bit for bit
    cache = f"--warm_start.cache_dir={tmp_path}/cache_run"

    first = start(run, [2, 2, 2, 2], *FLAGS, "--train.export_hf=false", cache)
    committed = run / "checkpoints" / "1"
    deadline = time.monotonic() + 900
    while not committed.is_dir() and time.monotonic() < deadline and all(c.poll() is None for c, _ in first):
        time.sleep(0.05)
    assert committed.is_dir(), logs(first)
    killed_at = time.time()
    os.kill(first[3][0].pid, signal.SIGKILL)
    codes, ended = wait(first, timeout=120)
    seconds = [round(ended[p] - killed_at, 2) for p in range(3)]
    print(f"process 3 killed: survivors 0, 1, 2 stopped {seconds} s later")
    assert codes[3] == -signal.SIGKILL and codes[:3] == [DEAD_PEER_EXIT] * 3, logs(first)
    for _, log in first[:3]:
        lines = [line for line in log.read_text().splitlines() if "error: process 3 of 4" in line]
        assert len(lines) == 1 and "died at" in lines[0], logs(first)
    assert max(seconds) < 15, (seconds, logs(first))

    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[0] >= 1, steps
    # training on one process of 2 devices (the saved run's mesh data=4 of 2 processes, as data=2)
    # (the run's flags again: SMALL's, which `start` puts first, would otherwise override the saved ones)
    resumed = start(run, [2, 2, 2], "--resume", str(run), *FLAGS, "--mesh=data=2", "--train.export_hf=true", cache)
    codes, _ = wait(resumed, timeout=900)
    assert codes == [0, 0, 0], logs(resumed)
    err = resumed[2][1].read_text()
    assert f"resumed from step {steps[-1]}" in err, logs(resumed)
    assert (run / "hf" / "config.json").is_file() and any((run / "hf").glob("*.safetensors")), logs(resumed)
    ours, theirs = records(run), records(one)
    assert [r["step"] for r in ours][-2:] == [3, 3] and any(r.get("reward", 0) > 0 for r in ours)
    shown = {"step", "staleness", "reward", "correction/weight_mean", "loss"}
    table = "\n".join(f"{name}: {[{k: v for k, v in r.items() if k in shown} for r in rows]}"
                      for name, rows in (("resumed", ours), ("one process", theirs)))
    try:  # the steps before the kill, and those trained again after the resume
        assert_same_records(ours, theirs)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{table}\n{logs(resumed)}") from None
    print(f"resumed from step {steps[-1]} on 2 + 1 processes (saved by 2 + 2, data=4 -> data=2): every metric of "
          f"{len(ours)} records equals one process; HF export written")
    assert json.loads((run / "config.json").read_text())["distributed"]["num_processes"] == 3
