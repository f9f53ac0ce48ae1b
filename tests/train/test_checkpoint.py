"""rpegjax.train.checkpoint: a checkpoint written by a group of processes (`processes=`, the training processes of a
run over process groups) is in the format every run restores."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax.sharding import make_mesh
from rpegjax.train.checkpoint import Checkpointer


def test_a_checkpoint_of_a_process_group_restores_like_any_other(tmp_path):
    mesh = make_mesh({"data": 2, "tensor": 4})
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(8, 4)).astype(np.float32)
    arrays = {"w": jax.device_put(weights, NamedSharding(mesh, PartitionSpec("data", "tensor"))),
              "step": jax.numpy.asarray(3, np.int32)}
    group = Checkpointer(tmp_path / "ckpt", keep=2, processes=[0])  # this process is the whole group, and primary
    group.save(3, arrays, {"next_step": 3})
    group.close()
    restored, meta = Checkpointer(tmp_path / "ckpt").restore(arrays)
    assert meta == {"next_step": 3}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(arrays["w"]))
    assert restored["w"].sharding.is_equivalent_to(arrays["w"].sharding, 2) and int(restored["step"]) == 3


def test_a_process_group_restores_its_own_checkpoint_in_another_layout(tmp_path):
    """The group's `Checkpointer(processes=...)` restores what it saved (its handlers, not the standard ones) into
    other shardings: a resume over process groups in another layout."""
    mesh = make_mesh({"data": 2, "tensor": 4})
    weights = np.arange(32, dtype=np.float32).reshape(8, 4)
    arrays = {"w": jax.device_put(weights, NamedSharding(mesh, PartitionSpec("data", "tensor"))), "history": {}}
    group = Checkpointer(tmp_path / "ckpt", keep=2, processes=[0])
    group.save(1, arrays, {"next_step": 1})
    group.close()
    other = NamedSharding(make_mesh({"data": 8}), PartitionSpec("data"))
    like = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=other), "history": {}}
    group = Checkpointer(tmp_path / "ckpt", keep=2, processes=[0])
    restored, meta = group.restore(like)
    group.close()
    assert meta == {"next_step": 1} and restored["w"].sharding == other
    np.testing.assert_array_equal(np.asarray(restored["w"]), weights)
