"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ (with or without a group baseline) and GAE.

Rewards are laid out group-contiguous: the G samples of prompt i are rows i*G .. i*G+G-1. Every
function is a pure function of arrays returning `(advantages, metrics)` (GAE: `((advantages,
returns), metrics)`); token-level arrays are aligned with `TrainBatch.tokens` (index i is token i).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

Metrics = dict[str, Array]


class AdvantageKind(enum.StrEnum):
    GRPO = "grpo"  # (r - group mean) / (group std + eps)
    DR_GRPO = "dr-grpo"  # r - group mean
    RLOO = "rloo"  # r - mean of the other samples of the group
    REINFORCE_PP = "reinforce++"  # batch-normalised returns
    REINFORCE_PP_BASELINE = "reinforce++-baseline"  # group mean subtracted, then batch-normalised
    GAE = "gae"  # token-level, from a critic's values


def _groups(rewards: Float[Array, " b"], group_size: int, where: str) -> Float[Array, "n g"]:
    if rewards.ndim != 1:
        raise ValueError(f"{where}: rewards must be one value per sequence [b], got shape {rewards.shape}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{where}: group_size must be a positive integer, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"{where}: {rewards.shape[0]} rewards do not split into groups of group_size={group_size} "
            "(rows must be group-contiguous, G samples per prompt)"
        )
    return rewards.astype(jnp.float32).reshape(-1, group_size)


def _group_metrics(groups: Float[Array, "n g"]) -> Metrics:
    spread = jnp.max(groups, axis=1) - jnp.min(groups, axis=1)
    return {
        "reward_mean": jnp.mean(groups),
        "reward_std": jnp.std(groups),
        # groups whose samples all scored the same carry no GRPO signal (DAPO filters them)
        "zero_variance_group_fraction": jnp.mean((spread == 0).astype(jnp.float32)),
    }


def grpo_advantages(
    rewards: Float[Array, " b"], group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[Float[Array, " b"], Metrics]:
    """GRPO: A_i = (r_i - mean_g r) / (std_g r + eps), with std over the group's G samples using the
    n-1 (Bessel) denominator, as verl and TRL do. `scale_by_std=False` gives Dr.GRPO: A_i = r_i - mean_g r.

    Needs G >= 2 when scaling by the standard deviation.
    """
    groups = _groups(rewards, group_size, "grpo_advantages")
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if scale_by_std:
        if group_size < 2:
            raise ValueError("grpo_advantages: scale_by_std needs group_size >= 2 (std with n-1 denominator)")
        std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - 1))
        centred = centred / (std + eps)
    return centred.reshape(-1), _group_metrics(groups)


def rloo_advantages(rewards: Float[Array, " b"], group_size: int) -> tuple[Float[Array, " b"], Metrics]:
    """RLOO: A_i = r_i - (sum_g r - r_i) / (G - 1), the leave-one-out baseline; needs G >= 2."""
    groups = _groups(rewards, group_size, "rloo_advantages")
    if group_size < 2:
        raise ValueError("rloo_advantages: the leave-one-out baseline needs group_size >= 2")
    others = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1), _group_metrics(groups)


def whiten(
    values: Float[Array, "*shape"], mask: Bool[Array, "*shape"] | None = None, *, eps: float = 1e-8
) -> Float[Array, "*shape"]:
    """(x - mean) / sqrt(var + eps) over the entries where `mask` holds (all when None).

    var is the unbiased (n-1) masked variance, as verl's `masked_whiten`; masked-out entries become 0.
    """
    values = values.astype(jnp.float32)
    weights = jnp.ones_like(values) if mask is None else mask.astype(jnp.float32)
    count = jnp.sum(weights)
    mean = jnp.sum(values * weights) / jnp.maximum(count, 1.0)
    var = jnp.sum(((values - mean) ** 2) * weights) / jnp.maximum(count - 1.0, 1.0)
    return (values - mean) * jax.lax.rsqrt(var + eps) * weights


