import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from rpegjax.generate import generation_rules, reshard_params
from rpegjax.sharding import ShardingRules, make_mesh, shard_state


def _flat(state):
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(state)}


def test_reshard_moves_training_layout_to_generation_layout(tiny_split):
    _, params = tiny_split
    train = shard_state(params, make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), ShardingRules.fsdp_tp())
    assert _flat(train)[("layers", 0, "attention", "q_proj")].sharding.spec == PartitionSpec("fsdp", "tensor", None)
    generation_mesh = make_mesh({"data": 4, "tensor": 2})
    moved = _flat(reshard_params(train, generation_mesh, generation_rules()))
    for path, value in _flat(params).items():
        np.testing.assert_array_equal(moved[path], value)
        assert moved[path].sharding.mesh.shape == generation_mesh.shape
    # heads, MLP and vocabulary split over tensor; nothing over the slots' data axis
    assert moved[("layers", 0, "attention", "q_proj")].sharding.spec == PartitionSpec(None, "tensor", None)
    assert moved[("layers", 1, "mlp", "down_proj")].sharding.spec == PartitionSpec("tensor", None)
    assert moved[("lm_head",)].sharding.spec == PartitionSpec(None, "tensor")
    assert moved[("final_norm", "scale")].sharding.spec == PartitionSpec(None)


def test_reshard_can_cast_to_a_lower_precision(tiny_split):
    _, params = tiny_split
    mesh = make_mesh({"data": 4, "tensor": 2})
    cast = _flat(reshard_params(params, mesh, generation_rules(), dtype=jnp.bfloat16))
    for path, value in _flat(params).items():
        assert cast[path].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(cast[path], np.float32), np.asarray(value.astype(jnp.bfloat16), np.float32))
    assert cast[("layers", 0, "attention", "k_proj")].sharding.spec == PartitionSpec(None, "tensor", None)
    assert jax.tree.leaves(params)[0].dtype == jnp.float32  # the source is untouched


def test_reshard_always_copies(tiny_split):
    """Same layout in and out: still new buffers, so donating the source leaves the copy valid."""
    _, params = tiny_split
    mesh = make_mesh({"data": 4, "tensor": 2})
    placed = reshard_params(params, mesh, generation_rules())
    again = reshard_params(placed, mesh, generation_rules())
    for (path, a), (_, b) in zip(nnx.to_flat_state(placed), nnx.to_flat_state(again), strict=True):
        a, b = a.get_value(), b.get_value()
        pointers = {shard.data.unsafe_buffer_pointer() for shard in a.addressable_shards}
        assert pointers.isdisjoint(shard.data.unsafe_buffer_pointer() for shard in b.addressable_shards), path
