"""Dropless grouped expert computation == a dense reference that runs every expert on every token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.models.experts import apply_experts, tokens_per_expert
from rpegjax.models.routing import RoutingRule, route

N, D, F, X, K = 19, 8, 6, 5, 2


def _dense_reference(x, ids, weights, gate, up, down):
    """Every expert on every token, combined with one-hot weights (numpy float64)."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    combine = np.zeros((x.shape[0], gate.shape[0]))
    for j in range(ids.shape[1]):
        combine[np.arange(x.shape[0]), np.asarray(ids[:, j])] += np.asarray(weights[:, j])
    g = np.einsum("nd,xdf->nxf", x, gate)
    hidden = g / (1 + np.exp(-g)) * np.einsum("nd,xdf->nxf", x, up)
    return np.einsum("nxf,xfd,nx->nd", hidden, down, combine)


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (N, D))
    gate = jax.random.normal(keys[1], (X, D, F)) / np.sqrt(D)
    up = jax.random.normal(keys[2], (X, D, F)) / np.sqrt(D)
    down = jax.random.normal(keys[3], (X, F, D)) / np.sqrt(F)
    logits = jax.random.normal(keys[4], (N, X)) * 2
    return x, logits, gate, up, down


def test_apply_experts_equals_dense_reference_forward_and_gradients():
    x, logits, gate, up, down = _inputs()
    ids, weights = route(logits, RoutingRule(top_k=K, norm_topk_prob=True))
    assert len(set(np.asarray(ids).ravel().tolist())) == X  # every expert gets tokens, unevenly
    out = jax.jit(apply_experts)(x, ids, weights, gate, up, down)
    np.testing.assert_allclose(out, _dense_reference(x, ids, weights, gate, up, down), atol=1e-5)

    def loss(args, fn):
        return jnp.sum(jnp.sin(fn(args[0], ids, args[1], *args[2:])))

    def dense(x, ids, weights, gate, up, down):  # jnp twin of the reference, for autodiff
        combine = jnp.einsum("nkx,nk->nx", jax.nn.one_hot(ids, X), weights)
        g = jnp.einsum("nd,xdf->nxf", x, gate)
        return jnp.einsum("nxf,xfd,nx->nd", jax.nn.silu(g) * jnp.einsum("nd,xdf->nxf", x, up), down, combine)

    args = (x, weights, gate, up, down)
    ours = jax.grad(loss)(args, apply_experts)
    reference = jax.grad(loss)(args, dense)
    for a, b, name in zip(ours, reference, ("x", "weights", "gate", "up", "down"), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)


def test_experts_without_tokens_and_one_expert_in_every_row():
    """Experts 3 and 4 get no token, expert 0 every token: each assignment is still computed once."""
    x, _, gate, up, down = _inputs(1)
    ids = jnp.stack([jnp.zeros(N, jnp.int32), jnp.asarray(np.arange(N) % 2 + 1, jnp.int32)], 1)
    weights = jax.random.uniform(jax.random.key(2), (N, K))
    out = apply_experts(x, ids, weights, gate, up, down)
    np.testing.assert_allclose(out, _dense_reference(x, ids, weights, gate, up, down), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_low_precision_inputs_keep_their_dtype(dtype):
    x, logits, gate, up, down = _inputs()
    ids, weights = route(logits, RoutingRule(top_k=K, norm_topk_prob=False))
    out = apply_experts(x.astype(dtype), ids, weights, gate.astype(dtype), up.astype(dtype), down.astype(dtype))
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float32), _dense_reference(x, ids, weights, gate, up, down), atol=0.05)


def test_tokens_per_expert_counts_valid_tokens_only():
    ids = jnp.asarray([[0, 1], [1, 2], [0, 2]], jnp.int32)
    np.testing.assert_array_equal(tokens_per_expert(ids, jnp.asarray([1.0, 1.0, 0.0]), 4), [1, 2, 1, 0])
