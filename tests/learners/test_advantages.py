"""Advantage estimators against numpy references written from the formulas."""

import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.learners.advantages import (
    AdvantageKind,
    compute_advantages,
    gae,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)

B, G, T = 12, 4, 9


@pytest.fixture
def rewards():
    values = np.random.default_rng(0).normal(size=B).astype(np.float32)
    values[4:8] = 1.0  # one group with identical rewards: std 0
    return values


@pytest.fixture
def mask():
    """Response masks with a prompt part, padding at the end, and one row with a hole in the middle."""
    rng = np.random.default_rng(1)
    m = np.zeros((B, T), bool)
    for i in range(B):
        start, stop = rng.integers(1, 4), rng.integers(5, T + 1)
        m[i, start:stop] = True
    m[3, 5] = False
    return m


def numpy_grpo(r, g, scale, eps):
    out = np.empty_like(r)
    for i in range(0, len(r), g):
        group = r[i : i + g].astype(np.float64)
        centred = group - group.mean()
        out[i : i + g] = centred / (np.std(group, ddof=1) + eps) if scale else centred
    return out


def numpy_whiten(x, m, eps):
    values = x[m].astype(np.float64)
    out = (x - values.mean()) / np.sqrt(values.var(ddof=1) + eps)
    return np.where(m, out, 0.0)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_numpy(rewards, scale_by_std):
    got, metrics = grpo_advantages(jnp.asarray(rewards), G, scale_by_std=scale_by_std, eps=1e-6)
    np.testing.assert_allclose(got, numpy_grpo(rewards, G, scale_by_std, 1e-6), atol=1e-5, rtol=1e-5)
    assert float(metrics["zero_variance_group_fraction"]) == pytest.approx(1 / 3)
    np.testing.assert_array_equal(np.asarray(got)[4:8], 0.0)


def test_rloo_matches_numpy(rewards):
    want = np.array([rewards[i] - (rewards[(i // G) * G : (i // G + 1) * G].sum() - rewards[i]) / (G - 1) for i in range(B)])
    got, _ = rloo_advantages(jnp.asarray(rewards), G)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_reinforce_pp_sequence_level(rewards):
    got, _ = reinforce_pp_advantages(jnp.asarray(rewards))
    np.testing.assert_allclose(got, numpy_whiten(rewards, np.ones(B, bool), 1e-8), atol=1e-5)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_token_level_outcome(rewards, mask, baseline):
    scores = rewards.astype(np.float64)
    if baseline:
        scores = scores - np.repeat(scores.reshape(-1, G).mean(1), G)
    want = numpy_whiten(np.where(mask, scores[:, None], 0.0), mask, 1e-8)
    got, _ = reinforce_pp_advantages(jnp.asarray(rewards), jnp.asarray(mask), group_baseline=G if baseline else None)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_reinforce_pp_token_rewards_discounted(mask):
    rng = np.random.default_rng(2)
    token_rewards = rng.normal(size=(B, T)).astype(np.float32)
    gamma = 0.9
    returns = np.zeros((B, T))
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if mask[i, t]:
                running = token_rewards[i, t] + gamma * running
                returns[i, t] = running
    got, _ = reinforce_pp_advantages(jnp.asarray(token_rewards), jnp.asarray(mask), gamma=gamma)
    np.testing.assert_allclose(got, numpy_whiten(returns, mask, 1e-8), atol=1e-5)


def numpy_gae(r, v, m, gamma, lam):
    adv = np.zeros_like(r, dtype=np.float64)
    for i in range(r.shape[0]):
        valid = np.flatnonzero(m[i])
        running, next_value = 0.0, 0.0
        for t in valid[::-1]:
            delta = r[i, t] + gamma * next_value - v[i, t]
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_value = v[i, t]
    return adv, np.where(m, adv + v, 0.0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_numpy_and_skips_padding(mask, gamma, lam):
    rng = np.random.default_rng(3)
    r = rng.normal(size=(B, T)).astype(np.float32)
    v = rng.normal(size=(B, T)).astype(np.float32)
    (adv, ret), _ = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(mask), gamma, lam)
    want_adv, want_ret = numpy_gae(r, v, mask, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    # garbage at padded positions does not leak into the valid ones
    r_noisy = np.where(mask, r, 1e3)
    v_noisy = np.where(mask, v, -1e3)
    (adv_noisy, _), _ = gae(jnp.asarray(r_noisy), jnp.asarray(v_noisy), jnp.asarray(mask), gamma, lam)
    np.testing.assert_allclose(adv_noisy, want_adv, atol=1e-5)


def test_gae_lambda_one_gamma_one_is_return_minus_value(mask):
    rng = np.random.default_rng(4)
    rewards = rng.normal(size=B).astype(np.float32)
    v = rng.normal(size=(B, T)).astype(np.float32)
    token_rewards = outcome_token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
    (adv, ret), _ = gae(token_rewards, jnp.asarray(v), jnp.asarray(mask), 1.0, 1.0)
    np.testing.assert_allclose(ret, np.where(mask, rewards[:, None], 0.0), atol=1e-5)
    np.testing.assert_allclose(adv, np.where(mask, rewards[:, None] - v, 0.0), atol=1e-5)


def test_outcome_token_rewards_on_last_response_token(mask):
    rewards = np.arange(1, B + 1, dtype=np.float32)
    got = np.asarray(outcome_token_rewards(jnp.asarray(rewards), jnp.asarray(mask)))
    for i in range(B):
        last = np.flatnonzero(mask[i])[-1]
        want = np.zeros(T)
        want[last] = rewards[i]
        np.testing.assert_array_equal(got[i], want)


def test_whiten_matches_numpy(mask):
    x = np.random.default_rng(5).normal(size=(B, T)).astype(np.float32)
    np.testing.assert_allclose(whiten(jnp.asarray(x), jnp.asarray(mask)), numpy_whiten(x, mask, 1e-8), atol=1e-5)


def test_compute_advantages_dispatch(rewards, mask):
    r = jnp.asarray(rewards)
    for kind, want in [
        ("grpo", grpo_advantages(r, G)[0]),
        (AdvantageKind.DR_GRPO, grpo_advantages(r, G, scale_by_std=False)[0]),
        ("rloo", rloo_advantages(r, G)[0]),
        ("reinforce++", reinforce_pp_advantages(r, jnp.asarray(mask))[0]),
        ("reinforce++-baseline", reinforce_pp_advantages(r, jnp.asarray(mask), group_baseline=G)[0]),
    ]:
        got, _ = compute_advantages(kind, r, group_size=G, mask=jnp.asarray(mask))
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str(kind))
    v = jnp.asarray(np.random.default_rng(6).normal(size=(B, T)).astype(np.float32))
    got, _ = compute_advantages("gae", r, mask=jnp.asarray(mask), values=v, gamma=0.9, lam=0.8)
    (want, _), _ = gae(outcome_token_rewards(r, jnp.asarray(mask)), v, jnp.asarray(mask), 0.9, 0.8)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_bad_inputs_are_reported(rewards):
    with pytest.raises(ValueError, match="group_size=5"):
        grpo_advantages(jnp.asarray(rewards), 5)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(jnp.asarray(rewards), 1)
    with pytest.raises(ValueError, match="unknown kind 'ppo'"):
        compute_advantages("ppo", jnp.asarray(rewards), group_size=G)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", jnp.asarray(rewards))
