"""GRPO learner: micro-batching, sharding, compile-once, and that updates move the policy the right way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollouts import G, make_batch

from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.objective import policy_denominators, update_inputs
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.update import UpdateLayout, accumulate_gradients, split_rows
from rpegjax.models import Decoder, ModelConfig
from rpegjax.sharding import ShardingRules, make_mesh


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model




def perturbed(learner, batch, params, seed, scale):
    """Old/ref log-probs near the current ones, so that ratios differ from 1 and clipping happens."""
    current = np.asarray(learner.logprobs(params, batch))
    noise = np.random.default_rng(seed).normal(0, scale, size=current.shape).astype(np.float32)
    return np.where(batch.response_mask, current + noise, 0.0).astype(np.float32)


def test_microbatched_gradient_equals_full_batch(model):
    """Model-level check with the KL and entropy terms; tests/learners/test_losses.py checks every loss
    and aggregation (GSPO included) at the log-prob level."""
    cfg = GRPOConfig(group_size=G, num_microbatches=4, aggregation="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3",
                     entropy_coef=0.01, clip_high=0.28)
    learner = GRPOLearner(cfg, model)
    batch = make_batch()
    batch, _ = learner.compute_advantages(batch)
    batch = batch.replace(
        old_logprobs=perturbed(learner, batch, learner.params, 1, 0.3),
        ref_logprobs=perturbed(learner, batch, learner.params, 2, 0.3),
    )
    inputs = update_inputs(batch, cfg)

    @jax.jit
    def full_gradient(params, batch):
        return jax.grad(lambda p: learner._loss(p, batch, policy_denominators(cfg, batch))[0])(params)

    @jax.jit
    def accumulated_gradient(params, batch):
        micro_batches = jax.tree.map(lambda x: x[0], split_rows(batch, UpdateLayout(num_microbatches=4)))
        grads, _, metrics = accumulate_gradients(learner._loss, params, micro_batches, policy_denominators(cfg, batch))
        return grads, metrics

    want = full_gradient(learner.params, inputs)
    got, metrics = accumulated_gradient(learner.params, inputs)
    assert 0 < float(metrics["clip_fraction"]) < 1
    for (path, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        w = np.asarray(w.get_value())
        if path[0].startswith("value_"):  # the shared test model's value head is unused by GRPO
            np.testing.assert_array_equal(g.get_value(), 0.0)
            continue
        assert np.abs(w).max() > 0, path
        # entries that are sums of cancelling terms carry float32 rounding of the terms' scale, so the
        # absolute tolerance is relative to the tensor's largest entry (composite tolerance 1e-4 / 1e-5)
        np.testing.assert_allclose(g.get_value(), w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=str(path))


SHARDED_CFG = dict(
    group_size=G, epochs=2, num_minibatches=2, clip_high=0.28, dual_clip=3.0, kl_coef=0.04, kl_kind="k3",
    decoupled=True, importance_cap=2.0, optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=2),
)


@pytest.fixture(scope="module")
def unsharded(model):
    return GRPOLearner(GRPOConfig(**SHARDED_CFG), model)


def fill(learner, state, batch):
    """What the runtime does before an update: proximal and reference log-probs, advantages."""
    batch, _ = learner.compute_advantages(batch)
    return batch.replace(
        old_logprobs=learner.logprobs(state.params, batch),
        ref_logprobs=learner.logprobs(learner.params, batch),
    )


def test_sharded_update_equals_unsharded_and_compiles_once(model, unsharded):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = GRPOLearner(GRPOConfig(**SHARDED_CFG), model, mesh=mesh, rules=ShardingRules.fsdp_tp())
    results = []
    for learner in (unsharded, sharded):
        state = learner.init_state()
        for step in range(2):
            batch = fill(learner, state, make_batch(seed=step))
            state, metrics = learner.update(state, batch)
        results.append((state, metrics))
        assert learner.update_traces == 1
    (state, metrics), (sharded_state, sharded_metrics) = results
    assert int(sharded_state.step) == int(state.step) == 8  # 2 updates x 2 epochs x 2 mini-batches
    lm_head = sharded_state.params["lm_head"].get_value()
    assert lm_head.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    mu = sharded_state.opt_state[1][0].mu["lm_head"].get_value()  # Adam's first moment follows its parameter
    assert mu.sharding.spec == lm_head.sharding.spec
    for (path, a), (_, b) in zip(nnx.to_flat_state(sharded_state.params), nnx.to_flat_state(state.params)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), rtol=1e-4, atol=1e-5, err_msg=str(path))
    for key, value in metrics.items():
        np.testing.assert_allclose(sharded_metrics[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
    assert float(metrics["kl_loss"]) > 0 and float(metrics["correction/weight_mean"]) > 0


def test_updates_raise_logprob_of_positive_advantage_sequences(unsharded):
    learner = unsharded
    state = learner.init_state()
    batch = make_batch(seed=3)
    mask = batch.response_mask

    def sequence_logprob(params):
        return np.sum(np.asarray(learner.logprobs(params, batch)) * mask, axis=1)

    before = sequence_logprob(state.params)
    for _ in range(3):
        filled = fill(learner, state, batch)
        state, metrics = learner.update(state, filled)
    after = sequence_logprob(state.params)
    advantages = np.asarray(filled.advantages)
    assert (advantages > 0).any() and (advantages < 0).any()
    assert np.all((after - before)[advantages > 0] > 0), (before, after, advantages)
    assert np.all((after - before)[advantages < 0] < 0), (before, after, advantages)
    assert learner.update_traces == 1  # same learner and shapes as the sharding test: still one compile


def test_update_reports_missing_fields_and_bad_shapes(unsharded):
    state = unsharded.init_state()
    batch = make_batch()
    with pytest.raises(ValueError, match="needs TrainBatch fields \\['advantages', 'ref_logprobs', 'old_logprobs'\\]"):
        unsharded.update(state, batch)
    filled = fill(unsharded, state, batch)
    with pytest.raises(ValueError, match="a batch of 5 rows does not split into num_minibatches=2"):
        unsharded.update(state, jax.tree.map(lambda x: x[:5], filled))


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(advantage="gae"), "GAE needs a critic"),
        (dict(group_size=1), "group_size must be >= 2"),
        (dict(importance_cap=2.0), "importance_cap=2.0 needs decoupled=True"),
        (dict(correction="icepop"), "correction='icepop' needs decoupled=True"),
        (dict(decoupled=True, correction="tis"), "GRPOConfig.correction must be one of"),
        (dict(decoupled=True, correction="sequence-tis"), "'sequence-tis' needs importance_cap"),
        (dict(decoupled=True, correction="icepop", importance_cap=2.0),
         "importance_cap=2.0 is not read by correction 'icepop'"),
        (dict(decoupled=True, geometric_low=0.9), "geometric_low=0.9 is not read by correction 'token-tis'"),
        (dict(decoupled=True, correction="icepop", icepop_low=3.0, icepop_high=2.0),
         "icepop_low/icepop_high must satisfy"),
        (dict(loss="gspo", dual_clip=3.0), "dual_clip is not defined for loss='gspo'"),
        (dict(aggregation="sum"), "GRPOConfig.aggregation must be one of"),
        (dict(num_microbatches=0), "UpdateLayout.num_microbatches must be a positive integer"),
    ],
)
def test_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**dict(dict(group_size=G), **changes))


def test_single_step_without_old_logprobs_is_the_policy_gradient(model):
    """With one optimiser step and no old log-probs, pi_old = pi_theta: ratio 1, nothing clipped (GSPO loss)."""
    learner = GRPOLearner(GRPOConfig(group_size=G, loss="gspo", advantage="rloo"), model)
    state = learner.init_state()
    batch, _ = learner.compute_advantages(make_batch())
    state, metrics = learner.update(state, batch)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0) and float(metrics["clip_fraction"]) == 0.0
    assert np.isfinite(float(metrics["grad_norm"])) and int(state.step) == 1
    # the model's own parameters were not donated away
    assert np.isfinite(np.asarray(learner.params["lm_head"].get_value())).all()
    assert not jnp.array_equal(state.params["lm_head"].get_value(), learner.params["lm_head"].get_value())


def _matmul_operand_dtypes(jaxpr) -> set:
    """(lhs, rhs) dtypes of every dot_general in `jaxpr` and the jaxprs nested in it (jit, scan, custom_vjp, remat)."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.add(tuple(var.aval.dtype for var in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _matmul_operand_dtypes(inner)
    return found


