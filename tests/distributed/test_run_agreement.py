"""The processes of one run agree before anything is built: a configuration that differs between them ends every
process with an error naming the setting and both values (no traceback), and the run directory is claimed once,
by process 0, whose refusal stops every process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from test_distributed_job import job_env
from test_processes import free_port

from rpegjax.train.run_directory import claim_run_directory

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "train_grpo.py"


def _two_processes(run_dir: pathlib.Path, flags: list[list[str]]) -> list[tuple[int, str]]:
    """(exit code, stderr) of the job started as two processes, process i with `flags[i]`."""
    port = free_port()
    children = []
    for process_id in range(2):
        launch = [f"--distributed.coordinator_address=127.0.0.1:{port}", "--distributed.num_processes=2",
                  f"--distributed.process_id={process_id}", "--distributed.initialization_timeout_s=120",
                  "--distributed.heartbeat_timeout_s=30", "--distributed.shutdown_timeout_s=30"]
        command = [sys.executable, str(SCRIPT), f"--run-dir={run_dir}", "--steps=1", *launch, *flags[process_id]]
        children.append(subprocess.Popen(command, env=job_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True))
    try:
        return [(child.wait(timeout=240), child.communicate()[1]) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()


def test_processes_started_with_different_settings_name_the_setting(tmp_path):
    outputs = _two_processes(tmp_path / "run", [["--data.seed=3"], ["--data.seed=4"]])
    for process_id, (code, err) in enumerate(outputs):
        assert code == 2, err[-3000:]
        assert (f"process {process_id}: error: the run configuration differs across processes (data.seed: 3 in "
                "process 0, 4 in process 1)") in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_run_directory_in_use_stops_every_process_of_a_new_run(tmp_path):
    run_dir = tmp_path / "run"
    with claim_run_directory(run_dir, resume=True, overwrite=False):
        outputs = _two_processes(run_dir, [[], []])
    (code0, err0), (code1, err1) = outputs
    assert code0 == 2 and f"is in use by another run (held by pid {os.getpid()} " in err0, err0[-3000:]
    assert code1 == 2 and f"process 0 could not claim the run directory {run_dir}" in err1, err1[-3000:]
    assert "Traceback" not in err0 + err1
