"""rpegjax.distributed: configuration from flags / environment / SLURM, the per-process data helpers,
and real multi-process runs on localhost (CPU, gloo collectives) launched from tests/distributed/worker.py.

The multi-process tests start child processes with their own environment (2 virtual CPU devices
each); this test process keeps the 8 devices of conftest.py for the in-process tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax import distributed
from rpegjax.distributed import DistributedConfig, expand_nodelist
from rpegjax.sharding import make_mesh

WORKER = pathlib.Path(__file__).with_name("worker.py")
REPO = WORKER.parents[2]
# both runs compile with the same (fast) XLA backend settings, so their results stay comparable
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# ---- configuration ----------------------------------------------------------------------------


def test_from_env_reads_jax_variables_and_explicit_values_win():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2",
           "JAX_LOCAL_DEVICE_IDS": "0,1"}
    cfg = DistributedConfig.from_env(env)
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.local_device_ids) == ("10.0.0.1:1234", 4, 2, (0, 1))
    assert cfg.is_multi_process
    cfg = DistributedConfig.from_env(env, process_id=3, heartbeat_timeout_s=7, coordinator_address=None)
    assert (cfg.process_id, cfg.heartbeat_timeout_s, cfg.coordinator_address) == (3, 7, "10.0.0.1:1234")


def test_from_env_reads_slurm():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "ignored[1-2]", "SLURM_STEP_NODELIST": "gh[007-008,010],login", "SLURM_TASKS_PER_NODE": "4(x2)"}
    cfg = DistributedConfig.from_env(env)
    assert cfg.num_processes == 8 and cfg.process_id == 5
    assert cfg.coordinator_address == f"gh007:{4242 % 4096 + 61440}"  # JAX's own SLURM port rule
    assert cfg.local_device_ids == (1,)  # several tasks per node: one GPU each
    one_task_per_node = {key: value for key, value in env.items() if key != "SLURM_TASKS_PER_NODE"}
    cfg = DistributedConfig.from_env(one_task_per_node, coordinator_port=5000)
    assert cfg.coordinator_address == "gh007:5000" and cfg.local_device_ids is None
    # JAX variables take precedence over SLURM's
    assert DistributedConfig.from_env(dict(env, JAX_PROCESS_ID="0")).process_id == 0


def test_from_env_single_process_without_variables():
    cfg = DistributedConfig.from_env({})
    assert not cfg.is_multi_process and cfg.num_processes is None
    assert distributed.initialize(cfg) is False  # no-op: JAX keeps running as one process
    assert distributed.initialize(DistributedConfig(num_processes=1)) is False


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gh[098-101]", ["gh098", "gh099", "gh100", "gh101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a-[3],b", ["a-3", "b"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, message", [("node[01-", "unbalanced"), ("node]", "unbalanced"), ("n[3-1]", "descending"),
                                           ("n[a-b]", "bad range"), ("n[[1]]", "nested"), ("", "empty")])
def test_expand_nodelist_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        expand_nodelist(text)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_processes=0), "num_processes"),
        (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id must be < num_processes=2"),
        (dict(num_processes=2, process_id=0, coordinator_address="host"), "'host'"),
        (dict(num_processes=2, process_id=0, coordinator_address="h:1", heartbeat_timeout_s=0), "heartbeat_timeout_s"),
        (dict(cpu_collectives="nccl"), "cpu_collectives"),
        (dict(local_device_ids=(-1,)), "local_device_ids"),
        (dict(num_processes=1, process_id=1), "process_id must be < num_processes=1"),
    ],
)
def test_config_validation_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**fields)


def test_incomplete_multi_process_config_is_refused_before_joining():
    partial = DistributedConfig(num_processes=2)  # fields may arrive one at a time (command-line overrides)
    with pytest.raises(ValueError, match="process_id is required when num_processes=2"):
        distributed.initialize(partial)
    with pytest.raises(ValueError, match="coordinator_address .* is required"):
        distributed.initialize(DistributedConfig(num_processes=2, process_id=1))
    with pytest.raises(ValueError, match="coordinator_address .* is required"):
        DistributedConfig.from_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})


def test_from_env_bad_variables_are_named():
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two'"):
        DistributedConfig.from_env({"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST: unbalanced"):
        DistributedConfig.from_env({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2"})
    with pytest.raises(TypeError, match="processes"):
        DistributedConfig.from_env({}, processes=2)


def test_native_writes_to_stdout_go_to_stderr_and_print_keeps_stdout():
    code = ("import os; from rpegjax.distributed import keep_native_output_off_stdout as keep\n"
            "print('before'); keep(); keep(); os.write(1, b'native\\n'); print('summary')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))))
    assert result.stdout == "before\nsummary\n"
    assert result.stderr == "native\n"


# ---- per-process helpers, in one process ------------------------------------------------------


def test_process_rows_blocks_and_sharding():
    assert [distributed.process_rows(12, p, 3) for p in range(3)] == [
        slice(0, 4), slice(4, 8), slice(8, 12)]
    # uneven: block sizes differ by at most one
    assert [distributed.process_rows(10, p, 4) for p in range(4)] == [
        slice(0, 2), slice(2, 5), slice(5, 7), slice(7, 10)]
    with pytest.raises(ValueError, match="process 4 is not one of 4 processes"):
        distributed.process_rows(10, 4, 4)
    with pytest.raises(ValueError, match="non-negative integer, got -1"):
        distributed.process_rows(-1)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    # one process holds every device, so it owns every row
    assert distributed.process_rows(8, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp")))) == slice(0, 8)
    with pytest.raises(ValueError, match="cannot be split"):
        distributed.process_rows(6, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    with pytest.raises(ValueError, match="either a sharding or process/count"):
        distributed.process_rows(8, count=2, sharding=NamedSharding(mesh, PartitionSpec("data")))


def test_collectives_in_one_process_return_this_process_values():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert distributed.sum_over_processes(1.0 + 2.0**-40) == 1.0 + 2.0**-40
    assert distributed.sum_over_processes(1.0 + 2.0**-40, mesh) == 1.0 + 2.0**-40  # counted once, not per device
    value = np.array([[1.5, -2.0], [0.25, 2.0**-20]], np.float32)
    gathered = distributed.gather_over_mesh(value, mesh)  # once per process, not per device
    assert gathered.dtype == np.float32 and gathered.shape == (1, 2, 2) and np.array_equal(gathered[0], value)
    assert distributed.holds_in_every_process(True) and not distributed.holds_in_every_process(False)
    assert distributed.broadcast_text("run") == "run"
    with pytest.raises(ValueError, match="process 0 must give the text"):
        distributed.broadcast_text(None)
    distributed.barrier("one process")


def test_host_local_to_global_in_one_process_is_a_placement():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    tree = {"tokens": np.arange(32, dtype=np.int32).reshape(8, 4), "rewards": np.arange(8, dtype=np.float32), "none": None}
    spec = PartitionSpec(("data", "fsdp"), None)
    placed = distributed.host_local_to_global(tree, mesh, spec)
    assert placed["none"] is None
    np.testing.assert_array_equal(np.asarray(placed["tokens"]), tree["tokens"])
    np.testing.assert_array_equal(np.asarray(placed["rewards"]), tree["rewards"])
    assert placed["tokens"].sharding.spec == spec and placed["rewards"].sharding.spec == PartitionSpec(("data", "fsdp"))
    assert placed["tokens"].sharding.shard_shape((8, 4)) == (2, 4)
    with pytest.raises(ValueError, match=r"\['rewards'\].*fewer dims"):
        distributed.host_local_to_global(tree, mesh, PartitionSpec(None, "tensor"))
    with pytest.raises(ValueError, match=r"\['tokens'\]"):
        distributed.host_local_to_global({"tokens": np.zeros((6, 4))}, mesh, spec)


def test_gather_and_same_across_processes_in_one_process():
    values = {"a": np.arange(6.0).reshape(3, 2), "b": np.int32(4)}
    gathered = distributed.gather_to_all(values)
    np.testing.assert_array_equal(gathered["a"], values["a"])
    distributed.assert_same_across_processes({"config": DistributedConfig(), "rows": np.arange(4)}, "config and rows")
    assert distributed.is_main_process()


def test_tree_digest_sees_values_dtypes_structure_and_rejects_unstable_leaves():
    digest = distributed.tree_digest
    base = {"x": np.arange(4, dtype=np.float32), "cfg": DistributedConfig(num_processes=1)}
    assert digest(base) == digest({"x": np.arange(4, dtype=np.float32), "cfg": DistributedConfig(num_processes=1)})
    assert digest(base) != digest(dict(base, x=np.arange(4, dtype=np.float64)))
    assert digest(base) != digest(dict(base, x=np.array([0, 1, 2, 4], np.float32)))
    assert digest(base) != digest(dict(base, cfg=DistributedConfig(num_processes=2, process_id=0, coordinator_address="h:1")))
    assert digest([1, 2]) != digest((1, 2))
    assert digest(jax.numpy.arange(3)) == digest(np.arange(3, dtype=np.int32))
    with pytest.raises(TypeError, match=r"\['f'\].*no stable repr"):
        digest({"f": object()})


# ---- several processes on localhost -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(mode: str, out: pathlib.Path, *, processes: int, devices: int, extra: Sequence[str] = (),
           split_stdout: bool = False) -> list[subprocess.Popen]:
    """Starts `processes` workers with `devices` CPU devices each; their output goes to out/worker<i>.log
    (standard output to out/stdout<i>.txt instead with `split_stdout`)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    children = []
    for process_id in range(processes):
        env = dict(os.environ)
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(processes),
            JAX_PROCESS_ID=str(process_id),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        for name in [key for key in env if key.startswith("SLURM_")]:
            del env[name]
        log = open(out / f"worker{process_id}.log", "w")
        stdout = open(out / f"stdout{process_id}.txt", "w") if split_stdout else log
        children.append(subprocess.Popen(
            [sys.executable, str(WORKER), mode, "--out", str(out), *extra],
            env=env, stdout=stdout, stderr=log if split_stdout else subprocess.STDOUT, cwd=out,
        ))
        log.close()
        stdout.close()
    return children


