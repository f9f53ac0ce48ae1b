"""ZeRO-1 optimiser state (`OptimizerSharding.DATA`): AdamW's moments split over the data axes as well, on 8 virtual
devices (data=2 x fsdp=2 x tensor=2). The update computes what the parameter-layout state and an unsharded learner
compute. The optimiser is elementwise, so what differs is only the gradient's summation order over the data shards
(XLA reduce-scatters it for the sliced moments instead of all-reducing it): the first step's moments agree to
float32 rounding of sums of cancelling terms (1e-5 of the tensor's largest entry, as test_grpo's gradients), and parameters after several Adam steps to the tolerance of every sharded
test (test_grpo), since Adam's m / (sqrt(v) + eps) magnifies that rounding where a gradient entry is near eps."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rollouts import G, make_batch

from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.optim import OptimizerConfig, optimizer_data_axes, split_over_data
from rpegjax.learners.ppo import PPOConfig, PPOLearner
from rpegjax.options import OptimizerSharding
from rpegjax.sharding import ShardingRules, make_mesh

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
OPTIMIZER = OptimizerConfig(learning_rate=1e-3, warmup_steps=2)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def moments_of(state) -> list[jax.Array]:
    """Adam's mu and nu leaves of a state (chained or multi_transform)."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        if any(getattr(key, "name", None) in ("mu", "nu") for key in path):
            found.append(leaf)
    return found


def test_split_over_data_places_the_data_axes_on_a_dimension_they_divide():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    assert split_over_data(sharding, (8, 4), ("data", "fsdp")).spec == PartitionSpec(("fsdp", "data"), "tensor")
    # 6 rows do not split 4 ways: the data axes go on the next dimension that they do divide
    assert split_over_data(sharding, (6, 8), ("data", "fsdp")).spec == PartitionSpec("fsdp", ("tensor", "data"))
    vector = NamedSharding(mesh, PartitionSpec())
    assert split_over_data(vector, (3,), ("data",)) is vector  # nothing divides a 3-vector: its parameter's layout
    assert split_over_data(vector, (4,), ("data",)).spec == PartitionSpec(("data",))
    assert optimizer_data_axes(OptimizerSharding.PARAMS, NamedSharding(mesh, PartitionSpec(("data", "fsdp")))) == ()
    assert optimizer_data_axes("data", NamedSharding(mesh, PartitionSpec(("data", "fsdp")))) == ("data", "fsdp")
    with pytest.raises(ValueError, match="optimizer_sharding must be one of \\['params', 'data'\\]"):
        optimizer_data_axes("zero3", None)


def fill(learner, state, batch):
    batch, _ = learner.compute_advantages(batch)
    return batch.replace(old_logprobs=learner.logprobs(state.params, batch),
                         ref_logprobs=learner.logprobs(learner.params, batch))


def grpo_params_after_updates(learner, updates: int = 3):
    state = learner.init_state()
    for step in range(updates):
        state, metrics = learner.update(state, fill(learner, state, make_batch(seed=step)))
    return state, metrics


def test_grpo_zero1_update_equals_the_parameter_layout_and_unsharded(tiny_model):
    cfg = GRPOConfig(group_size=G, num_minibatches=2, kl_coef=0.04, decoupled=True, importance_cap=2.0,
                     optimizer=OPTIMIZER)
    mesh = make_mesh(MESH)
    rules = ShardingRules.fsdp_tp()
    zero1 = GRPOLearner(cfg, tiny_model, mesh=mesh, rules=rules, optimizer_sharding=OptimizerSharding.DATA)
    plain = GRPOLearner(cfg, tiny_model, mesh=mesh, rules=rules)
    unsharded = GRPOLearner(cfg, tiny_model)
    state, metrics = grpo_params_after_updates(zero1)
    assert int(state.step) == 6 and zero1.update_traces == 1
    lm_head_mu = state.opt_state[1][0].mu["lm_head"].get_value()
    assert lm_head_mu.sharding.spec == PartitionSpec(("fsdp", "data"), "tensor")  # 1/8 of it per device
    assert state.params["lm_head"].get_value().sharding.spec == PartitionSpec("fsdp", "tensor")
    split = sum(1 for leaf in moments_of(state) if "data" in str(leaf.sharding.spec))
    assert split >= len(moments_of(state)) // 2  # every matrix's moments; some short vectors keep their layout
    first, _ = grpo_params_after_updates(zero1, updates=1)
    first_want, _ = grpo_params_after_updates(plain, updates=1)
    for got, expected in zip(moments_of(first), moments_of(first_want), strict=True):
        expected = np.asarray(expected)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    want, _ = grpo_params_after_updates(plain)
    for got, expected in zip(leaves(state.params), leaves(want.params), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    reference, reference_metrics = grpo_params_after_updates(unsharded)
    for (path, got), (_, expected) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(reference.params)):
        np.testing.assert_allclose(got.get_value(), expected.get_value(), rtol=1e-4, atol=1e-5, err_msg=str(path))
    np.testing.assert_allclose(metrics["loss"], reference_metrics["loss"], rtol=1e-4, atol=1e-6)


# the separate critic is the harder case (an optax.multi_transform state of two models); the shared one is slow only
@pytest.mark.parametrize("critic", [pytest.param("shared", marks=pytest.mark.slow), "separate"])
def test_ppo_zero1_update_equals_the_parameter_layout(tiny_model, tiny_critic, critic):
    cfg = PPOConfig(critic=critic, num_minibatches=2, gamma=0.99, lam=0.9, kl_coef=0.02, optimizer=OPTIMIZER)
    mesh, rules = make_mesh(MESH), ShardingRules.fsdp_tp()
    critic_model = tiny_critic if critic == "separate" else None
    results = []
    for sharding in (OptimizerSharding.DATA, OptimizerSharding.PARAMS):
        learner = PPOLearner(cfg, tiny_model, critic_model, mesh=mesh, rules=rules, optimizer_sharding=sharding)
        state = learner.init_state()
        ref = learner.logprobs(learner.params["actor"], make_batch())
        for step in range(3):
            batch = make_batch(seed=step).replace(ref_logprobs=ref)
            batch = batch.replace(old_logprobs=learner.logprobs(state.params["actor"], batch),
                                  values=learner.values(state.params, batch))
            batch, _ = learner.compute_advantages(batch)
            state, metrics = learner.update(state, batch)
        results.append((state, metrics))
    (state, metrics), (want, want_metrics) = results
    assert all("data" in str(leaf.sharding.spec) for leaf in moments_of(state) if leaf.ndim == 2)
    for got, expected in zip(leaves(state.params), leaves(want.params), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["value_loss"], want_metrics["value_loss"], rtol=1e-5)
