"""Two hosts on one machine: two network namespaces with their own addresses (link-local 169.254.N.1 and .2, made
by this test on a veth pair between them and removed after), each a "host" running its own processes of
`scripts/train_grpo.py`. The coordinator listens on host A's address, every process finds its own host's address
from the route to it, and the transfer servers listen there within `--distributed.port_range`: weights and
rollouts cross the veth pair. Needs root (`ip netns`); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from test_distributed_job import SCRIPT, SMALL, assert_same_records, finish_all, job_env, records, summary


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces (name, address) of hosts A and B joined by a veth pair; torn down after the test."""
    if shutil.which("ip") is None:
        pytest.skip("two-host test: the `ip` command (iproute2) is not installed")
    tag = f"rpg{os.getpid() % 100000}"
    names, subnet = (f"{tag}a", f"{tag}b"), os.getpid() % 250 + 1
    made = _ip("netns", "add", names[0])
    if made.returncode != 0:
        pytest.skip(f"two-host test: cannot make a network namespace (needs root): {made.stderr.strip()}")
    hosts = [(names[0], f"169.254.{subnet}.1"), (names[1], f"169.254.{subnet}.2")]
    try:
        steps = [("netns", "add", names[1]), ("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")]
        for (name, address), link in zip(hosts, (f"{tag}x", f"{tag}y")):
            steps += [("link", "set", link, "netns", name), ("-n", name, "addr", "add", f"{address}/24", "dev", link),
                      ("-n", name, "link", "set", link, "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, (step, done.stderr)
        for name, address in hosts:  # `ip netns exec` mounts these over /etc/hosts: the hostname is the host's
            folder = pathlib.Path("/etc/netns") / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        yield hosts
    finally:
        for name in names:
            _ip("netns", "del", name)  # takes its end of the veth pair, and so the pair, with it
            shutil.rmtree(pathlib.Path("/etc/netns") / name, ignore_errors=True)


def start_on_hosts(run_dir: pathlib.Path, placement: list[tuple[str, str, int]], *flags: str
                   ) -> list[tuple[subprocess.Popen, str]]:
    """The job as one process per (namespace, host address, CPU devices) of `placement`, the coordinator on the
    first's address; process i's output goes to run_dir/../<name>.<i>.out / .err."""
    coordinator = f"{placement[0][1]}:12355"  # a fresh namespace: nothing else listens there
    started = []
    for process, (namespace, _, devices) in enumerate(placement):
        launch = [f"--distributed.coordinator_address={coordinator}", f"--distributed.num_processes={len(placement)}",
                  f"--distributed.process_id={process}", "--distributed.initialization_timeout_s=120",
                  "--distributed.heartbeat_timeout_s=30", "--distributed.shutdown_timeout_s=60",
                  "--distributed.port_range=41000-41099"]
        logs = str(run_dir.parent / f"{run_dir.name}.{process}")
        command = ["ip", "netns", "exec", namespace, sys.executable, str(SCRIPT), *SMALL, f"--run-dir={run_dir}",
                   *launch, *flags]
        with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
            started.append((subprocess.Popen(command, env=job_env(devices), stdout=out, stderr=err,
                                             cwd=run_dir.parent), logs))
    return started


def _failed(codes, outputs) -> str:
    return "\n".join(f"--- process {i} (exit {code})\n{err[-3000:]}" for i, (code, (_, err)) in
                     enumerate(zip(codes, outputs)))


@pytest.mark.slow
def test_a_run_over_two_hosts_equals_one_process(tmp_path, two_hosts):
    """Host A runs the two generation processes (2 CPU devices each: data=2 x tensor=2), host B the training
    process (2 devices: data=2, fewer training than generation devices). The same plan in one process with 6
    devices, from the same warm-start weights: every metric of every step, and every parameter of the Hugging Face
    export written at the end (over two hosts: by the training process alone), within 1e-5."""
    (a, address_a), (b, address_b) = two_hosts
    split, one = tmp_path / "split", tmp_path / "one"
    flags = ["--steps=2", "--async-bound=1", "--rollout-devices=4", "--mesh=data=2", "--rollout-mesh=data=2,tensor=2",
             "--checkpoint-every=1"]
    reference = subprocess.run([sys.executable, str(SCRIPT), *SMALL, f"--run-dir={one}", *flags,
                                f"--warm_start.cache_dir={tmp_path}/cache_one"], env=job_env(6),
                               capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    shutil.copytree(tmp_path / "cache_one", tmp_path / "cache_split")  # the same warm-start weights, bit for bit
    placement = [(a, address_a, 2), (a, address_a, 2), (b, address_b, 2)]
    codes, outputs = finish_all(start_on_hosts(split, placement, *flags,
                                               f"--warm_start.cache_dir={tmp_path}/cache_split"), timeout=600)
    assert codes == [0, 0, 0], _failed(codes, outputs)
    assert [summary(out) is not None for out, _ in outputs] == [False, False, True]
    servers = next(line for line in outputs[2][1].splitlines() if line.startswith("transfer servers:"))
    for process, address in enumerate([address_a, address_a, address_b]):
        port = int(servers.split(f"process {process} at {address}:")[1].split(",")[0])
        assert 41000 <= port <= 41099, servers
    split_records, one_records = records(split), records(one)
    assert any(r.get("reward", 0) > 0 for r in split_records)  # not a blind comparison
    assert_same_records(split_records, one_records)
    ours, theirs = exported(split / "hf"), exported(one / "hf")
    assert sorted(ours) == sorted(theirs) and len(ours) > 10
    worst = 0.0
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        worst = max(worst, float(np.abs(ours[name] - value).max()))
    print(f"two hosts ({address_a}: generation 2 x 2 devices, {address_b}: training 1 x 2 devices) == one process: "
          f"{len(split_records)} records, every metric within 1e-5; {len(ours)} exported tensors, largest difference "
          f"{worst:.2e}; {servers}")
    assert json.loads((split / "config.json").read_text())["distributed"]["port_range"] == "41000-41099"


def exported(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory's safetensors files."""
    from safetensors.numpy import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