def wait_all(children: list[subprocess.Popen], timeout: float, *outs: pathlib.Path) -> list[int]:
    """Exit codes; kills every child still running after `timeout` seconds and fails, showing the logs."""
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"workers still running after {timeout}s:\n{logs(*outs)}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return [child.returncode for child in children]


def logs(*outs: pathlib.Path) -> str:
    paths = [path for out in outs for path in sorted(out.glob("worker*.log"))]
    return "\n".join(f"--- {path}\n{path.read_text()[-3000:]}" for path in paths)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same GRPO run on 2 processes x 2 devices and on 1 process x 4 devices, started together."""
    two, one = tmp_path_factory.mktemp("two_processes"), tmp_path_factory.mktemp("one_process")
    children = launch("train", two, processes=2, devices=2) + launch("train", one, processes=1, devices=4)
    codes = wait_all(children, 240, two, one)
    assert codes == [0, 0, 0], logs(two, one)
    return two, one


def load(out: pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(out / "params.npz") as params:
        return json.loads((out / "result.json").read_text()), dict(params)


def test_two_processes_equal_one_process(runs):
    """Losses and parameters after 3 GRPO updates: 2 processes (mesh fsdp=2 across them x tensor=2)
    == 1 process with the same 4-device mesh and the same XLA flags. Both run the same partitioned
    program; only how the cross-process reductions are carried out may differ, so float32 results
    must agree to 1e-5 relative (1e-6 absolute on parameters; here they came out bit-identical)."""
    (two, two_params), (one, one_params) = load(runs[0]), load(runs[1])
    assert two["process_count"] == 2 and one["process_count"] == 1
    assert len(two["losses"]) == 3 and len(set(two["losses"])) == 3  # the policy moved between updates
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5, atol=1e-7)
    assert sorted(two_params) == sorted(one_params) and len(two_params) > 10
    for name, value in one_params.items():
        np.testing.assert_allclose(two_params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # every collective combined both processes' values (or returned the one process's own)
    for result, count in ((two, 2), (one, 1)):
        assert result["collectives"] == {
            "sum": sum(1.0 + p + 2.0**-40 for p in range(count)), "mesh_sum": sum(0.5 + p + 2.0**-40 for p in range(count)),
            "mesh_gather": [[[p, -p], [7, 2**20 + p]] for p in range(count)],
            "all_true": True, "only_process_0": count == 1, "text": "runs/2026-12-01 grpo é"}
    # the contract check caught the one value that legitimately differs between processes
    assert one["disagreement"] is None
    assert "process index differs across processes: process(es) [1]" in two["disagreement"]


def test_two_process_checkpoint_restores_in_one_process(runs):
    """The checkpoint the two processes wrote (parameters split across them) restores in this single
    process onto a different mesh (8 devices: data=2 x fsdp=2 x tensor=2), bit for bit."""
    from flax import nnx

    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.sharding import ShardingRules, param_shardings
    from rpegjax.train.checkpoint import Checkpointer

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    # shapes, dtypes and target shardings only: nothing is initialised or compiled here
    shapes = nnx.state(nnx.eval_shape(lambda: Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))))
    shardings = param_shardings(shapes, mesh, ShardingRules.fsdp_tp())
    like = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding), shapes, shardings)
    checkpointer = Checkpointer(runs[0] / "ckpt")
    assert checkpointer.latest_step() == 3
    arrays, metadata = checkpointer.restore({"params": like})
    checkpointer.close()
    result, written = load(runs[0])
    assert metadata == {"step": 3, "losses": result["losses"]}
    restored = jax.tree_util.tree_flatten_with_path(arrays["params"])[0]
    assert sorted(jax.tree_util.keystr(path) for path, _ in restored) == sorted(written)
    for path, value in restored:
        assert value.sharding.mesh.shape == mesh.shape
        np.testing.assert_array_equal(np.asarray(value), written[jax.tree_util.keystr(path)], err_msg=jax.tree_util.keystr(path))


def test_a_lone_training_process_other_than_process_0_checkpoints_its_arrays(tmp_path):
    """Process 1 alone writes a checkpoint (the lone training process of a run whose process 0 generates): it holds
    every array whole, so they are written from the host, and orbax's numpy handler writes from process 0 only.
    The arrays must be in it: restored here, in one process, by the group's handlers and the standard ones."""
    from rpegjax.train.checkpoint import Checkpointer

    children = launch("lone-save", tmp_path, processes=2, devices=2)
    assert wait_all(children, 120, tmp_path) == [0, 0], logs(tmp_path)
    with np.load(tmp_path / "expected.npz") as expected:
        expected = dict(expected)
    sharding = NamedSharding(make_mesh({"data": 8}), PartitionSpec("data"))
    like = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding),
            "step": jax.ShapeDtypeStruct((), np.int32)}
    for checkpointer in (Checkpointer(tmp_path / "ckpt", processes=[0]), Checkpointer(tmp_path / "ckpt")):
        assert checkpointer.latest_step() == 7
        arrays, metadata = checkpointer.restore(like)
        checkpointer.close()
        assert metadata == {"next_step": 7}
        np.testing.assert_array_equal(np.asarray(arrays["w"]), expected["w"])
        assert int(arrays["step"]) == 7