def discounted_returns(
    token_rewards: Float[Array, "b t"], mask: Bool[Array, "b t"], gamma: float
) -> Float[Array, "b t"]:
    """G_t = sum_{t' >= t, mask} gamma^(number of masked tokens between t and t') r_t' over the masked
    tokens of each row; padding is skipped (it neither adds reward nor discounts), masked-out entries are 0."""
    m = mask.astype(jnp.float32)

    def step(carry, inputs):
        reward, valid = inputs
        value = reward * valid + gamma * carry
        carry = jnp.where(valid > 0, value, carry)
        return carry, value * valid

    _, returns = jax.lax.scan(step, jnp.zeros(token_rewards.shape[0], jnp.float32),
                              (token_rewards.astype(jnp.float32).T, m.T), reverse=True)
    return returns.T


def reinforce_pp_advantages(
    rewards: Float[Array, " b"] | Float[Array, "b t"],
    mask: Bool[Array, "b t"] | None = None,
    *,
    group_baseline: int | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Float[Array, " b"] | Float[Array, "b t"], Metrics]:
    """REINFORCE++: returns normalised over the whole batch (no critic, no group std).

    * rewards [b] (outcome) without mask: A = whiten(r) over the b sequences, returned [b];
    * rewards [b] with mask [b, t]: r_i is placed on row i's last masked token and discounted back
      (with gamma = 1 every response token gets return r_i), then whitened over all masked tokens of
      the batch (token-weighted statistics, as verl), returned [b, t];
    * rewards [b, t] (token-level, e.g. outcome at the last token minus a per-token KL penalty) with
      mask: G_t = discounted return (`gamma`) over masked tokens, then whitened, returned [b, t].

    `group_baseline=G` (REINFORCE++-baseline) first subtracts each group's mean outcome reward
    (outcome rewards only). whiten(x) = (x - mean) / sqrt(var_{n-1} + eps).
    """
    if rewards.ndim == 2:
        if mask is None:
            raise ValueError("reinforce_pp_advantages: token-level rewards [b, t] need a mask [b, t]")
        if group_baseline is not None:
            raise ValueError("reinforce_pp_advantages: group_baseline needs outcome rewards [b], got token-level [b, t]")
        if mask.shape != rewards.shape:
            raise ValueError(f"reinforce_pp_advantages: mask {mask.shape} does not match rewards {rewards.shape}")
        returns = discounted_returns(rewards, mask, gamma)
        metrics = {"reward_mean": jnp.sum(rewards * mask) / jnp.maximum(jnp.sum(jnp.any(mask, -1)), 1)}
        return whiten(returns, mask, eps=eps), metrics
    if rewards.ndim != 1:
        raise ValueError(f"reinforce_pp_advantages: rewards must be [b] or [b, t], got shape {rewards.shape}")
    scores = rewards.astype(jnp.float32)
    metrics = {"reward_mean": jnp.mean(scores), "reward_std": jnp.std(scores)}
    if group_baseline is not None:
        groups = _groups(scores, group_baseline, "reinforce_pp_advantages")
        scores = (groups - jnp.mean(groups, axis=1, keepdims=True)).reshape(-1)
        metrics.update(_group_metrics(groups))
    if mask is None:
        return whiten(scores, eps=eps), metrics
    if mask.ndim != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"reinforce_pp_advantages: mask must be [b, t] with b={scores.shape[0]}, got {mask.shape}")
    returns = discounted_returns(outcome_token_rewards(scores, mask), mask, gamma)
    return whiten(returns, mask, eps=eps), metrics


