"""One process of a (multi-process) GRPO run, launched by tests/distributed/test_processes.py.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
        XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/distributed/worker.py train --out DIR

`train`: joins the others (rpegjax.distributed, configured from the environment), builds a mesh over
every process's devices (fsdp=2 x tensor=2: parameters and batch rows are split across processes),
feeds each process only its rows of a fixed synthetic batch, runs STEPS GRPO updates of the tiny
model, gathers the parameters and (process 0) writes result.json + params.npz, and writes an orbax
checkpoint (DIR/ckpt) collectively. Run with JAX_NUM_PROCESSES=1 and 4 devices it is the
single-process reference.

`load`: loads --checkpoint onto the same global mesh with `load_pretrained(mesh=...)` (each process reads
only its own windows), writes the gathered parameters (params.npz) and exports the sharded model to
DIR/export with `save_pretrained` (process 0 writes).

`lone-save`: process 1 alone writes a checkpoint (`Checkpointer(processes=[1])`, as the lone training process of
a run whose process 0 generates) of arrays on its own devices, and DIR/expected.npz; process 0 only joins.

`die`: process --victim (default 1) kills itself (SIGKILL) right after joining, writing the time to
DIR/died_at; the other keeps computing over the global mesh and must be terminated by the distributed
runtime (missing heartbeats), not hang.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax import distributed

B, G, LENGTH, STEPS = 8, 4, 16, 3
MESH = {"fsdp": 2, "tensor": 2}


def synthetic_rollouts() -> dict[str, np.ndarray]:
    """A fixed batch built with numpy only: same in every process."""
    rng = np.random.default_rng(1234)
    tokens = np.zeros((B, LENGTH), np.int32)
    token_mask = np.zeros((B, LENGTH), bool)
    response_mask = np.zeros((B, LENGTH), bool)
    for row in range(B):
        prompt, response = int(rng.integers(2, 6)), int(rng.integers(3, 10))
        tokens[row, : prompt + response] = rng.integers(1, 128, size=prompt + response)
        token_mask[row, : prompt + response] = True
        response_mask[row, prompt : prompt + response] = True
    return {"tokens": tokens, "token_mask": token_mask, "response_mask": response_mask}


def reward_rule(tokens: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Host-side 'verifier': 1 when the response's token sum is even (each group gets a mix)."""
    return (np.where(response_mask, tokens, 0).sum(axis=1) % 2 == 0).astype(np.float32)


def flat_numpy(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def combine_over_processes(mesh) -> dict:
    """Each of `rpegjax.distributed.collectives` once, on values that differ between processes."""
    me = jax.process_index()
    result = {
        # 2^-40 survives only in float64: the sums must not travel as float32
        "sum": distributed.sum_over_processes(1.0 + me + 2.0**-40),
        "mesh_sum": distributed.sum_over_processes(0.5 + me + 2.0**-40, mesh),
        "mesh_gather": distributed.gather_over_mesh(np.array([[me, -me], [7, 2**20 + me]], np.int32), mesh).tolist(),
        "all_true": distributed.holds_in_every_process(True),
        "only_process_0": distributed.holds_in_every_process(me == 0),
        "text": distributed.broadcast_text("runs/2026-12-01 grpo é" if me == 0 else None),
    }
    distributed.barrier("worker: collectives done")
    return result


def train(out: pathlib.Path) -> None:
    from flax import nnx

    from rpegjax.learners.batch import TrainBatch
    from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
    from rpegjax.learners.optim import OptimizerConfig
    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.sharding import ShardingRules
    from rpegjax.train.checkpoint import Checkpointer

    mesh = distributed.global_mesh(MESH)
    processes = sorted({device.process_index for device in mesh.devices.flat})
    assert processes == list(range(jax.process_count())), f"mesh spans processes {processes}"

    grpo = GRPOConfig(
        group_size=G, kl_coef=0.04, clip_high=0.28, num_minibatches=2,
        optimizer=OptimizerConfig(learning_rate=1e-3),
    )
    distributed.assert_same_across_processes(grpo, "GRPO config")
    learner = GRPOLearner(grpo, Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0)), mesh=mesh, rules=ShardingRules.fsdp_tp())

    full = synthetic_rollouts()
    distributed.assert_same_across_processes(full, "synthetic batch")
    rows = distributed.process_rows(B, sharding=learner.placement.rows)
    assert rows == distributed.process_rows(B), f"rows {rows} are not this process's block"
    local = {name: value[rows] for name, value in full.items()}
    # host work on this process's rows only, then gathered: every process sees every reward
    local["rewards"] = reward_rule(local["tokens"], local["response_mask"])
    all_rewards = distributed.gather_to_all(local["rewards"])
    np.testing.assert_array_equal(all_rewards, reward_rule(full["tokens"], full["response_mask"]))
    batch = TrainBatch(**distributed.host_local_to_global(local, mesh, learner.placement.rows.spec))
    assert jax.process_count() == 1 or not batch.tokens.is_fully_addressable
    # the global batch assembled from every process's rows is the full batch, row for row
    expected = dict(full, rewards=all_rewards)
    fields = {name: getattr(batch, name) for name in expected}
    for name, value in distributed.gather_to_all(fields).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)

    state = learner.init_state()
    ref_logprobs = learner.logprobs(learner.params, batch)
    losses = []
    for _ in range(STEPS):
        old = learner.logprobs(state.params, batch)
        step_batch, _ = learner.compute_advantages(
            batch.replace(old_logprobs=old, behaviour_logprobs=old, ref_logprobs=ref_logprobs)
        )
        state, metrics = learner.update(state, step_batch)
        losses.append(float(metrics["loss"]))  # replicated: readable in every process

    params = flat_numpy(distributed.gather_to_all(state.params))
    checkpointer = Checkpointer(out / "ckpt", keep=1)
    checkpointer.save(STEPS, {"params": state.params}, {"step": STEPS, "losses": losses})
    checkpointer.close()

    collectives = combine_over_processes(mesh)
    try:  # the contract check must fail, naming what, when processes disagree
        distributed.assert_same_across_processes(jax.process_index(), "process index")
        disagreement = None
    except RuntimeError as error:
        disagreement = str(error)

    if distributed.is_main_process():
        np.savez(out / "params.npz", **params)
        result = {"losses": losses, "process_count": jax.process_count(), "disagreement": disagreement,
                  "collectives": collectives}
        (out / "result.json").write_text(json.dumps(result))