def test_mixed_precision_update_computes_in_bfloat16_over_float32_master_weights():
    """param_dtype float32 + dtype bfloat16: every matmul of the loss runs on bfloat16 operands, while the
    parameters, their gradients and AdamW's moments stay float32; the update improves like the float32 one."""
    cfg = ModelConfig.tiny(dtype="bfloat16", attention="blockwise", attention_block_size=8, remat="full",
                           scan_layers=True)
    learner = GRPOLearner(GRPOConfig(group_size=G, kl_coef=0.04, optimizer=OptimizerConfig(learning_rate=1e-3)),
                          Decoder(cfg, rngs=nnx.Rngs(0)))
    state = learner.init_state()
    batch = fill(learner, state, make_batch(seed=4))
    dtypes = _matmul_operand_dtypes(jax.make_jaxpr(learner.update)(state, batch).jaxpr)
    assert dtypes == {(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16))}, dtypes
    before = np.sum(np.asarray(learner.logprobs(state.params, batch)) * batch.response_mask, axis=1)
    state, metrics = learner.update(state, batch)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    leaves = jax.tree.leaves(state.params) + [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}
    after = np.sum(np.asarray(learner.logprobs(state.params, batch)) * batch.response_mask, axis=1)
    advantages = np.asarray(batch.advantages)
    assert np.all((after - before)[advantages > 0] > 0) and np.all((after - before)[advantages < 0] < 0)


