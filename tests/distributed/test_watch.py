"""rpegjax.distributed.watch: three processes on localhost (tests/distributed/watch_worker.py). A killed process
ends every survivor within seconds (15 s is the bound asked for; the heartbeat timeout is 60 s here, so only the
watch can meet it), each with one line naming the dead process; a process that raises ends the others with its
message after the grace period; a clean finish exits 0 everywhere."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
from test_processes import free_port

from rpegjax.distributed import DEAD_PEER_EXIT, ProcessAddress
from rpegjax.distributed.watch import FAILURE_GRACE_S

WORKER = pathlib.Path(__file__).with_name("watch_worker.py")
REPO = WORKER.parents[2]


def launch(out: pathlib.Path, mode: str, *extra: str, processes: int = 3) -> list[subprocess.Popen]:
    port = free_port()
    children = []
    for process in range(processes):
        env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "SLURM_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                   JAX_PROCESS_ID=str(process),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
        with open(out / f"worker{process}.log", "w") as log:
            children.append(subprocess.Popen([sys.executable, str(WORKER), mode, "--out", str(out), *extra], env=env,
                                             stdout=log, stderr=subprocess.STDOUT))
    return children


def wait(children: list[subprocess.Popen], timeout: float) -> tuple[list[int], list[float]]:
    """Exit codes and wall-clock exit times (polled every 50 ms); kills what still runs after `timeout`."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(children) and time.monotonic() < deadline:
        for index, child in enumerate(children):
            if index not in ended and child.poll() is not None:
                ended[index] = time.time()
        time.sleep(0.05)
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()
    return [child.returncode for child in children], [ended.get(i, float("inf")) for i in range(len(children))]


def text(out: pathlib.Path, process: int) -> str:
    return (out / f"worker{process}.log").read_text()


@pytest.mark.parametrize("victim", [2, pytest.param(0, marks=pytest.mark.slow, id="coordinator")])
def test_a_killed_process_ends_every_survivor_within_seconds_naming_it(tmp_path, victim):
    codes, ended = wait(launch(tmp_path, "kill", "--victim", str(victim)), timeout=120)
    died = float((tmp_path / "died_at").read_text())
    survivors = [p for p in range(3) if p != victim]
    logs = "\n".join(text(tmp_path, p) for p in range(3))
    assert codes[victim] == -9, logs
    seconds = [ended[p] - died for p in survivors]
    print(f"victim {victim}: survivors ended {[round(s, 2) for s in seconds]} s after the kill")
    for process in survivors:
        lines = [line for line in text(tmp_path, process).splitlines() if "error:" in line]
        assert len(lines) == 1 and f"process {victim} of 3 (127.0.0.1" in lines[0] and "died at" in lines[0], logs
        if victim != 0:  # not the heartbeat's abort; a dead coordinator fails JAX's own next call to it at once too
            assert codes[process] == DEAD_PEER_EXIT, logs
            assert "detected fatal errors" not in text(tmp_path, process), logs
    assert max(seconds) < 15, (seconds, logs)


def test_a_failing_process_ends_the_others_with_its_message_and_a_clean_finish_exits_zero(tmp_path):
    started = time.time()
    codes, ended = wait(launch(tmp_path, "fail", "--victim", "1"), timeout=120)
    logs = "\n".join(text(tmp_path, p) for p in range(3))
    # the failing process reported its own error; its exit may then be JAX's abort (the coordinator left first)
    assert codes[0] == codes[2] == DEAD_PEER_EXIT and codes[1] in (2, -6), logs
    assert "process 1: error: the victim's own error" in text(tmp_path, 1)
    for process in (0, 2):
        assert "error: process 1 of 3 (127.0.0.1" in text(tmp_path, process), logs
        assert "failed: ValueError: the victim's own error" in text(tmp_path, process), logs
        assert ended[process] - started >= FAILURE_GRACE_S  # the grace to fail on its own came first
    finished = tmp_path / "finished"
    finished.mkdir()
    codes, _ = wait(launch(finished, "finish"), timeout=120)
    assert codes == [0, 0, 0], "\n".join(text(finished, p) for p in range(3))


def test_ports_are_fixed_slots_of_the_range_and_a_small_or_taken_range_is_named():
    import socket

    from rpegjax.distributed import PortRange

    assert ProcessAddress("127.0.0.1", None).ports_for(1, 3) == [0, 0, 0]
    first = free_port()
    ranged = ProcessAddress("127.0.0.1", PortRange(first, first + 6))
    assert ranged.watch_port == first
    assert ranged.ports_for(0, 3) == [first + 1, first + 2, first + 3]
    assert ranged.ports_for(1, 3) == [first + 4, first + 5, first + 6]
    with pytest.raises(OSError, match=rf"port_range {first}-{first + 6} is too small: .* the 3-th on 127.0.0.1 and "
                                      r"needs 3 port\(s\) .* give at least 10 ports"):
        ranged.ports_for(2, 3)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first + 2))
        busy.listen()
        with pytest.raises(OSError, match=rf"port {first + 2} on 127.0.0.1, of process 0, is taken"):
            ranged.ports_for(0, 3)
