"""Losses against numpy references written from the formulas, on random inputs with padding masks."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.learners.corrections import token_tis_weights
from rpegjax.learners.losses import (
    KLKind,
    LossAggregation,
    aggregation_denominator,
    entropy_bonus,
    gspo_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)

B, T = 6, 10
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    mask = np.zeros((B, T), bool)
    for i in range(B):
        mask[i, rng.integers(1, 4) : rng.integers(5, T + 1)] = True
    mask[2, 6] = False  # a hole
    mask[5] = False  # a row with no response tokens at all
    old = rng.normal(-2.0, 1.0, size=(B, T)).astype(np.float32)
    logprobs = (old + rng.normal(0, 0.4, size=(B, T))).astype(np.float32)  # ratios ~ e^{+-0.4}: many clipped
    behaviour = (old + rng.normal(0, 0.5, size=(B, T))).astype(np.float32)
    # garbage at padding must not matter
    logprobs = np.where(mask, logprobs, np.inf).astype(np.float32)
    return dict(
        mask=mask, old=old, logprobs=logprobs, behaviour=behaviour,
        adv_seq=rng.normal(size=B).astype(np.float32), adv_tok=rng.normal(size=(B, T)).astype(np.float32),
    )


def np_aggregate(loss, mask, aggregation, max_length=None):
    loss = np.where(mask, loss, 0.0).astype(np.float64)
    counts = mask.sum(1)
    rows = counts > 0
    if aggregation == "token-mean":
        return loss.sum() / mask.sum()
    if aggregation == "seq-mean-token-mean":
        return np.mean(loss.sum(1)[rows] / counts[rows])
    return np.mean(loss.sum(1)[rows] / (max_length or mask.shape[1]))


def np_token_policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_clip=None, behaviour=None, cap=None):
    a = adv[:, None] * np.ones_like(lp) if adv.ndim == 1 else adv
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = np.exp(np.where(mask, lp - old, 0.0).astype(np.float64))
    loss = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        loss = np.where(a < 0, np.minimum(loss, -a * dual_clip), loss)
    if behaviour is not None:
        w = np.exp(old - behaviour)
        loss = loss * (np.minimum(w, cap) if cap is not None else w)
    return loss, ratio


@pytest.mark.parametrize("aggregation,adv_kind", itertools.product(AGGREGATIONS, ["adv_seq", "adv_tok"]))
def test_policy_loss_matches_numpy(data, aggregation, adv_kind):
    d = data
    want, ratio = np_token_policy_loss(d["logprobs"], d["old"], d[adv_kind], d["mask"], 0.2, 0.28)
    got, metrics = policy_loss(
        jnp.asarray(d["logprobs"]), jnp.asarray(d["old"]), jnp.asarray(d[adv_kind]), jnp.asarray(d["mask"]),
        clip_low=0.2, clip_high=0.28, aggregation=LossAggregation(aggregation),
    )
    np.testing.assert_allclose(got, np_aggregate(want, d["mask"], aggregation), rtol=1e-5, atol=1e-6)
    m = d["mask"]
    a = d[adv_kind][:, None] * np.ones((B, T)) if adv_kind == "adv_seq" else d[adv_kind]
    clipped = (-a * np.clip(ratio, 0.8, 1.28)) > (-a * ratio)
    assert 0 < clipped[m].mean() < 1, "test data must exercise clipping"
    np.testing.assert_allclose(metrics["clip_fraction"], clipped[m].mean(), atol=1e-6)
    np.testing.assert_allclose(metrics["approx_kl"], np.mean(ratio[m] - 1 - np.log(ratio[m])), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], ratio[m].max(), rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_min"], ratio[m].min(), rtol=1e-6)


def test_policy_loss_max_length_and_string_aggregation(data):
    d = data
    want, _ = np_token_policy_loss(d["logprobs"], d["old"], d["adv_seq"], d["mask"], 0.2, 0.2)
    got, _ = policy_loss(
        jnp.asarray(d["logprobs"]), jnp.asarray(d["old"]), jnp.asarray(d["adv_seq"]), jnp.asarray(d["mask"]),
        aggregation="seq-mean-token-sum-norm", max_length=32,
    )
    np.testing.assert_allclose(got, np_aggregate(want, d["mask"], "seq-mean-token-sum-norm", 32), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        policy_loss(jnp.asarray(d["logprobs"]), jnp.asarray(d["old"]), jnp.asarray(d["adv_seq"]), jnp.asarray(d["mask"]), aggregation="mean")


@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_policy_loss_and_dual_clip(data, cap):
    d = data
    want, _ = np_token_policy_loss(d["logprobs"], d["old"], d["adv_tok"], d["mask"], 0.2, 0.2, 3.0, d["behaviour"], cap)
    weights, _ = token_tis_weights(jnp.asarray(d["old"]), jnp.asarray(d["behaviour"]), jnp.asarray(d["mask"]), cap=cap)
    got, _ = policy_loss(
        jnp.asarray(d["logprobs"]), jnp.asarray(d["old"]), jnp.asarray(d["adv_tok"]), jnp.asarray(d["mask"]),
        dual_clip=3.0, weights=weights,
    )
    np.testing.assert_allclose(got, np_aggregate(want, d["mask"], "token-mean"), rtol=1e-5, atol=1e-6)


def _grad_wrt_logprobs(fn, d, **kwargs):
    def loss(lp):
        return fn(lp, jnp.asarray(d["old"]), kwargs.pop("adv", jnp.asarray(d["adv_tok"])), jnp.asarray(d["mask"]), **kwargs)[0]

    return np.asarray(jax.grad(loss)(jnp.asarray(d["logprobs"])))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_zero_advantages_give_zero_gradient(data, aggregation):
    grad = _grad_wrt_logprobs(policy_loss, data, adv=jnp.zeros((B, T)), aggregation=aggregation, dual_clip=2.0)
    np.testing.assert_array_equal(grad, 0.0)
    grad = _grad_wrt_logprobs(gspo_loss, data, adv=jnp.zeros(B))
    np.testing.assert_array_equal(grad, 0.0)


def test_at_ratio_one_clipped_equals_unclipped(data):
    d = data
    lp, mask, adv = jnp.asarray(d["old"]), jnp.asarray(d["mask"]), jnp.asarray(d["adv_tok"])

    def loss(x, **clip):
        return policy_loss(x, jnp.asarray(d["old"]), adv, mask, **clip)[0]

    unclipped = dict(clip_low=0.999999, clip_high=1e9)
    np.testing.assert_allclose(loss(lp), loss(lp, **unclipped), rtol=1e-6)
    g_clip, g_free = jax.grad(loss)(lp), jax.grad(lambda x: loss(x, **unclipped))(lp)
    np.testing.assert_allclose(g_clip, g_free, rtol=1e-6)
    # at ratio 1 the gradient is the plain policy gradient -A / (number of tokens) on every token
    np.testing.assert_allclose(g_clip, np.where(d["mask"], -d["adv_tok"] / d["mask"].sum(), 0.0), rtol=1e-5, atol=1e-7)


def test_clipping_bites_exactly_where_the_formula_says(data):
    d = data
    a, m = d["adv_tok"], d["mask"]
    ratio = np.exp(np.where(m, d["logprobs"] - d["old"], 0.0))
    grad = _grad_wrt_logprobs(policy_loss, data, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    unclipped_term = -a * ratio
    active = unclipped_term >= -a * np.clip(ratio, 0.8, 1.28)  # the max picks the ratio-dependent term
    active &= ~((a < 0) & (np.maximum(unclipped_term, -a * np.clip(ratio, 0.8, 1.28)) > -a * 3.0))
    want = np.where(m & active, -a * ratio / m.sum(), 0.0)
    assert (m & ~active).any() and (m & active).any()
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


def test_decoupled_gradient_is_weighted(data):
    d = data
    w = np.minimum(np.exp(d["old"] - d["behaviour"]), 1.3)
    base = _grad_wrt_logprobs(policy_loss, data)
    weighted = _grad_wrt_logprobs(policy_loss, data, weights=jnp.asarray(w))
    np.testing.assert_allclose(weighted, np.where(d["mask"], base * w, 0.0), rtol=1e-5, atol=1e-8)


def np_gspo(lp, old, adv, mask, clip_low, clip_high):
    rows = mask.any(1)
    log_s = np.where(mask, lp - old, 0.0).sum(1) / np.maximum(mask.sum(1), 1)
    s = np.exp(log_s)
    per_seq = np.maximum(-adv * s, -adv * np.clip(s, 1 - clip_low, 1 + clip_high))
    return per_seq[rows].mean(), s


def test_gspo_matches_sequence_level_formula_value_and_gradient(data):
    d = data
    lp = np.where(d["mask"], d["old"] + np.random.default_rng(1).normal(0, 0.02, (B, T)), 0.0).astype(np.float32)
    want, s = np_gspo(lp, d["old"], d["adv_seq"], d["mask"], 3e-3, 4e-3)
    args = (jnp.asarray(d["old"]), jnp.asarray(d["adv_seq"]), jnp.asarray(d["mask"]))
    got, metrics = gspo_loss(jnp.asarray(lp), *args, clip_low=3e-3, clip_high=4e-3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    a, m = d["adv_seq"], d["mask"]
    rows = m.any(1)
    clipped = (-a * np.clip(s, 1 - 3e-3, 1 + 4e-3)) > (-a * s)
    assert clipped[rows].any() and (~clipped[rows]).any()
    np.testing.assert_allclose(metrics["clip_fraction"], clipped[rows].mean(), atol=1e-6)
    # d/d lp_it of the sequence-level loss: -(1/|S|) A_i s_i / n_i on unclipped sequences
    want_grad = np.where(m & ~clipped[:, None], (-a * s / np.maximum(m.sum(1), 1))[:, None] / rows.sum(), 0.0)
    grad = jax.grad(lambda x: gspo_loss(x, *args, clip_low=3e-3, clip_high=4e-3)[0])(jnp.asarray(lp))
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_gspo_token_advantages(data):
    d = data
    m = d["mask"]
    log_s = np.where(m, d["logprobs"] - d["old"], 0.0).sum(1) / np.maximum(m.sum(1), 1)
    s = np.exp(log_s)[:, None]
    a = d["adv_tok"]
    token = np.maximum(-a * s, -a * np.clip(s, 0.8, 1.2))
    got, _ = gspo_loss(jnp.asarray(d["logprobs"]), jnp.asarray(d["old"]), jnp.asarray(a), jnp.asarray(m), clip_low=0.2, clip_high=0.2)
    np.testing.assert_allclose(got, np_aggregate(token, m, "seq-mean-token-mean"), rtol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(data, kind):
    d = data
    lp, ref, m = d["old"], d["behaviour"], d["mask"]
    x = lp.astype(np.float64) - ref
    want = {"k1": x, "k2": 0.5 * x**2, "k3": np.exp(ref - lp) - (ref - lp) - 1}[kind]
    got, metrics = kl_penalty(jnp.asarray(lp), jnp.asarray(ref), KLKind(kind), jnp.asarray(m))
    np.testing.assert_allclose(got, np.where(m, want, 0.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["kl"], want[m].mean(), rtol=1e-5)
    grad = jax.grad(lambda p: jnp.sum(kl_penalty(p, jnp.asarray(ref), kind)[0]))(jnp.asarray(lp))
    want_grad = {"k1": np.ones_like(x), "k2": x, "k3": 1 - np.exp(-x)}[kind]
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip,aggregation", [(0.2, "token-mean"), (None, "token-mean"), (0.1, "seq-mean-token-mean")])
def test_value_loss_matches_numpy(data, clip, aggregation):
    rng = np.random.default_rng(2)
    m = data["mask"]
    values, old, returns = (rng.normal(size=(B, T)).astype(np.float32) for _ in range(3))
    if clip is None:
        token = 0.5 * (values - returns) ** 2
    else:
        clipped_values = old + np.clip(values - old, -clip, clip)
        token = 0.5 * np.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    got, metrics = value_loss(jnp.asarray(values), jnp.asarray(old), jnp.asarray(returns), jnp.asarray(m),
                              clip=clip, aggregation=aggregation)
    np.testing.assert_allclose(got, np_aggregate(token, m, aggregation), rtol=1e-5)
    if clip is not None:
        frac = ((clipped_values - returns) ** 2 > (values - returns) ** 2)[m].mean()
        assert 0 < frac < 1
        np.testing.assert_allclose(metrics["value_clip_fraction"], frac, atol=1e-6)


def test_entropy_bonus(data):
    m = data["mask"]
    entropy = np.random.default_rng(3).uniform(0, 3, size=(B, T)).astype(np.float32)
    loss, metrics = entropy_bonus(jnp.asarray(entropy), jnp.asarray(m), aggregation="seq-mean-token-mean")
    np.testing.assert_allclose(loss, -np_aggregate(entropy, m, "seq-mean-token-mean"), rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"], -loss)


@pytest.mark.parametrize("aggregation", AGGREGATIONS + ["gspo"])
def test_global_denominator_makes_micro_batches_sum_to_the_batch(data, aggregation):
    """Loss and gradient of row blocks with the whole batch's denominator sum to the whole batch's."""
    d = data
    if aggregation == "gspo":
        loss_fn, options = gspo_loss, dict(clip_low=0.2, clip_high=0.2)
        denominator_kind = "seq-mean-token-mean"
    else:
        loss_fn, options = policy_loss, dict(aggregation=aggregation, dual_clip=3.0)
        denominator_kind = aggregation
    lp = np.where(d["mask"], d["logprobs"], 0.0).astype(np.float32)
    weights = np.minimum(np.exp(d["old"] - d["behaviour"]), 1.5).astype(np.float32)

    def total(lp, rows_list, denominator=None):
        return sum(
            loss_fn(lp[rows], jnp.asarray(d["old"][rows]), jnp.asarray(d["adv_tok"][rows]), jnp.asarray(d["mask"][rows]),
                    weights=jnp.asarray(weights[rows]), denominator=denominator, **options)[0]
            for rows in rows_list
        )

    denominator = aggregation_denominator(jnp.asarray(d["mask"]), denominator_kind)
    blocks = [np.arange(0, 2), np.arange(2, 5), np.arange(5, B)]
    full, grad_full = jax.jit(jax.value_and_grad(lambda x: total(x, [np.arange(B)])))(jnp.asarray(lp))
    split, grad_split = jax.jit(jax.value_and_grad(lambda x: total(x, blocks, denominator)))(jnp.asarray(lp))
    np.testing.assert_allclose(split, full, rtol=1e-6)
    np.testing.assert_allclose(grad_split, grad_full, rtol=1e-6, atol=1e-9)


def test_bad_arguments_are_reported(data):
    d = data
    args = (jnp.asarray(d["logprobs"]), jnp.asarray(d["old"]), jnp.asarray(d["adv_seq"]), jnp.asarray(d["mask"]))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(*args, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"weights has shape \(6, 9\), expected \(6, 10\)"):
        policy_loss(*args, weights=jnp.ones((B, T - 1)))
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(*args[:2], jnp.zeros(B + 1), args[3])
    with pytest.raises(ValueError, match="unknown kind 'k4'"):
        kl_penalty(args[0], args[1], "k4")
