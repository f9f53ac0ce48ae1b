"""rpegjax.train.run_directory: a run directory is claimed by one run at a time (flock on RUN_DIR/.lock, held for
the run's life, released by the kernel when its holder dies), and checked for an earlier run only under the lock."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from rpegjax.train.run_directory import (
    LOCK_NAME,
    RunDirectoryBusy,
    claim_run_directory,
    drop_if_empty,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]

# a process that claims the directory once `go` exists, writes its pid into it as a run would, holds it `hold`
# seconds and exits 0; or prints the refusal and exits 3
CLAIMANT = """
import os, pathlib, sys, time
from rpegjax.train.run_directory import claim_run_directory
directory, go, hold = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
try:
    lock = claim_run_directory(directory, resume=False, overwrite=False)
except ValueError as error:
    print(error, flush=True)
    sys.exit(3)
(directory / f"metrics-{os.getpid()}.jsonl").write_text("{}\\n")
print("claimed", flush=True)
time.sleep(hold)
"""


def _claimant(tmp_path, directory, hold: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CLAIMANT, str(directory), str(tmp_path / "go"), str(hold)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_of_runs_racing_on_one_empty_directory_exactly_one_proceeds(tmp_path):
    directory = tmp_path / "run"
    racers = [_claimant(tmp_path, directory, hold=3.0) for _ in range(3)]
    time.sleep(2.0)  # every racer imported and waiting
    (tmp_path / "go").touch()
    outputs = [(racer.wait(timeout=60), racer.communicate()[0]) for racer in racers]
    winners = [racer.pid for racer, (code, _) in zip(racers, outputs) if code == 0]
    assert len(winners) == 1, outputs
    assert [p.name for p in directory.iterdir() if p.name != LOCK_NAME] == [f"metrics-{winners[0]}.jsonl"]
    for code, text in outputs:
        if code != 0:
            assert code == 3 and f"run directory {directory} is in use by another run (held by pid {winners[0]} " in text


def test_a_directory_whose_holder_was_killed_is_claimable_again(tmp_path):
    directory = tmp_path / "run"
    (tmp_path / "go").touch()
    holder = _claimant(tmp_path, directory, hold=600.0)
    assert holder.stdout.readline().strip() == "claimed"
    with pytest.raises(RunDirectoryBusy, match=f"in use by another run \\(held by pid {holder.pid} on host "):
        claim_run_directory(directory, resume=True, overwrite=False)  # a resume of a live run is refused too
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with claim_run_directory(directory, resume=True, overwrite=False) as lock:  # the kernel released its lock
        assert lock.held and f"pid {os.getpid()} " in (directory / LOCK_NAME).read_text()
    with pytest.raises(ValueError, match="is not empty"):  # what the dead run wrote is still there
        claim_run_directory(directory, resume=False, overwrite=False)
    claim_run_directory(directory, resume=False, overwrite=True).release()


def test_the_lock_alone_is_no_earlier_run_and_an_unused_directory_is_dropped(tmp_path):
    directory = tmp_path / "run"
    claim_run_directory(directory, resume=False, overwrite=False).release()
    assert [p.name for p in directory.iterdir()] == [LOCK_NAME]  # the lock file stays: it is not a run's file
    lock = claim_run_directory(directory, resume=False, overwrite=False)
    drop_if_empty(lock, fresh=True)  # a run that failed before writing anything leaves nothing behind
    assert not directory.exists() and not lock.held
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        claim_run_directory(file, resume=False, overwrite=False)

