"""Policy, value, KL and entropy losses for PPO-family learners (PPO, GRPO, DAPO, Dr.GRPO, GSPO, decoupled PPO).

Every loss is a pure function of per-token arrays `[b, t]` aligned with `TrainBatch.tokens` and a mask
of the tokens that count (the response tokens), returning `(loss, metrics)`. Masked-out entries may
hold anything (even inf): they are replaced before any arithmetic.

Aggregation (`LossAggregation`) of a per-token loss L with mask m, n_i = sum_t m_it tokens in row i,
and S the rows with n_i > 0:
    token-mean               sum_it m L / sum_it m
    seq-mean-token-mean      (1/|S|) sum_{i in S} (sum_t m L) / n_i
    seq-mean-token-sum-norm  (1/|S|) sum_{i in S} (sum_t m L) / max_length        (Dr.GRPO)
The outer denominator (sum m, or |S|) may be passed as `denominator`: a learner that splits a
mini-batch into micro-batches passes the whole mini-batch's count, so that the micro-batch losses
(and their gradients) sum exactly to the mini-batch loss.

Packed rows (`segment_ids`, `rpegjax.learners.sequences`): "row i" above reads "sequence i", each segment of
a row being one; the sequence-level terms of every loss here take `segment_ids` and equal the unpacked ones.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rpegjax.learners.sequences import sequence_sums, to_tokens

Metrics = dict[str, Array]
Scalar = Float[Array, ""]
SegmentIds = Int[Array, "b t"] | None


class LossAggregation(enum.StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class KLKind(enum.StrEnum):
    K1 = "k1"  # log p - log q
    K2 = "k2"  # (log p - log q)^2 / 2
    K3 = "k3"  # exp(log q - log p) - (log q - log p) - 1


def _aggregation(aggregation: LossAggregation | str) -> LossAggregation:
    try:
        return LossAggregation(aggregation)
    except ValueError:
        raise ValueError(
            f"unknown loss aggregation {aggregation!r}; known: {[a.value for a in LossAggregation]}"
        ) from None


def aggregation_denominator(mask: Bool[Array, "b t"], aggregation: LossAggregation | str,
                            segment_ids: SegmentIds = None) -> Scalar:
    """The outer denominator of `aggregation` over `mask`: the token count (token-mean) or the number
    of sequences (rows, or segments of packed rows) with at least one token (seq-mean-*)."""
    m = mask.astype(jnp.float32)
    if _aggregation(aggregation) == LossAggregation.TOKEN_MEAN:
        return jnp.sum(m)
    return jnp.sum((sequence_sums(m, segment_ids) > 0).astype(jnp.float32))


def aggregate(
    values: Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    *,
    max_length: int | None = None,
    denominator: Scalar | float | None = None,
    segment_ids: SegmentIds = None,
) -> Scalar:
    """Reduces per-token `values` over `mask` as the module docstring says; `max_length` defaults to t."""
    aggregation = _aggregation(aggregation)
    if values.shape != mask.shape or values.ndim != 2:
        raise ValueError(f"aggregate: values {values.shape} and mask {mask.shape} must both be [b, t]")
    m = mask.astype(jnp.float32)
    masked = jnp.where(mask, values, 0.0).astype(jnp.float32)
    if denominator is None:
        denominator = aggregation_denominator(mask, aggregation, segment_ids)
    denominator = jnp.maximum(jnp.asarray(denominator, jnp.float32), 1.0)
    if aggregation == LossAggregation.TOKEN_MEAN:
        return jnp.sum(masked) / denominator
    row_sums = sequence_sums(masked, segment_ids)
    if aggregation == LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        row_losses = row_sums / jnp.maximum(sequence_sums(m, segment_ids), 1.0)
    else:
        length = values.shape[1] if max_length is None else max_length
        if length <= 0:
            raise ValueError(f"aggregate: max_length must be positive, got {max_length!r}")
        row_losses = row_sums / length
    return jnp.sum(row_losses) / denominator


def _masked_mean(values: Array, mask: Bool[Array, "b t"]) -> Scalar:
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, values, 0.0) * m) / jnp.maximum(jnp.sum(m), 1.0)


def _token_advantages(advantages: Array, mask: Bool[Array, "b t"], where: str) -> Float[Array, "b t"]:
    if advantages.ndim == 1 and advantages.shape[0] == mask.shape[0]:
        return jnp.broadcast_to(advantages.astype(jnp.float32)[:, None], mask.shape)
    if advantages.shape == mask.shape:
        return advantages.astype(jnp.float32)
    raise ValueError(f"{where}: advantages must be [b] or [b, t] matching mask {mask.shape}, got {advantages.shape}")


def _check_shapes(where: str, mask: Bool[Array, "b t"], **arrays: Array | None) -> None:
    for name, array in arrays.items():
        if array is not None and array.shape != mask.shape:
            raise ValueError(f"{where}: {name} has shape {array.shape}, expected {mask.shape} like mask")


def _token_weights(weights: Float[Array, "b t"] | None, mask: Bool[Array, "b t"]) -> Float[Array, "b t"]:
    """Per-token loss weights (1 without any), never differentiated."""
    if weights is None:
        return jnp.ones(mask.shape, jnp.float32)
    return jax.lax.stop_gradient(jnp.where(mask, weights, 0.0).astype(jnp.float32))


def _clipped_surrogate(
    ratio: Float[Array, "b t"],
    advantages: Float[Array, "b t"],
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"], Float[Array, "b t"]]:
    """Per-token max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), dual-clipped at -A c when A < 0.

    Returns (loss, clipped, dual_clipped) with the two indicator arrays as float 0/1.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).astype(jnp.float32)
    if dual_clip is None:
        return loss, was_clipped, jnp.zeros_like(loss)
    bound = -advantages * dual_clip
    dual = (advantages < 0) & (loss > bound)
    return jnp.where(dual, bound, loss), was_clipped, dual.astype(jnp.float32)


