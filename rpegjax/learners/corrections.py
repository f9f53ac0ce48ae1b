"""Train/rollout mismatch corrections: per-token loss weights from the sampler's and the trainer's log-probs.

The sampler (behaviour policy mu, `TrainBatch.behaviour_logprobs`) and the training forward of the same weights
(pi_old, `TrainBatch.old_logprobs`: the old-log-prob pass) disagree: different kernels, precisions and, with an
asynchrony bound k > 0, weights up to k versions older. With the per-token ratio

    rho_t = pi_old(y_t) / mu(y_t) = exp(log pi_old - log mu)

each correction turns rho into a weight w_t >= 0 that multiplies the token's (clipped) policy loss, never
differentiated (decoupled PPO, Hilton et al. 2021, arXiv:2110.00641: L = w_t * max(-A r_t, -A clip(r_t)) with
r_t = pi_theta / pi_old). T_i is the set of response tokens of row i, n_i = |T_i|:

    token-tis       w_t = min(rho_t, C)                                                 (C = None: no truncation)
    sequence-tis    w_t = min(prod_{s in T_i} rho_s, C) = exp(min(sum_s log rho_s, log C))      for t in T_i
    icepop          w_t = rho_t * 1[alpha <= rho_t <= beta]
    geometric-mask  w_t = 1[low <= exp((1/n_i) sum_{s in T_i} log rho_s) <= high]             for t in T_i
    none            w_t = 1                                                    (the mismatch is only logged)

Sources: token TIS is Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(Aug 2025), and verl's rollout correction `rollout_is="token"` (typical C 1.5 to 5); sequence TIS is verl's
`rollout_is="sequence"` (docs/algo/rollout_corr_math.md, section 3.3.2: the product in log space, truncated at
C); IcePop is the Ling team's "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop!" (2025,
used for Ring-1T, arXiv:2510.18855): the masking function M(k) = k for k in [alpha, beta], else 0, with
[alpha, beta] = [0.5, 5]; the geometric mask is verl's rejection sampling `rollout_rs="geometric"` (section
3.3.3 and 3.4: accept a sequence when C_lower <= rho_geo <= C_upper; typical bounds 0.999 .. 1.001, since the
geometric mean of per-token ratios stays near 1).

Every function is pure, of [b, t] arrays and floats, and returns `(weights [b, t], metrics)`; weights are 0 off
`mask`. Metrics (fractions of response tokens, over this batch): `correction/weight_mean`, and
`correction/truncated_fraction` (TIS: tokens whose weight the cap lowered) or `correction/masked_fraction`
(IcePop, geometric mask: tokens given weight 0). `mismatch_metrics` gives the mismatch itself.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rpegjax.learners.sequences import sequence_sums, to_tokens

Metrics = dict[str, Array]
Weights = Float[Array, "b t"]


class CorrectionKind(enum.StrEnum):
    NONE = "none"
    TOKEN_TIS = "token-tis"
    SEQUENCE_TIS = "sequence-tis"
    ICEPOP = "icepop"
    GEOMETRIC_MASK = "geometric-mask"


def _fraction(flags: Bool[Array, "b t"], mask: Bool[Array, "b t"]) -> Array:
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, flags, False).astype(jnp.float32)) / jnp.maximum(jnp.sum(m), 1.0)


def _log_ratio(old_logprobs: Float[Array, "b t"], behaviour_logprobs: Float[Array, "b t"],
               mask: Bool[Array, "b t"]) -> Float[Array, "b t"]:
    """log rho = log pi_old - log mu on `mask` (0 elsewhere: padding may hold anything), without gradient."""
    if old_logprobs.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
        raise ValueError(f"rollout correction: old_logprobs {old_logprobs.shape} and behaviour_logprobs "
                         f"{behaviour_logprobs.shape} must both match mask {mask.shape}")
    return jax.lax.stop_gradient(jnp.where(mask, old_logprobs - behaviour_logprobs, 0.0).astype(jnp.float32))


def _sequence_log_ratio(log_ratio: Float[Array, "b t"], mask: Bool[Array, "b t"], segment_ids: Int[Array, "b t"] | None,
                        *, mean: bool) -> Float[Array, "b t"]:
    """Each token's sequence's summed (or mean) log-ratio; sequences are rows or packed segments
    (`rpegjax.learners.sequences`)."""
    total = sequence_sums(log_ratio, segment_ids)
    if mean:
        total = total / jnp.maximum(sequence_sums(mask.astype(jnp.float32), segment_ids), 1.0)
    return to_tokens(total, segment_ids, mask.shape)


def _weighted(weights: Weights, mask: Bool[Array, "b t"], metrics: Metrics) -> tuple[Weights, Metrics]:
    weights = jnp.where(mask, weights, 0.0)
    return weights, {"correction/weight_mean": jnp.sum(weights) / jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0),
                     **metrics}


def _check_band(where: str, low: float, high: float) -> None:
    if not 0 < low <= high:
        raise ValueError(f"{where}: the accepted band needs 0 < low <= high, got low={low!r}, high={high!r}")


def token_tis_weights(old_logprobs: Float[Array, "b t"], behaviour_logprobs: Float[Array, "b t"],
                      mask: Bool[Array, "b t"], *, cap: float | None) -> tuple[Weights, Metrics]:
    """Token-level truncated importance sampling: w_t = min(rho_t, cap) (cap None: rho_t, decoupled PPO's plain
    weight)."""
    if cap is not None and not cap > 0:
        raise ValueError(f"token_tis_weights: cap must be positive or None, got {cap!r}")
    log_ratio = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    if cap is None:
        return _weighted(jnp.exp(log_ratio), mask, {"correction/truncated_fraction": jnp.zeros((), jnp.float32)})
    truncated = log_ratio > math.log(cap)
    weights = jnp.exp(jnp.minimum(log_ratio, math.log(cap)))
    return _weighted(weights, mask, {"correction/truncated_fraction": _fraction(truncated, mask)})


def sequence_tis_weights(old_logprobs: Float[Array, "b t"], behaviour_logprobs: Float[Array, "b t"],
                         mask: Bool[Array, "b t"], *, cap: float, segment_ids: Int[Array, "b t"] | None = None
                         ) -> tuple[Weights, Metrics]:
    """Sequence-level truncated importance sampling: every token of row i weighs min(prod_t rho_t, cap), the
    product taken as exp of the summed log-ratios (no overflow for long rows)."""
    if not cap > 0:
        raise ValueError(f"sequence_tis_weights: cap must be positive, got {cap!r}")
    log_ratio = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    row = _sequence_log_ratio(log_ratio, mask, segment_ids, mean=False)
    truncated = row > math.log(cap)
    weights = jnp.exp(jnp.minimum(row, math.log(cap)))
    return _weighted(weights, mask, {"correction/truncated_fraction": _fraction(truncated, mask)})


def icepop_weights(old_logprobs: Float[Array, "b t"], behaviour_logprobs: Float[Array, "b t"],
                   mask: Bool[Array, "b t"], *, low: float = 0.5, high: float = 5.0) -> tuple[Weights, Metrics]:
    """IcePop: w_t = rho_t where low <= rho_t <= high, else 0 (tokens the two engines disagree on drop out)."""
    _check_band("icepop_weights", low, high)
    log_ratio = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    accepted = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    weights = jnp.where(accepted, jnp.exp(log_ratio), 0.0)
    return _weighted(weights, mask, {"correction/masked_fraction": _fraction(~accepted, mask)})


def geometric_mask_weights(old_logprobs: Float[Array, "b t"], behaviour_logprobs: Float[Array, "b t"],
                           mask: Bool[Array, "b t"], *, low: float = 0.999, high: float = 1.001,
                           segment_ids: Int[Array, "b t"] | None = None) -> tuple[Weights, Metrics]:
    """Geometric-mean sequence mask: row i keeps weight 1 when low <= exp(mean_t log rho_t) <= high, else 0."""
    _check_band("geometric_mask_weights", low, high)
    log_ratio = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    mean = _sequence_log_ratio(log_ratio, mask, segment_ids, mean=True)
    accepted = (mean >= math.log(low)) & (mean <= math.log(high))
    return _weighted(accepted.astype(jnp.float32), mask, {"correction/masked_fraction": _fraction(~accepted, mask)})


def correction_weights(kind: CorrectionKind | str, old_logprobs: Float[Array, "b t"],
                       behaviour_logprobs: Float[Array, "b t"], mask: Bool[Array, "b t"], *,
                       cap: float | None = None, band: tuple[float, float] | None = None,
                       segment_ids: Int[Array, "b t"] | None = None) -> tuple[Weights, Metrics]:
    """The weights of correction `kind` (module docstring): `cap` is C of the TIS kinds, `band` (low, high) the
    accepted ratios of icepop / geometric-mask (None: the published defaults); `segment_ids`: packed rows' sequences
    for the sequence-level kinds."""
    try:
        kind = CorrectionKind(kind)
    except ValueError:
        raise ValueError(f"unknown rollout correction {kind!r}; known: {[k.value for k in CorrectionKind]}") from None
    bounds = {} if band is None else dict(low=band[0], high=band[1])
    corrections = {
        CorrectionKind.NONE: lambda: _weighted(jnp.ones(mask.shape, jnp.float32), mask, {}),
        CorrectionKind.TOKEN_TIS: lambda: token_tis_weights(old_logprobs, behaviour_logprobs, mask, cap=cap),
        CorrectionKind.SEQUENCE_TIS: lambda: sequence_tis_weights(old_logprobs, behaviour_logprobs, mask, cap=cap,
                                                                  segment_ids=segment_ids),
        CorrectionKind.ICEPOP: lambda: icepop_weights(old_logprobs, behaviour_logprobs, mask, **bounds),
        CorrectionKind.GEOMETRIC_MASK: lambda: geometric_mask_weights(old_logprobs, behaviour_logprobs, mask, **bounds,
                                                                      segment_ids=segment_ids),
    }
    if kind == CorrectionKind.SEQUENCE_TIS and cap is None:
        raise ValueError("correction 'sequence-tis' needs a cap: the untruncated product of ratios over a long row "
                         "overflows")
    return corrections[kind]()


def mismatch_metrics(train_logprobs: Float[Array, "b t"], behaviour_logprobs: Float[Array, "b t"],
                     mask: Bool[Array, "b t"]) -> Metrics:
    """How far the sampler's log-probs are from a training forward's under the same weights, over response tokens.
    With d_t = log mu(y_t) - log pi_train(y_t) (tokens sampled from mu):

        mismatch/kl_k1               mean_t d_t                          (KL(mu || pi_train), unbiased, may be < 0)
        mismatch/kl_k3               mean_t (exp(-d_t) - 1 + d_t)        (KL(mu || pi_train), unbiased, >= 0)
        mismatch/abs_logprob_diff_max  max_t |d_t|
        mismatch/abs_logprob_diff_mean mean_t |d_t|
    """
    d = -_log_ratio(train_logprobs, behaviour_logprobs, mask)
    m = mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(m), 1.0)
    return {
        "mismatch/kl_k1": jnp.sum(d) / count,
        "mismatch/kl_k3": jnp.sum(jnp.where(mask, jnp.exp(-d) - 1.0 + d, 0.0)) / count,
        "mismatch/abs_logprob_diff_max": jnp.max(jnp.where(mask, jnp.abs(d), 0.0)),
        "mismatch/abs_logprob_diff_mean": jnp.sum(jnp.abs(d)) / count,
    }
