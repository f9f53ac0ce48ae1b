"""Router training terms of a mixture-of-experts policy: the load-balancing loss, the router z-loss and
the expert-load metrics, from the routing a forward pass returns (`rpegjax.models.moe.Routing`).

Over the N real tokens of a forward and its s sparse layers (x experts, k per token), with p_ne the router's
softmax probability of expert e for token n in layer l and c_le the number of tokens layer l sends to e:

    load balance  L_bal = x * sum_e f_e P_e,   f_e = sum_l c_le / (s N),   P_e = sum_l sum_n p_ne / (s N)
    z-loss        L_z   = sum_l sum_n logsumexp_e(router logits)^2 / (s N)

L_bal is transformers' `load_balancing_loss_func` (Switch Transformer eqs. 4-6 as Qwen3-MoE trains with it; the
fractions pooled over layers, top-k counts); it is k under uniform routing and grows as routing concentrates.
L_z is ST-MoE's router z-loss. A micro-batch contributes its terms weighted by its share of the mini-batch's
tokens, so that the terms summed over micro-batches are their token-weighted mean (one micro-batch: exactly the
formulas above on the whole batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.objective import PolicyConfig
from rpegjax.models.experts import tokens_per_expert
from rpegjax.models.moe import Routing

Metrics = dict[str, Array]


def load_balancing_loss(routing: Routing, mask: Bool[Array, "b t"]) -> Float[Array, ""]:
    """L_bal above over the tokens where `mask` is true (routing stacked over sparse layers: [b t s ...])."""
    num_experts = routing.router_logits.shape[-1]
    valid = mask.astype(jnp.float32)
    rows = jnp.maximum(jnp.sum(valid) * routing.expert_ids.shape[2], 1.0)  # s N
    probabilities = jax.nn.softmax(routing.router_logits.astype(jnp.float32), axis=-1)
    probability_sum = jnp.einsum("btsx,bt->x", probabilities, valid)
    one_hot = jax.nn.one_hot(routing.expert_ids, num_experts, dtype=jnp.float32)  # b t s k x
    count_sum = jnp.einsum("btskx,bt->x", one_hot, valid)  # f sums to k, as in transformers
    return num_experts * jnp.sum((count_sum / rows) * (probability_sum / rows))


def router_z_loss(routing: Routing, mask: Bool[Array, "b t"]) -> Float[Array, ""]:
    """L_z above: the mean over real tokens and sparse layers of the squared log-partition of the router."""
    valid = mask.astype(jnp.float32)
    z = jax.nn.logsumexp(routing.router_logits.astype(jnp.float32), axis=-1)  # b t s
    rows = jnp.maximum(jnp.sum(valid) * z.shape[2], 1.0)
    return jnp.einsum("bts,bt->", z * z, valid) / rows


def expert_load_metrics(routing: Routing, mask: Bool[Array, "b t"]) -> Metrics:
    """Tokens per expert in each sparse layer: the largest count (`*_max`, any layer) and the mean (N k / x); the
    (token, expert) assignments the capacity mode dropped per sparse layer (`moe/dropped_tokens`, 0 dropless) and
    their fraction of the N k assignments."""
    b, t, s, k = routing.expert_ids.shape
    num_experts = routing.router_logits.shape[-1]
    valid = mask.reshape(-1).astype(jnp.float32)
    per_layer = routing.expert_ids.reshape(b * t, s, k)
    counts = jax.vmap(lambda ids: tokens_per_expert(ids, valid, num_experts), in_axes=1)(per_layer)  # s x
    dropped = jnp.einsum("bts,bt->", routing.dropped.astype(jnp.float32), mask.astype(jnp.float32)) / s
    return {"moe/tokens_per_expert_max": jnp.max(counts), "moe/tokens_per_expert_mean": jnp.mean(counts),
            "moe/dropped_tokens": dropped, "moe/dropped_fraction": dropped / jnp.maximum(jnp.sum(valid) * k, 1.0)}


def router_objective(routing: Routing, mask: Bool[Array, "b t"], total_tokens: Float[Array, ""], *,
                     aux_loss_coef: float, z_loss_coef: float) -> tuple[Float[Array, ""], Metrics]:
    """aux_loss_coef L_bal + z_loss_coef L_z of one micro-batch, weighted by its share of the `total_tokens` of
    its mini-batch, with the unweighted terms and the expert-load metrics."""
    balance, z = load_balancing_loss(routing, mask), router_z_loss(routing, mask)
    share = jnp.sum(mask.astype(jnp.float32)) / jnp.maximum(total_tokens, 1.0)
    loss = share * (aux_loss_coef * balance + z_loss_coef * z)
    metrics = {"moe/load_balance": balance, "moe/router_z": z, "moe/router_loss": loss}
    return loss, metrics | expert_load_metrics(routing, mask)


def add_router_terms(cfg: PolicyConfig, loss: Float[Array, ""], metrics: Metrics, routing: Routing | None,
                     batch: TrainBatch, denominators: dict[str, Array]) -> tuple[Float[Array, ""], Metrics]:
    """The policy loss plus the router terms of `cfg` and the expert-load metrics (a dense model: unchanged)."""
    if routing is None:
        return loss, metrics
    router_loss, router_metrics = router_objective(
        routing, batch.token_mask, denominators["tokens"], aux_loss_coef=cfg.router_aux_loss_coef,
        z_loss_coef=cfg.router_z_loss_coef)
    if cfg.router_replay and batch.expert_ids is not None:
        router_metrics["moe/replay_routing_differs"] = replay_disagreement(routing, batch.expert_ids, batch.token_mask)
    return loss + router_loss, metrics | router_metrics


def replay_disagreement(routing: Routing, recorded: Int[Array, "b t s k"], mask: Bool[Array, "b t"]) -> Float[Array, ""]:
    """The fraction of recorded (token, sparse layer) decisions where this pass's router would pick another set of
    experts than the rollout did: how much routing the replay overrides."""
    own = jax.lax.top_k(jax.lax.stop_gradient(routing.router_logits), recorded.shape[-1])[1]
    differs = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(recorded, axis=-1), axis=-1)  # b t s
    counted = (mask[..., None] & jnp.all(recorded >= 0, axis=-1)).astype(jnp.float32)
    return jnp.sum(differs * counted) / jnp.maximum(jnp.sum(counted), 1.0)