def _check_clip(where: str, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0 <= clip_low < 1:
        raise ValueError(f"{where}: clip_low must be in [0, 1), got {clip_low!r}")
    if clip_high < 0:
        raise ValueError(f"{where}: clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"{where}: dual_clip must be > 1 (it bounds -A*ratio at -A*dual_clip for A < 0), got {dual_clip!r}")


def _ratio_metrics(ratio: Float[Array, "b t"], log_ratio: Float[Array, "b t"], mask: Bool[Array, "b t"]) -> Metrics:
    return {
        # k3 estimate of KL(pi_old || pi_theta): E_old[(r - 1) - log r]
        "approx_kl": _masked_mean((ratio - 1.0) - log_ratio, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": jnp.max(jnp.where(mask, ratio, -jnp.inf)),
        "ratio_min": jnp.min(jnp.where(mask, ratio, jnp.inf)),
    }


def policy_loss(
    logprobs: Float[Array, "b t"],
    old_logprobs: Float[Array, "b t"],
    advantages: Float[Array, " b"] | Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_length: int | None = None,
    weights: Float[Array, "b t"] | None = None,
    denominator: Scalar | float | None = None,
    segment_ids: SegmentIds = None,
) -> tuple[Scalar, Metrics]:
    """PPO clipped surrogate with asymmetric (DAPO clip-higher) and dual clipping; decoupled PPO.

    Per token, with r = exp(log pi_theta - log pi_old) and A the (broadcast) advantage:
        L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        L = min(L, -A c)   where A < 0, when dual_clip = c > 1 (bounds the loss of very large ratios)
    and the loss is aggregate(L) (see module docstring).

    Decoupled PPO (AReaL, bounded asynchrony): `old_logprobs` is the *proximal* policy pi_prox (recomputed
    with recent weights), the clip acts on r = pi_theta / pi_prox, and each token's loss is multiplied by
    `weights` w, a rollout correction computed from pi_prox and the sampler's behaviour policy
    (`rpegjax.learners.corrections`, e.g. token TIS w = min(pi_prox / pi_behav, C)), never differentiated:
        L_decoupled = w * L
    so the objective is E_{pi_behav}[w * clipped surrogate] = E_{pi_prox}[clipped surrogate] up to the
    truncation or masking, which bounds the variance a stale or mismatched sample can add.

    Metrics: clip_fraction (tokens whose clipped term is active), clip_low_fraction / clip_high_fraction,
    dual_clip_fraction, approx_kl (k3 estimate of KL(pi_old || pi_theta)), ratio mean/max/min.
    """
    _check_clip("policy_loss", clip_low, clip_high, dual_clip)
    _check_shapes("policy_loss", mask, logprobs=logprobs, old_logprobs=old_logprobs, weights=weights)
    adv = _token_advantages(advantages, mask, "policy_loss")
    log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    token_loss, clipped, dual = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    loss = aggregate(token_loss * _token_weights(weights, mask), mask, aggregation, max_length=max_length,
                     denominator=denominator, segment_ids=segment_ids)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics.update(
        policy_loss=loss,
        clip_fraction=_masked_mean(clipped, mask),
        clip_low_fraction=_masked_mean(((ratio < 1.0 - clip_low) & (adv < 0)).astype(jnp.float32), mask),
        clip_high_fraction=_masked_mean(((ratio > 1.0 + clip_high) & (adv > 0)).astype(jnp.float32), mask),
        dual_clip_fraction=_masked_mean(dual, mask),
    )
    return loss, metrics


def gspo_loss(
    logprobs: Float[Array, "b t"],
    old_logprobs: Float[Array, "b t"],
    advantages: Float[Array, " b"] | Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    weights: Float[Array, "b t"] | None = None,
    denominator: Scalar | float | None = None,
    segment_ids: SegmentIds = None,
) -> tuple[Scalar, Metrics]:
    """GSPO: a sequence-level importance ratio, clipped per sequence (default clip range from the paper).

        s_i = exp((1/n_i) sum_t m_it (log pi_theta - log pi_old))      (geometric mean of token ratios)
        L_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)),   loss = (1/|S|) sum_i L_i

    Implemented in the GSPO-token form s_it = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)), whose value
    is s_i and whose gradient is s_i * grad log pi_theta(y_t); with the seq-mean-token-mean aggregation
    this has exactly the value and gradient of the sequence-level loss above for advantages [b], and it
    also accepts token-level advantages [b, t]. `weights` multiply tokens' losses as in `policy_loss`
    (decoupled PPO). Metrics: clip_fraction is the fraction of clipped sequences.
    """
    _check_clip("gspo_loss", clip_low, clip_high, None)
    _check_shapes("gspo_loss", mask, logprobs=logprobs, old_logprobs=old_logprobs, weights=weights)
    adv = _token_advantages(advantages, mask, "gspo_loss")
    m = mask.astype(jnp.float32)
    token_counts = sequence_sums(m, segment_ids)  # [b, s]: per sequence (module docstring)
    token_log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
    sequence_log_ratio = sequence_sums(token_log_ratio, segment_ids) / jnp.maximum(token_counts, 1.0)
    safe_logprobs = jnp.where(mask, logprobs, 0.0)
    log_ratio = (jax.lax.stop_gradient(to_tokens(sequence_log_ratio, segment_ids, mask.shape)) + safe_logprobs
                 - jax.lax.stop_gradient(safe_logprobs))
    ratio = jnp.exp(log_ratio)
    token_loss, clipped, _ = _clipped_surrogate(ratio, adv, clip_low, clip_high, None)
    loss = aggregate(token_loss * _token_weights(weights, mask), mask, LossAggregation.SEQ_MEAN_TOKEN_MEAN,
                     denominator=denominator, segment_ids=segment_ids)
    has_tokens = token_counts > 0
    sequence_ratio = jnp.exp(sequence_log_ratio)
    rows = jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)
    clipped_rows = (sequence_sums(clipped * m, segment_ids) > 0) & has_tokens
    metrics = dict(
        policy_loss=loss,
        clip_fraction=jnp.sum(clipped_rows.astype(jnp.float32)) / rows,
        approx_kl=_masked_mean(jnp.exp(token_log_ratio) - 1.0 - token_log_ratio, mask),
        ratio_mean=jnp.sum(jnp.where(has_tokens, sequence_ratio, 0.0)) / rows,
        ratio_max=jnp.max(jnp.where(has_tokens, sequence_ratio, -jnp.inf)),
        ratio_min=jnp.min(jnp.where(has_tokens, sequence_ratio, jnp.inf)),
    )
    return loss, metrics


def kl_penalty(
    logprobs: Float[Array, "b t"],
    ref_logprobs: Float[Array, "b t"],
    kind: KLKind | str = KLKind.K3,
    mask: Bool[Array, "b t"] | None = None,
) -> tuple[Float[Array, "b t"], Metrics]:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta, with d = log p - log q:
        k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) + d - 1  (= exp(log q - log p) - (log q - log p) - 1).
    k1 is unbiased but can be negative; k3 is unbiased and >= 0 (Schulman's estimator); k2's gradient
    is the gradient of KL itself. Returns ([b, t] values, 0 where `mask` is False; metrics with their
    masked mean when a mask is given). Use in the loss via `aggregate`, or subtract coef * kl from rewards.
    """
    try:
        kind = KLKind(kind)
    except ValueError:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; known: {[k.value for k in KLKind]}") from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"kl_penalty: logprobs {logprobs.shape} and ref_logprobs {ref_logprobs.shape} differ in shape")
    d = logprobs - ref_logprobs
    if mask is not None:
        _check_shapes("kl_penalty", mask, logprobs=logprobs)
        d = jnp.where(mask, d, 0.0)
    estimators = {KLKind.K1: lambda x: x, KLKind.K2: lambda x: 0.5 * x * x, KLKind.K3: lambda x: jnp.exp(-x) + x - 1.0}
    kl = estimators[kind](d)
    metrics = {} if mask is None else {"kl": _masked_mean(kl, mask)}
    return kl, metrics


def value_loss(
    values: Float[Array, "b t"],
    old_values: Float[Array, "b t"],
    returns: Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    *,
    clip: float | None = 0.2,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_length: int | None = None,
    denominator: Scalar | float | None = None,
    segment_ids: SegmentIds = None,
) -> tuple[Scalar, Metrics]:
    """Clipped value loss (PPO): per token
        L = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)     (c = `clip`; None: 1/2 (V - R)^2)
    aggregated as `aggregation`. Metrics: value_clip_fraction (clipped term active), value_mean, value_error.
    """
    _check_shapes("value_loss", mask, values=values, old_values=old_values, returns=returns)
    if clip is not None and clip <= 0:
        raise ValueError(f"value_loss: clip must be positive or None, got {clip!r}")
    values = jnp.where(mask, values, 0.0)
    returns = jnp.where(mask, returns, 0.0)
    unclipped = (values - returns) ** 2
    if clip is None:
        token_loss, clipped = 0.5 * unclipped, jnp.zeros_like(unclipped)
    else:
        old_values = jnp.where(mask, old_values, 0.0)
        clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
        clipped_error = (clipped_values - returns) ** 2
        token_loss = 0.5 * jnp.maximum(unclipped, clipped_error)
        clipped = (clipped_error > unclipped).astype(jnp.float32)
    loss = aggregate(token_loss, mask, aggregation, max_length=max_length, denominator=denominator,
                     segment_ids=segment_ids)
    return loss, {
        "value_loss": loss,
        "value_clip_fraction": _masked_mean(clipped, mask),
        "value_mean": _masked_mean(values, mask),
        "value_error": _masked_mean(jnp.abs(values - returns), mask),
    }


def entropy_bonus(
    entropy: Float[Array, "b t"],
    mask: Bool[Array, "b t"],
    *,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_length: int | None = None,
    denominator: Scalar | float | None = None,
    segment_ids: SegmentIds = None,
) -> tuple[Scalar, Metrics]:
    """Entropy bonus: loss = -aggregate(H), H_t = -sum_v p log p per token; add coef * loss to the total
    (minimising it raises entropy). Metrics: entropy (the aggregated H)."""
    _check_shapes("entropy_bonus", mask, entropy=entropy)
    value = aggregate(entropy, mask, aggregation, max_length=max_length, denominator=denominator,
                      segment_ids=segment_ids)
    return -value, {"entropy": value}
