"""Length bucketing: a trimmed batch gives the update and the log-probs of the padded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.learners.batch import pack_rollouts
from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.lengths import bucket_length, longest_row, pad_columns, trim_batch
from rpegjax.learners.ppo import PPOConfig

LENGTH = 48


def make_batch(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 128, size=rng.integers(2, 6))) for _ in range(rows)]
    responses = [list(rng.integers(1, 128, size=rng.integers(2, 12))) for _ in range(rows)]
    behaviour = [rng.normal(-4.8, 0.3, size=len(r)) for r in responses]
    rewards = rng.integers(0, 2, size=rows).astype(np.float32)
    return pack_rollouts(prompts, responses, behaviour, pad_id=0, length=LENGTH, rewards=rewards)


def test_bucket_lengths():
    assert bucket_length(13, 48, 8) == 16
    assert bucket_length(16, 48, 8) == 16
    assert bucket_length(1, 48, 8) == 8
    assert bucket_length(47, 48, 32) == 48  # never past the padded length
    assert bucket_length(13, 48, None) == 48
    mask = np.zeros((3, 10), bool)
    mask[0, :4], mask[1, :7], mask[2, :2] = True, True, True
    assert longest_row(mask) == 7
    assert longest_row(jnp.asarray(mask)) == 7


def test_trim_and_pad_keep_every_real_token():
    batch = make_batch()
    longest = longest_row(batch.token_mask)
    trimmed = trim_batch(batch, longest)
    assert trimmed.tokens.shape == (8, longest) and trimmed.rewards.shape == (8,)
    assert trimmed.token_mask.sum() == batch.token_mask.sum()
    np.testing.assert_array_equal(pad_columns(jnp.asarray(trimmed.behaviour_logprobs), LENGTH), batch.behaviour_logprobs)


@pytest.mark.parametrize("aggregation", [pytest.param("token-mean", marks=pytest.mark.slow), "seq-mean-token-sum-norm"])
def test_a_bucketed_update_equals_the_padded_one(tiny_model, aggregation):
    common = dict(group_size=4, num_microbatches=2, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01, aggregation=aggregation,
                  max_length=LENGTH if aggregation == "seq-mean-token-sum-norm" else None)
    padded = GRPOLearner(GRPOConfig(**common), tiny_model)
    bucketed = GRPOLearner(GRPOConfig(**common, length_bucket=8), tiny_model)
    batch = make_batch()
    batch, _ = padded.compute_advantages(batch)
    batch = batch.replace(ref_logprobs=np.asarray(padded.logprobs(padded.params, batch)) * 1.01)
    assert bucketed.trimmed_length(batch.token_mask) < LENGTH
    state_a, metrics_a = padded.update(padded.init_state(), batch)
    state_b, metrics_b = bucketed.update(bucketed.init_state(), batch)
    for key in ("loss", "kl_loss", "entropy_loss", "grad_norm"):
        np.testing.assert_allclose(metrics_b[key], metrics_a[key], rtol=1e-5, atol=1e-7, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), state_a.params, state_b.params)


def test_bucketing_a_length_normalised_loss_needs_max_length():
    with pytest.raises(ValueError, match="GRPOConfig.length_bucket with aggregation 'seq-mean-token-sum-norm' needs max_length"):
        GRPOConfig(group_size=2, length_bucket=128, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="PPOConfig.length_bucket must be a positive integer"):
        PPOConfig(length_bucket=0)


@pytest.mark.slow  # two PPO update compilations (~1 min on the loaded 2-core machine)
def test_a_bucketed_ppo_update_equals_the_padded_one(tiny_model, tiny_critic):
    from rpegjax.learners.ppo import PPOLearner

    common = dict(gamma=0.99, lam=0.9, kl_coef=0.02)
    padded = PPOLearner(PPOConfig(**common), tiny_model, tiny_critic)
    bucketed = PPOLearner(PPOConfig(**common, length_bucket=8), tiny_model, tiny_critic)
    batch = make_batch()
    batch = batch.replace(ref_logprobs=np.asarray(padded.logprobs(padded.params["actor"], batch)) * 1.01,
                          values=np.asarray(padded.values(padded.params, batch)))
    batch, _ = padded.compute_advantages(batch)
    assert bucketed.trimmed_length(batch.token_mask) < LENGTH
    state_a, metrics_a = padded.update(padded.init_state(), batch)
    state_b, metrics_b = bucketed.update(bucketed.init_state(), batch)
    for key in ("policy_loss", "value_loss", "kl_loss", "grad_norm"):
        if key in metrics_a:
            np.testing.assert_allclose(metrics_b[key], metrics_a[key], rtol=1e-5, atol=1e-7, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), state_a.params, state_b.params)
