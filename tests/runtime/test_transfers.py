"""rpegjax.runtime.transfers: transfer plans (in this process, 8 virtual devices) and a real 4-process pipeline
(2 generation + 2 training processes of 2 CPU devices, gloo) launched from tests/runtime/transfer_worker.py."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.runtime import transfers
from rpegjax.sharding import make_mesh

WORKER = pathlib.Path(__file__).with_name("transfer_worker.py")


def test_plan_routes_every_target_block_from_a_source_device_holding_it_spreading_replicas():
    devices = jax.devices()
    target = NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tensor")), PartitionSpec(None, "tensor"))
    source = transfers.layout_on(target, devices[4:])
    plan = transfers.plan_transfer(jax.ShapeDtypeStruct((8, 6), jnp.float32), source, target)
    routes = [route for found in plan.routes.values() for route in found]  # one process: one pair
    assert list(plan.routes) == [(0, 0)] and len(routes) == 4
    by_target = {route.target.id: route for route in routes}
    assert {k: (r.source.id, r.index) for k, r in by_target.items()} == {
        0: (4, ((0, 8), (0, 3))), 1: (5, ((0, 8), (3, 6))), 2: (6, ((0, 8), (0, 3))), 3: (7, ((0, 8), (3, 6)))}
    assert plan.nbytes == 4 * 8 * 3 * 4
    # a source with one replica of each block serves both target replicas from it
    narrow = NamedSharding(Mesh(np.array(devices[6:8]), ("tensor",)), PartitionSpec(None, "tensor"))
    plan = transfers.plan_transfer(jax.ShapeDtypeStruct((8, 6), jnp.float32), narrow, target)
    assert sorted((r.target.id, r.source.id) for r in plan.routes[(0, 0)]) == [(0, 6), (1, 7), (2, 6), (3, 7)]


def test_plan_refuses_a_source_without_the_target_blocks_naming_the_leaf():
    mesh = make_mesh({"data": 2, "tensor": 4})
    like = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(ValueError, match=r"leaf \['w'\] \(8, 8\): no source device holds the block"):
        transfers.plan_transfer(like, NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec("tensor")))
    with pytest.raises(ValueError, match=r"layout_on: the target layout splits weights over axes \['tensor'\] into 4 "
                                         r"blocks; 6 source devices cannot hold them"):
        transfers.layout_on(NamedSharding(mesh, PartitionSpec(None, "tensor")), jax.devices()[:6])


@pytest.mark.parametrize("sources", [2, 6, 8, 1])
def test_uneven_device_counts_lay_whole_blocks_over_the_source(sources):
    """Generation on 4 devices (data=2 x tensor=2) fed from 1, 2, 6 or 8 training devices: the replicas axis takes
    up the difference, every target block comes whole from a source device holding it, every source block is a
    target block, and a tree split over every axis gets an axis of replicas of its own."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tensor"))
    target = {"w": NamedSharding(mesh, PartitionSpec(None, "tensor")), "b": NamedSharding(mesh, PartitionSpec())}
    like = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32), "b": jax.ShapeDtypeStruct((6,), jnp.float32)}
    if sources == 1:
        with pytest.raises(ValueError, match="1 source devices cannot hold them"):
            transfers.layout_on(target, devices[:1])
        return
    pool = devices[8 - sources:] if sources <= 4 else devices[:sources]
    staged = transfers.layout_on(target, pool)
    assert dict(staged["w"].mesh.shape) == {"data": sources // 2, "tensor": 2}
    assert set(staged["w"].mesh.devices.flat) == set(pool)
    plan = transfers.plan_transfer(like, staged, target)
    routes = [route for found in plan.routes.values() for route in found]
    assert sorted(r.target.id for r in routes if r.leaf == 1) == [0, 1, 2, 3]  # "w": one route per target device
    assert {r.index for r in routes if r.leaf == 1} == {((0, 8), (0, 3)), ((0, 8), (3, 6))}
    both = {"w": NamedSharding(mesh, PartitionSpec("data", "tensor"))}
    staged = transfers.layout_on(both, devices[:8])
    assert dict(staged["w"].mesh.shape) == {"data": 2, "tensor": 2, "staging_replicas": 2}
    transfers.plan_transfer({"w": like["w"]}, staged, both)


@pytest.mark.slow
def test_four_processes_two_roles_exchange_weights_and_rollouts_like_one_process(tmp_path):
    """Processes 0-1 generate, 2-3 train, each role from one thread launching programs only on its own devices;
    weights and rollouts move through `jax.experimental.transfer`. Versions read never exceed the bound, the
    parameters equal the one-process computation, generation of step t+1 runs while step t trains."""
    sys.path.insert(0, str(WORKER.parent))
    from transfer_worker import BOUND, STEPS, reference

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    children = []
    for process in range(4):
        env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "SLURM_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONUNBUFFERED="1",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID=str(process),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(WORKER.parents[2]), env.get("PYTHONPATH")])))
        with open(tmp_path / f"worker{process}.log", "w") as log:  # the child keeps its own descriptor
            children.append(subprocess.Popen([sys.executable, str(WORKER), "--out", str(tmp_path)], env=env,
                                             stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [child.wait(timeout=150) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    logs = "\n".join((tmp_path / f"worker{p}.log").read_text()[-3000:] for p in range(4))
    assert codes == [0] * 4, logs
    generators, trainers = [[json.loads((tmp_path / f"process{p}.json").read_text()) for p in group]
                            for group in ((0, 1), (2, 3))]
    sums, versions = reference(STEPS, BOUND)
    for record in generators:
        assert record["versions"] == versions and all(step - v <= BOUND for step, v in enumerate(record["versions"]))
        # the weights each generator received are the trainers' versions exactly: version v after v updates
        expected = [None] + sums
        for version, received in zip(record["versions"], record["sums"]):
            if version:
                np.testing.assert_allclose(received, expected[version], rtol=1e-6)
        assert [s["stage"] for s in record["spans"]] == ["generate"] * STEPS
    for record in trainers:
        np.testing.assert_allclose(record["sums"], sums, rtol=1e-6)  # sharded over 4 devices vs one device
    # generation of step t+1 overlaps training of step t, in other processes, on the wall clock (one machine: the
    # processes share it; each process's own origin would not be shared)
    generate = {s["step"]: s for s in generators[0]["spans"]}
    train = {s["step"]: s for s in trainers[0]["spans"]}
    assert generate[1]["start"] < train[0]["end"]  # step 1 reads version 0: it need not wait for step 0's update
    for step in range(STEPS):  # training of step t waits for its rollout
        assert train[step]["start"] > generate[step]["end"]
    # every target shard arrived once, timed after it was offered
    for record in generators:
        transfer = record["transfer"]
        assert transfer["bytes"] == 2 * 4096 * 4096 * 4 and transfer["received_bytes"] == 4096 * 4096 * 4
        assert len(transfer["seconds"]) == 3
        print(f"process {record['process']} pulled {transfer['received_bytes'] / 1e6:.0f} MB of weights in "
              f"{min(transfer['seconds']):.3f} s (best of 3): "
              f"{min(transfer['seconds']) / (transfer['received_bytes'] / 1e9):.2f} s/GB")
    # a hybrid mesh over 4 processes x 2 devices keeps every tensor pair inside one process
    assert generators[0]["hybrid"]["process_of_tensor_groups"] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert "does not factor over 4 granules of 2 devices" in generators[0]["hybrid"]["tensor_across_processes"]