def gae(
    rewards: Float[Array, "b t"],
    values: Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    gamma: float,
    lam: float,
) -> tuple[tuple[Float[Array, "b t"], Float[Array, "b t"]], Metrics]:
    """Generalised advantage estimation over the masked tokens of each row; returns ((A, R), metrics).

    With t+ the next masked token after t (none after the last one: the episode ends, V = 0 there):
        delta_t = r_t + gamma * V_{t+} - V_t,   A_t = delta_t + gamma * lam * A_{t+},   R_t = A_t + V_t.
    Padding (mask False) anywhere in a row is skipped: it neither carries reward nor breaks the
    recursion. A and R are 0 at masked-out positions.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.ndim != 2:
        raise ValueError(f"gae: rewards {rewards.shape}, values {values.shape} and mask {mask.shape} must all be [b, t]")
    m = mask.astype(jnp.float32)

    def step(carry, inputs):
        next_value, next_advantage = carry
        reward, value, valid = inputs
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        carry = (jnp.where(valid > 0, value, next_value), jnp.where(valid > 0, advantage, next_advantage))
        return carry, advantage * valid

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, advantages = jax.lax.scan(
        step, (zeros, zeros), (rewards.astype(jnp.float32).T, values.astype(jnp.float32).T, m.T), reverse=True
    )
    advantages = advantages.T
    returns = (advantages + values) * m
    count = jnp.maximum(jnp.sum(m), 1.0)
    metrics = {"advantage_mean": jnp.sum(advantages) / count, "return_mean": jnp.sum(returns) / count}
    return (advantages, returns), metrics


def outcome_token_rewards(rewards: Float[Array, " b"], mask: Bool[Array, "b t"]) -> Float[Array, "b t"]:
    """Places each sequence's outcome reward on its last masked (response) token; zeros elsewhere."""
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1], axis=1)
    has_token = jnp.any(mask, axis=1)
    onehot = (jnp.arange(t)[None, :] == last[:, None]) & has_token[:, None]
    return onehot.astype(jnp.float32) * rewards.astype(jnp.float32)[:, None]


def _grpo(rewards, *, group_size, eps, **_):
    return grpo_advantages(rewards, group_size, scale_by_std=True, eps=eps)


def _dr_grpo(rewards, *, group_size, eps, **_):
    return grpo_advantages(rewards, group_size, scale_by_std=False, eps=eps)


def _rloo(rewards, *, group_size, **_):
    return rloo_advantages(rewards, group_size)


def _reinforce_pp(rewards, *, mask, gamma, **_):
    return reinforce_pp_advantages(rewards, mask, gamma=gamma)


def _reinforce_pp_baseline(rewards, *, group_size, mask, gamma, **_):
    return reinforce_pp_advantages(rewards, mask, group_baseline=group_size, gamma=gamma)


def _gae(rewards, *, mask, values, gamma, lam, **_):
    if values is None or mask is None:
        raise ValueError("compute_advantages(gae): needs values [b, t] and mask [b, t]")
    token_rewards = rewards if rewards.ndim == 2 else outcome_token_rewards(rewards, mask)
    (advantages, _), metrics = gae(token_rewards, values, mask, gamma, lam)
    return advantages, metrics


_ADVANTAGES: dict[AdvantageKind, Callable[..., tuple[Array, Metrics]]] = {
    AdvantageKind.GRPO: _grpo,
    AdvantageKind.DR_GRPO: _dr_grpo,
    AdvantageKind.RLOO: _rloo,
    AdvantageKind.REINFORCE_PP: _reinforce_pp,
    AdvantageKind.REINFORCE_PP_BASELINE: _reinforce_pp_baseline,
    AdvantageKind.GAE: _gae,
}


def compute_advantages(
    kind: AdvantageKind | str,
    rewards: Float[Array, " b"] | Float[Array, "b t"],
    *,
    group_size: int = 1,
    mask: Bool[Array, "b t"] | None = None,
    values: Float[Array, "b t"] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
) -> tuple[Float[Array, " b"] | Float[Array, "b t"], Metrics]:
    """Dispatches on `kind`; returns (advantages, metrics).

    GRPO/Dr.GRPO/RLOO give [b]; REINFORCE++ gives [b, t] when `mask` is given; GAE gives [b, t]
    and needs `values` and `mask` (outcome rewards [b] are placed on each row's last masked token;
    its returns are advantages + values, see `gae`).
    """
    try:
        kind = AdvantageKind(kind)
    except ValueError:
        raise ValueError(f"compute_advantages: unknown kind {kind!r}; known: {[k.value for k in AdvantageKind]}") from None
    options: dict[str, Any] = dict(group_size=group_size, mask=mask, values=values, gamma=gamma, lam=lam, eps=eps)
    return _ADVANTAGES[kind](rewards, **options)