@pytest.mark.parametrize("victim, heartbeat", [
    (1, 2),
    pytest.param(1, None, marks=pytest.mark.slow, id="default-timeout"),
    pytest.param(0, 2, marks=pytest.mark.slow, id="coordinator"),
])
def test_a_dead_process_makes_the_other_fail_quickly(tmp_path, victim, heartbeat):
    """One process kills itself (SIGKILL) right after joining; the other, busy computing over the global mesh,
    is ended by the distributed runtime with an error saying another task died instead of hanging in a
    collective: within 15 s of the death with the default heartbeat timeout (10 s), 8 s with 2 s."""
    extra = ["--victim", str(victim)] + ([] if heartbeat is None else ["--heartbeat-timeout", str(heartbeat)])
    children = launch("die", tmp_path, processes=2, devices=2, extra=extra)
    codes = wait_all(children, 120, tmp_path)
    ended = time.time()  # wall clock, as the victim's record of its death
    survivor_seconds = ended - float((tmp_path / "died_at").read_text())
    text = logs(tmp_path)
    survivor = 1 - victim
    assert codes[victim] == -9, text
    assert codes[survivor] != 0, text
    assert "Terminating process because the JAX distributed service detected fatal errors" in text, text
    assert "never detected" not in text, text
    if victim != 0:  # a dead coordinator fails the others' next call to it at once
        assert "stopped sending heartbeats" in text, text
    assert survivor_seconds < (15 if heartbeat is None else 8), (survivor_seconds, text)


