"""Router terms == transformers' load_balancing_loss_func and numpy formulas; the learner adds them to its loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollouts import G, make_batch

from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.objective import policy_denominators, update_inputs
from rpegjax.learners.router import expert_load_metrics, load_balancing_loss, router_objective, router_z_loss
from rpegjax.learners.update import UpdateLayout, accumulate_gradients, split_rows
from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.models.routing import RoutingRule, route
from rpegjax.models.moe import Routing

B, T, S, X, K = 3, 7, 2, 6, 2


def _routing(seed=0):
    logits = jax.random.normal(jax.random.key(seed), (B, T, S, X)) * 2
    ids, _ = route(logits.reshape(-1, X), RoutingRule(top_k=K, norm_topk_prob=False))
    dropped = jax.random.randint(jax.random.key(seed + 100), (B, T, S), 0, K + 1)  # as a capacity mode could
    return Routing(expert_ids=ids.reshape(B, T, S, K), router_logits=logits, dropped=dropped)


def _mask():
    return jnp.arange(T)[None, :] >= jnp.asarray([0, 2, 5])[:, None]


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    routing, mask = _routing(), _mask() if masked else jnp.ones((B, T), bool)
    logits = np.asarray(routing.router_logits)
    per_layer = tuple(torch.tensor(logits[:, :, layer].reshape(B * T, X)) for layer in range(S))
    expected = load_balancing_loss_func(per_layer, X, K, torch.tensor(np.asarray(mask), dtype=torch.int64)
                                        if masked else None)
    np.testing.assert_allclose(load_balancing_loss(routing, mask), float(expected), rtol=1e-5)


def test_z_loss_and_expert_load_equal_numpy():
    routing, mask = _routing(1), np.asarray(_mask())
    logits = np.asarray(routing.router_logits, np.float64)
    z = np.log(np.exp(logits).sum(-1))  # b t s
    np.testing.assert_allclose(router_z_loss(routing, jnp.asarray(mask)), (z ** 2)[mask].mean(), rtol=1e-5)
    ids = np.asarray(routing.expert_ids)
    counts = np.stack([np.bincount(ids[:, :, layer][mask].ravel(), minlength=X) for layer in range(S)])
    metrics = expert_load_metrics(routing, jnp.asarray(mask))
    assert float(metrics["moe/tokens_per_expert_max"]) == counts.max()
    np.testing.assert_allclose(metrics["moe/tokens_per_expert_mean"], mask.sum() * K / X, rtol=1e-6)
    dropped = np.asarray(routing.dropped)[mask].sum() / S  # real tokens' dropped assignments per sparse layer
    np.testing.assert_allclose(metrics["moe/dropped_tokens"], dropped, rtol=1e-6)
    np.testing.assert_allclose(metrics["moe/dropped_fraction"], dropped / (mask.sum() * K), rtol=1e-6)


def test_micro_batch_terms_sum_to_the_token_weighted_mean():
    routing, mask = _routing(2), _mask()
    total = jnp.sum(mask)
    whole, _ = router_objective(routing, mask, total, aux_loss_coef=0.5, z_loss_coef=0.1)
    first = jax.tree.map(lambda x: x[:1], routing)
    rest = jax.tree.map(lambda x: x[1:], routing)
    parts = [router_objective(r, m, total, aux_loss_coef=0.5, z_loss_coef=0.1)[0]
             for r, m in ((first, mask[:1]), (rest, mask[1:]))]
    terms = [0.5 * load_balancing_loss(r, m) + 0.1 * router_z_loss(r, m) for r, m in ((first, mask[:1]), (rest, mask[1:]))]
    shares = [mask[:1].sum() / total, mask[1:].sum() / total]
    np.testing.assert_allclose(sum(parts), sum(s * t for s, t in zip(shares, terms)), rtol=1e-6)
    assert whole > 0


def test_grpo_loss_adds_the_router_terms_to_a_moe_policy():
    model = Decoder(ModelConfig.tiny(Architecture.QWEN3_MOE), rngs=nnx.Rngs(0))
    losses = {}
    for coef in (0.0, 0.3):
        cfg = GRPOConfig(group_size=G, router_aux_loss_coef=coef, router_z_loss_coef=coef / 10, num_microbatches=2)
        learner = GRPOLearner(cfg, model)
        batch, _ = learner.compute_advantages(make_batch())
        inputs = update_inputs(batch, cfg)
        micro = jax.tree.map(lambda x: x[0], split_rows(inputs, UpdateLayout(num_microbatches=2)))
        _, loss, metrics = jax.jit(lambda p, m, d: accumulate_gradients(learner._loss, p, m, d))(
            learner.params, micro, policy_denominators(cfg, inputs))
        losses[coef] = (float(loss), {k: float(v) for k, v in metrics.items()})
    (plain, _), (weighted, metrics) = losses[0.0], losses[0.3]
    assert metrics["moe/tokens_per_expert_max"] >= metrics["moe/tokens_per_expert_mean"] > 0
    np.testing.assert_allclose(weighted - plain, metrics["moe/router_loss"], rtol=1e-4)
    assert metrics["moe/router_loss"] > 0.3 * 0.9 and losses[0.0][1]["moe/router_loss"] == 0


def test_replayed_own_routing_changes_nothing_and_other_routing_is_counted():
    """Replaying the routing a free forward chose gives its loss exactly; replaying other experts changes the
    loss and `moe/replay_routing_differs` reports the share overridden. Without expert_ids the update refuses."""
    model = Decoder(ModelConfig.tiny(Architecture.QWEN3_MOE), rngs=nnx.Rngs(0))
    cfg = GRPOConfig(group_size=G, router_replay=True)
    learner = GRPOLearner(cfg, model)
    batch, _ = learner.compute_advantages(make_batch())
    batch = batch.replace(old_logprobs=batch.behaviour_logprobs)  # a ratio != 1: the loss value reads the log-probs
    with pytest.raises(ValueError, match="expert_ids"):
        learner.update(learner.init_state(), batch)
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.token_mask)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    _, _, routing = model.routed_hidden_states(tokens, positions, mask=mask)
    recorded = jnp.where(mask[..., None, None], routing.expert_ids, -1)

    def loss_and_metrics(expert_ids, replay):
        config = GRPOConfig(group_size=G, router_replay=replay)
        inputs = update_inputs(batch.replace(expert_ids=expert_ids), config)
        learner.cfg = config
        return learner._loss(learner.params, inputs, policy_denominators(config, inputs))

    free, _ = loss_and_metrics(None, False)
    same, same_metrics = loss_and_metrics(recorded, True)
    other, other_metrics = loss_and_metrics(jnp.where(recorded >= 0, (recorded + 1) % 4, -1), True)
    np.testing.assert_allclose(same, free, rtol=1e-6)
    assert float(same_metrics["moe/replay_routing_differs"]) == 0
    assert abs(float(other) - float(free)) > 1e-4 and float(other_metrics["moe/replay_routing_differs"]) > 0.5
