"""PPO learner: shared actor-critic trunk and separate critic both run, compile once and fit the values."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.learners.advantages import outcome_token_rewards
from rpegjax.learners.batch import pack_rollouts
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.ppo import PPOConfig, PPOLearner
from rpegjax.models import Decoder, ModelConfig

B, LENGTH = 8, 16


@pytest.fixture(scope="module")
def models(tiny_model, tiny_critic):
    return tiny_model, tiny_critic


def make_batch():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 128, size=rng.integers(2, 6))) for _ in range(B)]
    responses = [list(rng.integers(1, 128, size=rng.integers(2, 10))) for _ in range(B)]
    rewards = np.array([1.0, -1.0, 0.5, 0.0, 1.0, -0.5, 0.0, 2.0], np.float32)
    return pack_rollouts(prompts, responses, None, pad_id=0, length=LENGTH, rewards=rewards)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_updates_run_compile_once_and_reduce_value_loss(models, critic):
    actor, critic_model = models
    ppo = PPOConfig(
        critic=critic, epochs=2, num_minibatches=2, num_microbatches=2, gamma=0.99, lam=0.9, kl_coef=0.02,
        optimizer=OptimizerConfig(learning_rate=3e-3),
    )
    learner = PPOLearner(ppo, actor, critic_model if critic == "separate" else None)
    state = learner.init_state()
    assert set(state.params) == ({"actor"} if critic == "shared" else {"actor", "critic"})
    ref = learner.logprobs(learner.params["actor"], make_batch())
    value_losses = []
    for _ in range(4):
        batch = make_batch().replace(ref_logprobs=ref)
        batch = batch.replace(old_logprobs=learner.logprobs(state.params["actor"], batch), values=learner.values(state.params, batch))
        batch, _ = learner.compute_advantages(batch)
        state, metrics = learner.update(state, batch)
        value_losses.append(float(metrics["value_loss"]))
        assert np.isfinite(float(metrics["policy_loss"])) and float(metrics["kl_loss"]) >= 0
    assert learner.update_traces == 1
    assert int(state.step) == 4 * 2 * 2
    fused_logprobs, fused_values = learner.logprobs_and_values(state.params, batch)
    np.testing.assert_allclose(fused_logprobs, learner.logprobs(state.params["actor"], batch), atol=1e-5)
    np.testing.assert_allclose(fused_values, learner.values(state.params, batch), atol=1e-5)
    assert value_losses[-1] < 0.5 * value_losses[0], value_losses


def test_gae_advantages_with_kl_in_reward(models):
    actor, critic_model = models
    learner = PPOLearner(PPOConfig(gamma=0.99, lam=0.9, kl_in_reward_coef=0.05, kl_kind="k3"), actor, critic_model)
    rng = np.random.default_rng(1)
    batch = make_batch()
    mask = batch.response_mask
    old = np.where(mask, rng.normal(-4, 0.5, size=mask.shape), 0.0).astype(np.float32)
    ref = np.where(mask, old + rng.normal(0, 0.3, size=mask.shape), 0.0).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    with pytest.raises(ValueError, match="needs TrainBatch fields \\['values', 'old_logprobs', 'ref_logprobs'\\]"):
        learner.compute_advantages(batch)
    filled, _ = learner.compute_advantages(batch.replace(old_logprobs=old, ref_logprobs=ref, values=values))
    # reference: outcome reward on the last response token, minus 0.05 * k3 on every response token
    d = old.astype(np.float64) - ref
    token_rewards = np.asarray(outcome_token_rewards(jnp.asarray(batch.rewards), jnp.asarray(mask))) - 0.05 * np.where(mask, np.exp(-d) + d - 1, 0.0)
    adv = np.zeros(mask.shape)
    for i in range(B):
        running, next_value = 0.0, 0.0
        for t in np.flatnonzero(mask[i])[::-1]:
            running = token_rewards[i, t] + 0.99 * next_value - values[i, t] + 0.99 * 0.9 * running
            adv[i, t], next_value = running, values[i, t]
    np.testing.assert_allclose(filled.returns, np.where(mask, adv + values, 0.0), atol=1e-5)
    valid = adv[mask]
    whitened = np.where(mask, (adv - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), 0.0)
    np.testing.assert_allclose(filled.advantages, whitened, atol=1e-5)


def test_ppo_config_and_model_errors(models):
    actor, critic_model = models
    with pytest.raises(ValueError, match="PPOConfig.lam must be in \\[0, 1\\]"):
        PPOConfig(lam=1.5)
    with pytest.raises(ValueError, match="critic_optimizer is only used with critic='separate'"):
        PPOConfig(critic="shared", critic_optimizer=OptimizerConfig())
    plain = Decoder(ModelConfig.tiny(num_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="critic='shared' needs an actor built with ModelConfig\\(value_head=True\\)"):
        PPOLearner(PPOConfig(critic="shared"), plain)
    with pytest.raises(ValueError, match="critic='separate' needs a critic model"):
        PPOLearner(PPOConfig(), actor)
    with pytest.raises(ValueError, match="the critic model needs ModelConfig\\(value_head=True\\)"):
        PPOLearner(PPOConfig(), actor, plain)
    learner = PPOLearner(PPOConfig(), actor, critic_model)
    with pytest.raises(ValueError, match="PPOLearner.update needs TrainBatch fields"):
        learner.update(learner.init_state(), make_batch())


def test_decoupled_ppo_update_masks_a_mismatched_row(models):
    """PPO's update applies the rollout correction like GRPO's (one policy objective): with IcePop, a row the sampler
    gave 30 nats less than the training forward (rho = e^30) trains like a row of zero advantage."""
    actor, _ = models
    base = dict(critic="shared", decoupled=True, optimizer=OptimizerConfig(learning_rate=1e-3))
    learner = PPOLearner(PPOConfig(**base, correction="icepop"), actor)
    uncorrected = PPOLearner(PPOConfig(**base, correction="none"), actor)
    state = learner.init_state()
    batch = make_batch()
    old = np.asarray(learner.logprobs(state.params["actor"], batch))
    behaviour = np.where(batch.response_mask, old, 0.0)
    behaviour[0] -= 30.0 * batch.response_mask[0]
    batch = batch.replace(old_logprobs=old, behaviour_logprobs=behaviour.astype(np.float32),
                          values=learner.values(state.params, batch))
    batch, _ = learner.compute_advantages(batch)
    zeroed = np.asarray(batch.advantages).copy()
    zeroed[0] = 0.0
    _, metrics = learner.update(learner.init_state(), batch)
    _, want = uncorrected.update(uncorrected.init_state(), batch.replace(advantages=zeroed))
    for key in ("policy_loss", "grad_norm"):
        np.testing.assert_allclose(metrics[key], want[key], rtol=1e-5)
    mask = batch.response_mask
    np.testing.assert_allclose(metrics["correction/masked_fraction"], mask[0].sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["mismatch/abs_logprob_diff_max"], 30.0, rtol=1e-5)