# ---- sharded loading and export across processes ------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A random tiny Qwen2 checkpoint (in 3 shard files), loaded by 2 processes x 2 devices onto fsdp=2 x
    tensor=2 and exported from there."""
    from flax import nnx

    from rpegjax.models import ModelConfig
    from rpegjax.models.hf import save_pretrained
    from rpegjax.models.hf_layout import abstract_split

    cfg = ModelConfig.tiny()
    graphdef, abstract = abstract_split(cfg)
    rng = np.random.default_rng(5)
    filled = [(path, variable.replace(jax.numpy.asarray(rng.normal(size=variable.get_value().shape), np.float32)))
              for path, variable in nnx.to_flat_state(abstract)]
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    checkpoint = save_pretrained(model, cfg, tmp_path_factory.mktemp("checkpoint") / "qwen2", max_shard_bytes=60_000)
    out = tmp_path_factory.mktemp("two_process_load")
    children = launch("load", out, processes=2, devices=2, extra=["--checkpoint", str(checkpoint)], split_stdout=True)
    codes = wait_all(children, 240, out)
    assert codes == [0, 0], logs(out)
    return checkpoint, out


def test_two_processes_load_their_windows_and_export(loaded):
    """Every parameter, gathered from the two processes' shards, equals the one-device load; the export the
    two processes wrote from their shards loads back to the same values."""
    from rpegjax.models.hf import load_pretrained

    checkpoint, out = loaded
    assert json.loads((out / "result.json").read_text())["process_count"] == 2
    reference = flat_params(load_pretrained(checkpoint)[0])
    with np.load(out / "params.npz") as gathered:
        assert sorted(gathered) == sorted(reference)
        for name, value in reference.items():
            np.testing.assert_array_equal(gathered[name], value, err_msg=name)
    exported = flat_params(load_pretrained(out / "export")[0])
    for name, value in reference.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def flat_params(model) -> dict[str, np.ndarray]:
    from flax import nnx

    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def test_library_output_stays_off_stdout(loaded):
    """gloo announces its connections on file descriptor 1; after `initialize` they land on standard error and
    standard output carries only what the program prints."""
    _, out = loaded
    for process in range(2):
        assert (out / f"stdout{process}.txt").read_text() == f"process {process} of 2: joined\n"
    assert "[Gloo] Rank 0 is connected" in (out / "worker0.log").read_text()  # not a blind check


def test_from_env_reads_torchrun_variables_after_jax_ones():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "4"}
    cfg = DistributedConfig.from_env(env)
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.local_device_ids) == (
        "10.0.0.1:29500", 8, 5, (1,))
    assert DistributedConfig.from_env(dict(env, LOCAL_WORLD_SIZE="1")).local_device_ids is None  # one per node
    assert DistributedConfig.from_env(dict(env, JAX_PROCESS_ID="2")).process_id == 2
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not an integer"):
        DistributedConfig.from_env(dict(env, MASTER_PORT="x"))


def test_host_address_and_port_range_are_checked_and_found():
    from rpegjax.distributed import PortRange, ProcessAddress

    with pytest.raises(ValueError, match="DistributedConfig.port_range must be 'FIRST-LAST'"):
        DistributedConfig(port_range="50000")
    with pytest.raises(ValueError, match="port_range must be ports 1-65535 with FIRST <= LAST, got '9-3'"):
        DistributedConfig(port_range="9-3")
    with pytest.raises(ValueError, match="host_address must be this host's address"):
        DistributedConfig(host_address="a b")
    cfg = DistributedConfig(num_processes=2, process_id=1, coordinator_address="127.0.0.1:1234", port_range="50000-50100")
    assert cfg.address() == ProcessAddress("127.0.0.1", PortRange(50000, 50100))  # the route to the coordinator
    assert DistributedConfig(host_address="10.1.2.3").address() == ProcessAddress("10.1.2.3", None)
    assert DistributedConfig().address() == ProcessAddress("127.0.0.1", None)  # one process
