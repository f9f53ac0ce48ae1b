"""One process of the 4-process transfer test (tests/runtime/test_transfers.py): processes 0-1 generate, 2-3 train,
2 CPU devices each, joined with gloo.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=i \
        XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/runtime/transfer_worker.py --out DIR

A two-role pipeline with bound k = 1 whose stages are small but real JAX programs, each launched only by the
processes of its role from one thread: the trainers update a tiny decoder's parameters (training layout, fsdp x
tensor on devices 4-7) with a rollout and send every version to the generation layout (tensor-parallel replicas on
devices 0-3); the generators compute rollout t from weights version t - k and send it back, rows split as the
trainers split them. Each process writes what it saw (versions, spans, checksums, transfer timings) to
DIR/process<i>.json; the test compares them with the one-process computation.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import pathlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax import distributed
from rpegjax.generate.weight_sync import generation_rules
from rpegjax.models import Decoder, ModelConfig
from rpegjax.runtime import transfers
from rpegjax.sharding import ShardingRules, hybrid_device_grid, param_shardings

STEPS, BOUND, ROWS, WIDTH, REPEATS = 4, 1, 8, 16, 3
TINY = {"vocab_size": 128, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 32,
        "intermediate_size": 128}


def initial_params() -> nnx.State:
    return nnx.split(Decoder(ModelConfig(**TINY), rngs=nnx.Rngs(0)))[1]


def rollout_of(params, step: int):
    """'Generation': a rollout that depends on every weight of the version read and on the step."""
    total = sum(jnp.sum(jnp.abs(leaf)) for leaf in jax.tree.leaves(params))
    rows = jnp.arange(ROWS * WIDTH, dtype=jnp.float32).reshape(ROWS, WIDTH)
    return jnp.sin(rows * 0.01 + total * 1e-3 + step)


def update(params, rollout):
    """'Training': every weight moves by an amount that depends on the whole rollout."""
    return jax.tree.map(lambda p: p * 0.99 + 1e-3 * jnp.mean(rollout), params)


def reference(steps: int, bound: int) -> tuple[list[float], list[int]]:
    """The same pipeline in this one process, one device: parameter checksums after each update, versions read."""
    params, history, versions, sums = initial_params(), {}, [], []
    history[0] = params
    for step in range(steps):
        version = max(0, step - bound)
        versions.append(version)
        params = update(params, rollout_of(history[version], step))
        history[step + 1] = params
        sums.append(float(sum(jnp.sum(jnp.abs(leaf)) for leaf in jax.tree.leaves(params))))
    return sums, versions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where each thread waits, then ends the process
    distributed.initialize(distributed.DistributedConfig.from_env())
    me, devices = jax.process_index(), jax.devices()
    generation = Mesh(hybrid_device_grid({"data": 2, "tensor": 2}, devices[:4]), ("data", "tensor"))
    training = Mesh(hybrid_device_grid({"fsdp": 2, "tensor": 2}, devices[4:]), ("fsdp", "tensor"))
    params = initial_params()
    train_shardings = param_shardings(params, training, ShardingRules.fsdp_tp())
    generation_shardings = param_shardings(params, generation, generation_rules())
    # weights: the generation layout laid over the training devices (one all-gather there), then whole shards
    staging = transfers.layout_on(generation_shardings, list(training.devices.flat))
    weights_plan = transfers.plan_transfer(params, staging, generation_shardings)
    rows_shape = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
    rollout_plan = transfers.plan_transfer(rows_shape, NamedSharding(generation, PartitionSpec("data")),
                                           NamedSharding(training, PartitionSpec("fsdp")))
    links = transfers.ProcessTransfers()  # a collective of all four processes, once
    record: dict = {"process": me, "spans": [], "versions": [], "sums": []}

    def span(stage: str, step: int, start: float) -> None:
        # wall-clock times as they are: the one clock the processes of one host share (an origin taken in each
        # process would differ between processes by however long each took to leave the set-up collective)
        record["spans"].append({"stage": stage, "step": step, "start": start, "end": time.time()})

    def checksum_on(mesh: Mesh):
        return jax.jit(lambda p: sum(jnp.sum(jnp.abs(leaf)) for leaf in jax.tree.leaves(p)),
                       out_shardings=NamedSharding(mesh, PartitionSpec()))

    def generate_role() -> None:
        program = jax.jit(rollout_of, static_argnums=1, out_shardings=NamedSharding(generation, PartitionSpec("data")))
        checksum = checksum_on(generation)
        held: dict[int, nnx.State] = {}
        for step in range(STEPS):
            version = max(0, step - BOUND)
            if version not in held:  # each version is offered once: pulled once, kept while steps read it
                held.clear()
                held[version] = jax.block_until_ready(transfers.receive(links, weights_plan, version))
            weights = held[version]
            record["versions"].append(version)
            record["sums"].append(float(checksum(weights)))
            start = time.time()
            rollout = jax.block_until_ready(program(weights, step))
            span("generate", step, start)
            transfers.send(links, rollout_plan, step, rollout)

    def train_role() -> None:
        state = jax.device_put(params, train_shardings)
        stage = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=staging)
        step_program = jax.jit(update, out_shardings=train_shardings)
        checksum = checksum_on(training)
        transfers.send(links, weights_plan, 0, jax.block_until_ready(stage(state)))
        for step in range(STEPS):
            rollout = jax.block_until_ready(transfers.receive(links, rollout_plan, step))  # pulls run async
            start = time.time()
            state = jax.block_until_ready(step_program(state, rollout))
            span("train", step, start)
            record["sums"].append(float(checksum(state)))
            transfers.send(links, weights_plan, step + 1, jax.block_until_ready(stage(state)))

    # weight-sync seconds per GB: 64 MiB of float32 in the generation layout. The trainers offer it before the
    # pipeline, so it is there when the generators pull it after their last step; the pull alone is timed.
    big = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    target = {"w": NamedSharding(generation, PartitionSpec(None, "tensor"))}
    source = transfers.layout_on(target, list(training.devices.flat))
    plan = transfers.plan_transfer(big, source, target)
    if me >= 2:
        fill = jax.jit(lambda value: {"w": jnp.full((4096, 4096), value, jnp.float32)}, out_shardings=source)
        for repeat in range(REPEATS):
            value = fill(np.float32(repeat))
            transfers.send(links, plan, 100 + repeat, jax.block_until_ready(value))
    role = threading.Thread(target=generate_role if me < 2 else train_role, name="rpegjax-role")
    role.start()
    role.join()
    seconds = []
    if me < 2:
        for repeat in range(REPEATS):
            start = time.perf_counter()
            got = jax.block_until_ready(transfers.receive(links, plan, 100 + repeat))
            seconds.append(time.perf_counter() - start)
            assert all(np.all(np.asarray(shard.data) == repeat) for shard in got["w"].addressable_shards)
    record["transfer"] = {"bytes": plan.nbytes, "received_bytes": plan.received_bytes(me), "seconds": seconds}
    try:
        hybrid_device_grid({"data": 2, "tensor": 4}, devices)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    record["hybrid"] = {
        "process_of_tensor_groups": [[d.process_index for d in row] for row in
                                     hybrid_device_grid({"data": 4, "tensor": 2}, devices).reshape(4, 2)],
        "tensor_across_processes": refusal,
    }
    # no collective after set-up: a process waiting in one while a peer pulls from it would deadlock the pull
    (args.out / f"process{me}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