def load(out: pathlib.Path, checkpoint: pathlib.Path) -> None:
    """Loads `checkpoint` onto the global mesh (each process reading its own windows), writes the gathered
    parameters (process 0) and exports the sharded model to out/export (collectively)."""
    from flax import nnx

    from rpegjax.models.hf import load_pretrained, save_pretrained

    mesh = distributed.global_mesh(MESH)
    model, cfg = load_pretrained(checkpoint, mesh=mesh)
    state = nnx.state(model)
    leaves = jax.tree.leaves(state)
    spread = sum(not leaf.is_fully_addressable for leaf in leaves)
    assert jax.process_count() == 1 or spread == len(leaves), f"only {spread} of {len(leaves)} span processes"
    params = flat_numpy(distributed.gather_to_all(state))
    save_pretrained(model, cfg, out / "export")
    assert (out / "export" / "config.json").is_file() or jax.process_index() != 0
    if distributed.is_main_process():
        np.savez(out / "params.npz", **params)
        (out / "result.json").write_text(json.dumps({"process_count": jax.process_count()}))


def lone_save(out: pathlib.Path) -> None:
    from rpegjax.sharding import make_mesh
    from rpegjax.train.checkpoint import Checkpointer

    if jax.process_index() != 1:
        return
    local = make_mesh({"data": jax.local_device_count()}, devices=jax.local_devices())
    weights = np.arange(32, dtype=np.float32).reshape(8, 4) * 0.5 - 3.0
    arrays = {"w": jax.device_put(weights, NamedSharding(local, PartitionSpec("data"))),
              "step": jnp.asarray(7, jnp.int32)}
    checkpointer = Checkpointer(out / "ckpt", keep=1, processes=[1])
    checkpointer.save(7, arrays, {"next_step": 7})
    checkpointer.close()
    np.savez(out / "expected.npz", w=weights, step=np.int32(7))


def die(cfg: distributed.DistributedConfig, victim: int, out: pathlib.Path) -> None:
    mesh = distributed.global_mesh(MESH)
    if cfg.process_id == victim:
        (out / "died_at").write_text(repr(time.time()))  # wall clock: compared with the survivor's exit
        print(f"process {victim}: killing itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))
    total = jax.jit(lambda a: jnp.sum(a * a))
    start = time.monotonic()
    while time.monotonic() - start < 600:  # only the runtime's failure detection may end this loop
        float(total(x))
        time.sleep(0.05)
    print(f"process {cfg.process_id}: the dead peer was never detected", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "load", "lone-save", "die"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--checkpoint", help="load: the checkpoint directory")
    parser.add_argument("--heartbeat-timeout", type=int, default=None, help="default: DistributedConfig's")
    parser.add_argument("--victim", type=int, default=1, help="die: the process that exits abruptly")
    args = parser.parse_args()
    # a process the distributed runtime aborts (SIGABRT) must not leave a core file behind
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cfg = distributed.DistributedConfig.from_env(
        initialization_timeout_s=120, heartbeat_timeout_s=args.heartbeat_timeout, shutdown_timeout_s=30
    )
    distributed.initialize(cfg)
    print(f"process {cfg.process_id} of {cfg.num_processes}: joined", flush=True)
    if args.mode == "train":
        train(pathlib.Path(args.out))
    elif args.mode == "load":
        load(pathlib.Path(args.out), pathlib.Path(args.checkpoint))
    elif args.mode == "lone-save":
        lone_save(pathlib.Path(args.out))
    else:
        die(cfg, args.victim, pathlib.Path(args.out))
        sys.exit(1)


if __name__ == "__main__":
    main()
