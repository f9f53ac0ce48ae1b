"""Which experts each token uses and with what weights: the routers of Qwen3-MoE and DeepSeek-V3.

For router logits z [n, x] (float32) a `RoutingRule` gives each token's k experts and weights:

    scores   s = softmax(z) (Qwen3-MoE)  or  sigmoid(z) (DeepSeek-V3)          [n, x]
    choice   c = s + b   with the correction bias b [x] when the layer has one (DeepSeek's aux-loss-free balancing)
    groups   with G > 1 groups of x / G consecutive experts, group g scores the sum of its two largest c; only the
             `topk_groups` best groups stay eligible (the others' c become -inf): group-limited routing
    experts  the k eligible experts of largest c
    weights  w_j = s_{e_j} (the bias only chooses; it never weights), divided by sum_j w_j when `norm_topk_prob`
             (DeepSeek adds 1e-20 to that sum), then times `scaling_factor` (DeepSeek's routed_scaling_factor)

which is transformers' Qwen3MoeTopKRouter (softmax, G = 1, no bias, factor 1) and DeepseekV3TopkRouter (sigmoid,
bias, `n_group`, `topk_group`, `routed_scaling_factor`, the `noaux_tc` top-k of the published config). A replayed
routing (`replay_weights`) keeps the recorded experts and weights them by this pass's scores the same way, so the
router still learns; the correction bias only chooses, so a replay does not read it.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class RouterScoring(enum.StrEnum):
    """How router logits become expert scores (config.json `scoring_func`)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingRule:
    """The routing maths above for one sparse layer (the expert count comes with the logits)."""

    top_k: int
    norm_topk_prob: bool
    scoring: RouterScoring = RouterScoring.SOFTMAX
    groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0


def router_scores(router_logits: Float[Array, "n x"], scoring: RouterScoring) -> Float[Array, "n x"]:
    """s above, float32."""
    logits = router_logits.astype(jnp.float32)
    return jax.nn.softmax(logits, axis=-1) if scoring is RouterScoring.SOFTMAX else jax.nn.sigmoid(logits)


def _eligible(choice: Float[Array, "n x"], groups: int, topk_groups: int) -> Float[Array, "n x"]:
    """`choice` with the experts outside each token's `topk_groups` best groups set to -inf."""
    n, x = choice.shape
    grouped = choice.reshape(n, groups, x // groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # n G
    kept = jax.lax.top_k(group_scores, topk_groups)[1]
    mask = jnp.zeros((n, groups), bool).at[jnp.arange(n)[:, None], kept].set(True)
    return jnp.where(mask[:, :, None], grouped, -jnp.inf).reshape(n, x)


def _weights(scores: Float[Array, "n x"], expert_ids: Int[Array, "n k"], rule: RoutingRule) -> Float[Array, "n k"]:
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if rule.norm_topk_prob:
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if rule.scoring is RouterScoring.SIGMOID else total)
    return weights * rule.scaling_factor if rule.scaling_factor != 1.0 else weights


def route(router_logits: Float[Array, "n x"], rule: RoutingRule, correction_bias: Float[Array, " x"] | None = None
          ) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """(expert ids, weights) of each token under `rule`, in float32; `correction_bias` is b above (None: none).
    Ids come in decreasing order of the choice score."""
    scores = router_scores(router_logits, rule.scoring)
    # the bias is a fixed statistic of pre-training, not a trained weight: it only picks experts (no gradient)
    choice = scores if correction_bias is None else scores + jax.lax.stop_gradient(correction_bias.astype(jnp.float32))
    if rule.groups > 1:
        choice = _eligible(choice, rule.groups, rule.topk_groups)
    expert_ids = jax.lax.top_k(choice, rule.top_k)[1].astype(jnp.int32)
    return expert_ids, _weights(scores, expert_ids, rule)


def replay_weights(router_logits: Float[Array, "n x"], expert_ids: Int[Array, "n k"], rule: RoutingRule
                   ) -> Float[Array, "n k"]:
    """The weights `route` would give the given (replayed) experts under these router logits. Differentiable in the
    logits, as the routed weights are."""
    return _weights(router_scores(router_logits, rule.scoring), expert_ids, rule)