@pytest.mark.gpu
def test_bfloat16_update_with_cudnn_attention_on_the_gpu_matches_dense():
    """On a GPU, the mixed-precision update with cuDNN attention gives the loss and gradient norm of the same update
    with dense attention (bfloat16: within 2%), and raises the log-probs of positive-advantage rows as it should."""
    results = {}
    for attention in ("cudnn", "dense"):
        cfg = ModelConfig.tiny(dtype="bfloat16", attention=attention)
        learner = GRPOLearner(GRPOConfig(group_size=G, kl_coef=0.04, optimizer=OptimizerConfig(learning_rate=1e-3)),
                              Decoder(cfg, rngs=nnx.Rngs(0)))
        state = learner.init_state()
        batch = fill(learner, state, make_batch(seed=4))
        before = np.sum(np.asarray(learner.logprobs(state.params, batch)) * batch.response_mask, axis=1)
        state, metrics = learner.update(state, batch)
        after = np.sum(np.asarray(learner.logprobs(state.params, batch)) * batch.response_mask, axis=1)
        assert all(x.devices().pop().platform == "gpu" for x in jax.tree.leaves(state.params))
        advantages = np.asarray(batch.advantages)
        assert np.all((after - before)[advantages > 0] > 0) and np.all((after - before)[advantages < 0] < 0)
        results[attention] = (float(metrics["loss"]), float(metrics["grad_norm"]))
    np.testing.assert_allclose(results["cudnn"], results["dense"], rtol=2e-2)


def _with_one_mismatched_row(learner, state, batch):
    """Old log-probs from `state`, behaviour log-probs equal to them except on row 0, which the sampler gave 30 nats
    less (rho = pi_old / mu = e^30 on each of its tokens)."""
    old = np.asarray(learner.logprobs(learner.actor_params(state.params), batch))
    behaviour = np.where(batch.response_mask, old, 0.0)
    behaviour[0] -= 30.0 * batch.response_mask[0]
    return batch.replace(old_logprobs=old, behaviour_logprobs=behaviour.astype(np.float32))


@pytest.mark.parametrize("correction,options,row_weight,fraction", [
    ("token-tis", dict(importance_cap=2.0), 2.0, "correction/truncated_fraction"),
    ("sequence-tis", dict(importance_cap=3.0), 3.0, "correction/truncated_fraction"),
    ("icepop", {}, 0.0, "correction/masked_fraction"),
    ("geometric-mask", {}, 0.0, "correction/masked_fraction"),
])
def test_update_truncates_or_masks_a_mismatched_row(model, correction, options, row_weight, fraction):
    """Every other token has rho = 1 (weight 1), so the corrected update equals the uncorrected one (correction
    'none') with row 0's advantage scaled by its weight: C for TIS, 0 for the masks (at ratio 1 the clipped surrogate
    is linear in A)."""
    base = dict(group_size=G, decoupled=True, optimizer=OptimizerConfig(learning_rate=1e-3))
    learner = GRPOLearner(GRPOConfig(**base, correction=correction, **options), model)
    uncorrected = GRPOLearner(GRPOConfig(**base, correction="none"), model)
    batch, _ = learner.compute_advantages(make_batch())
    batch = _with_one_mismatched_row(learner, learner.init_state(), batch)
    scaled = np.asarray(batch.advantages).copy()
    scaled[0] *= row_weight
    _, metrics = learner.update(learner.init_state(), batch)
    _, want = uncorrected.update(uncorrected.init_state(), batch.replace(advantages=scaled))
    _, unscaled = uncorrected.update(uncorrected.init_state(), batch)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[key], want[key], rtol=1e-5)
        assert abs(float(unscaled[key]) - float(want[key])) > 1e-3 * abs(float(want[key]))  # row 0 matters
    mask = batch.response_mask
    np.testing.assert_allclose(metrics[fraction], mask[0].sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["mismatch/abs_logprob_diff_max"], 30.0, rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch/kl_k1"], -30.0 * mask[0].sum() / mask.sum(), rtol=1e-5)


def test_on_policy_update_logs_the_mismatch_against_its_own_forward(model):
    """Without decoupled PPO or an old-log-prob pass, the mismatch metrics compare the sampler's log-probs with the
    update's forward (pi_old at its only step); the loss ignores them."""
    learner = GRPOLearner(GRPOConfig(group_size=G), model)
    state = learner.init_state()
    batch, _ = learner.compute_advantages(make_batch())
    train = np.asarray(learner.logprobs(learner.params, batch))
    mask = batch.response_mask
    d = np.where(mask, batch.behaviour_logprobs - train.astype(np.float64), 0.0)[mask]
    _, metrics = learner.update(state, batch)
    np.testing.assert_allclose(metrics["mismatch/kl_k1"], d.mean(), rtol=1e-4)
    np.testing.assert_allclose(metrics["mismatch/kl_k3"], (np.exp(-d) - 1 + d).mean(), rtol=1e-4)
    np.testing.assert_allclose(metrics["mismatch/abs_logprob_diff_max"], np.abs(d).max(), rtol=1e-5)
    assert not any(key.startswith("correction/") for key in metrics)
