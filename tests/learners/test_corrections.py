"""Rollout corrections and mismatch metrics against numpy references written from the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.learners.corrections import (
    CorrectionKind,
    correction_weights,
    geometric_mask_weights,
    icepop_weights,
    mismatch_metrics,
    sequence_tis_weights,
    token_tis_weights,
)

B, T = 6, 10


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    mask = np.zeros((B, T), bool)
    for i in range(B):
        mask[i, rng.integers(1, 4): rng.integers(5, T + 1)] = True
    mask[2, 6] = False  # a hole
    mask[5] = False  # a row without response tokens
    old = rng.normal(-2.0, 1.0, size=(B, T)).astype(np.float32)
    behaviour = (old + rng.normal(0, 0.8, size=(B, T))).astype(np.float32)  # ratios e^{+-0.8}: both bands bite
    behaviour[0, mask[0].argmax()] = old[0, mask[0].argmax()] - 30.0  # one huge ratio
    behaviour = np.where(mask, behaviour, np.inf).astype(np.float32)  # padding holds garbage
    old_padded = np.where(mask, old, -np.inf).astype(np.float32)
    return dict(mask=mask, old=old_padded, behaviour=behaviour)


def np_log_ratio(d):
    with np.errstate(invalid="ignore"):
        return np.where(d["mask"], d["old"].astype(np.float64) - d["behaviour"], 0.0)


def np_sequence(d, values):
    """[b] -> [b, t] on the mask, 0 elsewhere."""
    return np.where(d["mask"], values[:, None], 0.0)


def run(fn, d, **options):
    weights, metrics = fn(jnp.asarray(d["old"]), jnp.asarray(d["behaviour"]), jnp.asarray(d["mask"]), **options)
    return np.asarray(weights), {k: float(v) for k, v in metrics.items()}


def frac(flags, mask):
    return (flags & mask).sum() / mask.sum()


@pytest.mark.parametrize("cap", [None, 2.0])
def test_token_tis(data, cap):
    d, m = data, data["mask"]
    rho = np.exp(np_log_ratio(d))
    want = np.where(m, rho if cap is None else np.minimum(rho, cap), 0.0)
    got, metrics = run(token_tis_weights, d, cap=cap)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(metrics["correction/weight_mean"], want[m].mean(), rtol=1e-5)
    if cap is not None:
        assert 0 < frac(rho > cap, m) < 1
        np.testing.assert_allclose(metrics["correction/truncated_fraction"], frac(rho > cap, m), atol=1e-6)


def test_sequence_tis(data):
    d, m = data, data["mask"]
    product = np.exp(np_log_ratio(d).sum(1))  # prod_t rho_t over the row's response tokens
    want = np_sequence(d, np.minimum(product, 3.0))
    got, metrics = run(sequence_tis_weights, d, cap=3.0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    truncated = np.broadcast_to((product > 3.0)[:, None], m.shape)
    assert 0 < frac(truncated, m) < 1
    np.testing.assert_allclose(metrics["correction/truncated_fraction"], frac(truncated, m), atol=1e-6)


def test_icepop(data):
    d, m = data, data["mask"]
    rho = np.exp(np_log_ratio(d))
    accepted = (rho >= 0.5) & (rho <= 2.0)
    want = np.where(m & accepted, rho, 0.0)
    got, metrics = run(icepop_weights, d, low=0.5, high=2.0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert 0 < frac(~accepted, m) < 1
    np.testing.assert_allclose(metrics["correction/masked_fraction"], frac(~accepted, m), atol=1e-6)


def test_geometric_mask(data):
    d, m = data, data["mask"]
    geometric = np.exp(np_log_ratio(d).sum(1) / np.maximum(m.sum(1), 1))
    accepted = (geometric >= 0.8) & (geometric <= 1.25)
    want = np_sequence(d, accepted.astype(np.float64))
    got, metrics = run(geometric_mask_weights, d, low=0.8, high=1.25)
    np.testing.assert_allclose(got, want)
    rejected = np.broadcast_to(~accepted[:, None], m.shape)
    assert 0 < frac(rejected, m) < 1
    np.testing.assert_allclose(metrics["correction/masked_fraction"], frac(rejected, m), atol=1e-6)


def test_mismatch_metrics(data):
    d, m = data, data["mask"]
    diff = -np_log_ratio(d)  # log mu - log pi_train
    metrics = {k: float(v) for k, v in mismatch_metrics(jnp.asarray(d["old"]), jnp.asarray(d["behaviour"]),
                                                         jnp.asarray(m)).items()}
    np.testing.assert_allclose(metrics["mismatch/kl_k1"], diff[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch/kl_k3"], (np.exp(-diff) - 1 + diff)[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch/abs_logprob_diff_max"], np.abs(diff[m]).max(), rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch/abs_logprob_diff_mean"], np.abs(diff[m]).mean(), rtol=1e-5)
    same = mismatch_metrics(jnp.asarray(d["old"]), jnp.asarray(d["old"]), jnp.asarray(m))
    assert all(float(v) == 0.0 for v in same.values())


def test_weights_carry_no_gradient(data):
    d = data
    for kind, options in [("token-tis", dict(cap=2.0)), ("sequence-tis", dict(cap=2.0)), ("icepop", {}),
                          ("geometric-mask", dict(band=(0.8, 1.25)))]:
        grad = jax.grad(lambda old: correction_weights(kind, old, jnp.asarray(d["behaviour"]), jnp.asarray(d["mask"]),
                                                       **options)[0].sum())(jnp.asarray(d["old"]))
        np.testing.assert_array_equal(grad, 0.0)


def test_dispatch_and_errors(data):
    d = data
    args = (jnp.asarray(d["old"]), jnp.asarray(d["behaviour"]), jnp.asarray(d["mask"]))
    none, metrics = correction_weights(CorrectionKind.NONE, *args)
    np.testing.assert_array_equal(none, d["mask"].astype(np.float32))
    np.testing.assert_allclose(correction_weights("icepop", *args, band=(0.5, 2.0))[0],
                               icepop_weights(*args, low=0.5, high=2.0)[0])
    with pytest.raises(ValueError, match="unknown rollout correction 'tis'"):
        correction_weights("tis", *args)
    with pytest.raises(ValueError, match="'sequence-tis' needs a cap"):
        correction_weights("sequence-tis", *args)
    with pytest.raises(ValueError, match="0 < low <= high"):
        icepop_weights(*args, low=2.0, high=0.5)
    with pytest.raises(ValueError, match="cap must be positive"):
        token_tis_weights(*args, cap=0.0)
    with pytest.raises(ValueError, match="must both match mask"):
        token_tis_weights(args[0][:, 1:], args[1], args[2], cap=None)
