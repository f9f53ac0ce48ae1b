"""The routers == their references: Qwen3-MoE's softmax top-k == numpy; DeepSeek-V3's sigmoid, correction-biased,
group-limited, scaled top-k == transformers' DeepseekV3TopkRouter (torch CPU, float32) on the same weights."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.models.routing import RouterScoring, RoutingRule, replay_weights, route

N, D, X, K = 23, 16, 5, 2


def test_softmax_route_is_top_k_renormalised():
    logits = jax.random.normal(jax.random.key(0), (N, X)) * 2
    probabilities = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected_ids = np.argsort(-probabilities, axis=-1)[:, :K]
    for norm in (False, True):
        rule = RoutingRule(top_k=K, norm_topk_prob=norm)
        ids, weights = route(logits, rule)
        np.testing.assert_array_equal(ids, expected_ids)
        top = np.take_along_axis(probabilities, expected_ids, -1)
        np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True) if norm else top, rtol=1e-5)
        np.testing.assert_allclose(replay_weights(logits, ids, rule), weights, rtol=1e-6)


def _deepseek_router(experts: int, top_k: int, groups: int, topk_groups: int, norm: bool, factor: float):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=experts, num_experts_per_tok=top_k,
                                           n_group=groups, topk_group=topk_groups, norm_topk_prob=norm,
                                           routed_scaling_factor=factor)
    router = DeepseekV3TopkRouter(config).eval()
    generator = torch.Generator().manual_seed(experts + groups)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        # a bias of the size of the score spread, so that it changes which experts (and groups) win
        router.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=generator))
    return torch, router


@pytest.mark.parametrize("experts, top_k, groups, topk_groups, norm, factor", [
    (16, 4, 4, 2, True, 2.5),  # DeepSeek-V3's shape in small: 8 groups of 32, 4 kept, 8 per token
    (12, 3, 1, 1, False, 1.0),  # one group (Kimi-K2's n_group 1), no renormalisation
    (12, 2, 6, 3, True, 1.5),  # groups of two: the group score is the sum of both
])
def test_sigmoid_grouped_route_matches_transformers(experts, top_k, groups, topk_groups, norm, factor):
    torch, router = _deepseek_router(experts, top_k, groups, topk_groups, norm, factor)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits, their_weights, their_ids = router(x)
    rule = RoutingRule(top_k=top_k, norm_topk_prob=norm, scoring=RouterScoring.SIGMOID, groups=groups,
                       topk_groups=topk_groups, scaling_factor=factor)
    bias = jnp.asarray(router.e_score_correction_bias.numpy())
    ours_logits = jnp.asarray(x.numpy()) @ jnp.asarray(router.weight.detach().numpy()).T
    np.testing.assert_allclose(ours_logits, logits.numpy(), atol=1e-5)
    ids, weights = route(ours_logits, rule, bias)
    # transformers returns its top k unsorted: compare each token's (expert, weight) pairs in expert order
    theirs = np.argsort(their_ids.numpy(), axis=-1)
    ours = np.argsort(np.asarray(ids), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), ours, -1),
                                  np.take_along_axis(their_ids.numpy(), theirs, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), ours, -1),
                               np.take_along_axis(their_weights.numpy(), theirs, -1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(replay_weights(ours_logits, ids, rule), weights, rtol=1e-6)
    if groups > 1:  # the group limit binds: some token's plain top k (biased scores, no groups) differs
        plain, _ = route(ours_logits, RoutingRule(top_k=top_k, norm_topk_prob=norm, scoring=RouterScoring.SIGMOID), bias)
        assert np.any(np.sort(np.asarray(plain), -1) != np.sort(np.asarray(ids), -1))


def test_correction_bias_chooses_but_does_not_weigh_and_gets_no_gradient():
    logits = jax.random.normal(jax.random.key(1), (N, 8))
    rule = RoutingRule(top_k=2, norm_topk_prob=False, scoring=RouterScoring.SIGMOID)
    bias = jnp.zeros(8).at[7].set(10.0)  # expert 7 wins every token
    ids, weights = route(logits, rule, bias)
    assert np.all(np.asarray(ids)[:, 0] == 7)
    np.testing.assert_allclose(weights[:, 0], jax.nn.sigmoid(logits[:, 7]), rtol=1e-6)
    gradient = jax.grad(lambda b: jnp.sum(route(logits, rule, b)[1]))(bias)
    np.testing.assert_array_equal(gradient, 0.0)


@pytest.mark.parametrize("changes, message", [
    (dict(router_groups=3), "router_groups (3) must divide num_experts (8)"),
    (dict(router_groups=8), "two best experts"),
    (dict(router_groups=4, router_topk_groups=5), "router_topk_groups (5) exceeds router_groups (4)"),
    (dict(router_groups=4, router_topk_groups=1, num_experts_per_token=3), "num_experts_per_token (3) exceeds the 2"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a positive number"),
    (dict(router_scoring="tanh"), "ModelConfig.router_scoring must be one of ['softmax', 'sigmoid'], got 'tanh'"),
])
def test_router_options_are_validated_naming_the_field(changes, message):
    from rpegjax.models import Architecture, ModelConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.tiny(Architecture.QWEN3_MOE, num_experts=8, **changes)
    with pytest.raises(ValueError, match="router_scoring='sigmoid' is a router option; architecture qwen2"):
        ModelConfig.tiny(router_scoring="sigmoid")


def test_sparse_layer_routes_with_its_rule_and_correction_bias(tmp_path):
    from flax import nnx

    from rpegjax.models import Architecture, Decoder, ModelConfig
    from rpegjax.models.config import routing_rule
    from rpegjax.models.hf import save_pretrained
    from rpegjax.models.hf_layout import CheckpointError
    from rpegjax.models.moe import SparseMoE

    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, num_experts=8, num_experts_per_token=2, router_scoring="sigmoid",
                           router_correction_bias=True, router_groups=4, router_topk_groups=2, routed_scaling_factor=2.5)
    layer = SparseMoE(cfg, rngs=nnx.Rngs(0))
    layer.correction_bias.set_value(jax.random.normal(jax.random.key(3), (8,)) * 0.5)
    x = jax.random.normal(jax.random.key(4), (2, 5, cfg.hidden_size))
    _, routing = layer(x, None)
    logits = x.reshape(10, -1) @ layer.router.get_value()
    ids, _ = route(logits, routing_rule(cfg), layer.correction_bias.get_value())
    np.testing.assert_array_equal(routing.expert_ids.reshape(10, 2), ids)
    unbiased, _ = route(logits, routing_rule(cfg))
    assert np.any(np.asarray(unbiased) != np.asarray(ids))  # the bias chose
    # transformers' Qwen3-MoE has no such router: refused rather than saved as a different model
    with pytest.raises(CheckpointError, match="routes by softmax top-k alone"):
        save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "out")
