import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.sharding import (
    ActivationSharding,
    ShardingRules,
    check_param_shardings,
    logical_to_spec,
    make_mesh,
    param_specs,
    shard_state,
)
from rpegjax.sharding import axes


def test_logical_to_spec_skips_absent_and_unit_axes():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    table = ShardingRules.fsdp_tp().params
    assert logical_to_spec((axes.EMBED, axes.MLP), table, mesh, (64, 128)) == P("fsdp", "tensor")
    one = make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    assert logical_to_spec((axes.EMBED, axes.MLP), table, one, (64, 128)) == P(None, None)
    acts = ShardingRules.fsdp_tp().activations
    assert logical_to_spec((axes.BATCH, None), acts, mesh, (8, 3)) == P(("data", "fsdp"), None)
    no_fsdp = make_mesh({"data": 4, "tensor": 2})
    assert logical_to_spec((axes.BATCH, None), acts, no_fsdp, (8, 3)) == P("data", None)


def test_rules_refuse_a_mesh_axis_that_does_not_divide():
    """Replicating instead would repeat that dimension's work on every device of the axis."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    table = ShardingRules.fsdp_tp().params
    with pytest.raises(ValueError, match=r"w_in of shape \(3, 128\): dimension 0 \('embed', size 3\) is not divisible "
                                         r"by mesh axes \('fsdp',\) \(2 devices\)"):
        logical_to_spec((axes.EMBED, axes.MLP), table, mesh, (3, 128), name="w_in")
    acts = ActivationSharding(mesh, ShardingRules.fsdp_tp())
    with pytest.raises(ValueError, match=r"dimension 0 \('batch', size 2\) is not divisible by mesh axes "
                                         r"\('data', 'fsdp'\) \(4 devices\)"):
        acts.spec((axes.BATCH, None), (2, 3))
    cfg = ModelConfig.tiny(num_heads=4, num_kv_heads=2)  # 2 KV heads cannot split over tensor=4
    state = nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"parameter \['layers'\]\[0\]\['attention'\]\['k_bias'\] of shape \(2, 16\): "
                                         r"dimension 0 \('kv_heads', size 2\) is not divisible "
                                         r"by mesh axes \('tensor',\) \(4 devices\)"):
        param_specs(state, make_mesh({"fsdp": 2, "tensor": 4}), ShardingRules.fsdp_tp())


@pytest.mark.parametrize("architecture", list(Architecture))
def test_every_parameter_carries_its_rule(architecture):
    cfg = ModelConfig.tiny(architecture)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = ShardingRules.fsdp_tp()
    sharded = shard_state(state, mesh, rules)
    flat = nnx.to_flat_state(sharded)
    assert flat, "model has parameters"
    for path, variable in flat:
        logical = variable.get_metadata()["logical_axes"]
        value = variable.get_value()
        expected = logical_to_spec(logical, rules.params, mesh, value.shape)
        assert value.sharding.spec == expected, path
    # the big matrices really are split
    layer = sharded["layers"][0]
    stacked_experts = (None,) if cfg.num_experts else ()  # a sparse layer's kernels [x, d, f]: experts replicated
    assert layer["mlp"]["gate_proj"].get_value().sharding.spec == P(*stacked_experts, "fsdp", "tensor")
    assert layer["attention"]["q_proj"].get_value().sharding.spec == P("fsdp", "tensor", None)
    assert check_param_shardings(sharded, mesh, rules, min_size=1) == [
        f"{'/'.join(map(str, p))} {tuple(v.get_value().shape)} is replicated"
        for p, v in flat
        if all(s is None for s in logical_to_spec(v.get_metadata()["logical_axes"], rules.params, mesh, v.get_value().shape))
        and any(rules.params.get(n) for n in v.get_metadata()["logical_axes"] if n)
    ]


def _forward(graphdef, state, tokens, mask, sharding):
    model = nnx.merge(graphdef, state)
    return model(tokens, mask=mask, sharding=sharding)


@pytest.mark.parametrize(
    "mesh_sizes",
    [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 1, "fsdp": 8, "tensor": 1}, {"data": 2, "fsdp": 1, "tensor": 4}],
)
def test_sharded_forward_equals_unsharded(mesh_sizes):
    cfg = ModelConfig.tiny(Architecture.QWEN2, num_heads=4, num_kv_heads=4)
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, cfg.vocab_size)
    mask = jnp.arange(12)[None, :] >= jnp.array([0, 3, 0, 5, 1, 0, 2, 7])[:, None]  # left padding
    expected = jax.jit(_forward, static_argnums=(0, 4))(graphdef, state, tokens, mask, None)

    mesh = make_mesh(mesh_sizes)
    rules = ShardingRules.fsdp_tp()
    activation = ActivationSharding(mesh, rules)
    sharded_state = shard_state(state, mesh, rules)
    batch_sharding = activation.sharding((axes.BATCH, None), tokens.shape)
    tokens_s, mask_s = jax.device_put(tokens, batch_sharding), jax.device_put(mask, batch_sharding)
    forward = jax.jit(
        _forward,
        static_argnums=(0, 4),
        out_shardings=activation.sharding((axes.BATCH, None, axes.VOCAB), (8, 12, cfg.vocab_size)),
    )
    got = forward(graphdef, sharded_state, tokens_s, mask_s, activation)
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)


def test_param_specs_reject_wrong_rank_metadata():
    mesh = make_mesh({"data": 8})
    state = nnx.State({"w": nnx.Param(jnp.zeros((2, 2)), logical_axes=("embed",))})
    with pytest.raises(ValueError, match="do not match a parameter of shape"):
        param_specs(state, mesh, ShardingRules.fsdp_tp())


def test_expert_axis_splits_the_experts_and_is_data_like_for_the_rest():
    """Expert kernels split over `expert` (their d keeps fsdp); dense weights and rows split over it as over fsdp."""
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, num_layers=2, mlp_only_layers=(1,))
    mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
    rules = ShardingRules.fsdp_tp()
    sharded = shard_state(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0))), mesh, rules)
    sparse, dense = sharded["layers"][0], sharded["layers"][1]
    assert sparse["mlp"]["gate_proj"].get_value().sharding.spec == P("expert", "fsdp", "tensor")
    assert sparse["mlp"]["down_proj"].get_value().sharding.spec == P("expert", "tensor", "fsdp")
    assert sparse["mlp"]["router"].get_value().sharding.spec == P(("fsdp", "expert"), None)
    assert dense["mlp"]["gate_proj"].get_value().sharding.spec == P(("fsdp", "expert"), "tensor")
    assert sparse["attention"]["q_proj"].get_value().sharding.spec == P(("fsdp", "expert"), "tensor", None)
    activation = ActivationSharding(mesh, rules)
    assert activation.spec((axes.BATCH, None), (8, 3)) == P(("fsdp", "expert"), None)
    assert activation.mesh_axes(axes.EXPERT) == ("expert",)
    assert check_param_shardings(sharded, mesh, rules, min_size=1) == []
