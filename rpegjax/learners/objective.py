"""The policy objective shared by the GRPO and PPO learners, and its configuration section.

    loss = policy loss (PPO clipped surrogate, or GSPO)  +  kl_coef * aggregate(KL(pi_theta || pi_ref))
           +  entropy_coef * (-aggregate(entropy))

Its metrics include `entropy`, the policy's mean per-token entropy over response tokens, whatever entropy_coef is
(never differentiated).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.corrections import CorrectionKind, correction_weights, mismatch_metrics
from rpegjax.learners.inference import InferenceMicroBatching
from rpegjax.learners.lengths import bucket_length, longest_row, trim_batch
from rpegjax.learners.losses import (
    KLKind,
    LossAggregation,
    aggregate,
    aggregation_denominator,
    entropy_bonus,
    gspo_loss,
    kl_penalty,
    policy_loss,
)
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.packing import PackingPlan, abstract_packed_batch, pack_batch, plan_packing, sequence_lengths
from rpegjax.learners.update import UpdateLayout, check_rows_divide, row_shards
from rpegjax.models.config import ModelConfig

Metrics = dict[str, Array]


class PolicyLossKind(enum.StrEnum):
    PPO = "ppo"  # token-level clipped surrogate: GRPO, DAPO, Dr.GRPO, decoupled PPO
    GSPO = "gspo"  # sequence-level ratio


def _enum(cls, value, where: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{where} must be one of {[v.value for v in cls]}, got {value!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """Policy-loss, schedule and optimiser settings shared by GRPOConfig and PPOConfig.

    `decoupled=True` turns on decoupled PPO for bounded asynchrony and the train/rollout mismatch: the batch's
    `old_logprobs` are the proximal policy (the old-log-prob pass) and `behaviour_logprobs` the sampler's; each
    token's loss is weighted by the rollout `correction` of rho = pi_prox / pi_behav
    (`rpegjax.learners.corrections`): token-tis min(rho, importance_cap) (the default; importance_cap None: rho
    untruncated), sequence-tis min(prod rho, importance_cap), icepop rho inside [icepop_low, icepop_high] else 0,
    geometric-mask 0/1 per sequence by its geometric-mean rho against [geometric_low, geometric_high], or none
    (weight 1). Without it the correction options must keep their defaults and behaviour log-probs only feed the
    mismatch metrics (`mismatch/*`, logged whenever the batch has them).
    When `old_logprobs` is absent and the update takes one optimiser step, pi_old = the current policy
    (ratio 1, gradient of the plain policy gradient), which saves the old-log-prob pass.
    """

    loss: PolicyLossKind = PolicyLossKind.PPO
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    max_length: int | None = None  # the constant of seq-mean-token-sum-norm; default: the batch length
    kl_kind: KLKind = KLKind.K3
    kl_coef: float = 0.0  # KL to the reference in the loss; 0: no reference needed
    entropy_coef: float = 0.0
    decoupled: bool = False
    correction: CorrectionKind = CorrectionKind.TOKEN_TIS
    importance_cap: float | None = None  # C of token-tis / sequence-tis
    icepop_low: float = 0.5  # IcePop's published band [0.5, 5]
    icepop_high: float = 5.0
    geometric_low: float = 0.999  # verl's typical geometric rejection bounds
    geometric_high: float = 1.001
    temperature: float = 1.0  # the sampler's temperature: log-probs are of softmax(logits / temperature)
    logprob_chunk_size: int = 256
    # rows trimmed to the longest real row rounded up to a multiple of this (None: padded to the maximum);
    # see rpegjax.learners.lengths. With packing: packed rows narrowed to the multiple of this that pads the
    # fewest tokens (rpegjax.learners.packing)
    length_bucket: int | None = None
    # inference stages in row micro-batches of at most this many rows / chosen from this per-device
    # activation budget (see rpegjax.learners.inference); neither: the whole batch at once
    inference_rows: int | None = None
    inference_memory_gib: float | None = None
    # sequences packed into rows of max_tokens_per_micro_batch tokens, one row per row shard per micro-batch
    # (update and inference; see rpegjax.learners.packing); replaces num_microbatches and inference_rows
    packing: bool = False
    max_tokens_per_micro_batch: int | None = None
    epochs: int = 1
    num_minibatches: int = 1
    num_microbatches: int = 1
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    # mixture-of-experts policies (rpegjax.learners.router): weights of the load-balancing loss and the router
    # z-loss (0: off; RL recipes of Qwen3-MoE such as slime's run --moe-aux-loss-coeff 0)
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # the training forward routes every token to the experts the rollout chose (TrainBatch.expert_ids), so that
    # the trainer's and the sampler's routing agree exactly
    router_replay: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        object.__setattr__(self, "loss", _enum(PolicyLossKind, self.loss, f"{name}.loss"))
        object.__setattr__(self, "aggregation", _enum(LossAggregation, self.aggregation, f"{name}.aggregation"))
        object.__setattr__(self, "kl_kind", _enum(KLKind, self.kl_kind, f"{name}.kl_kind"))
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"{name}.clip_low must be in [0, 1), got {self.clip_low!r}")
        if self.clip_high < 0:
            raise ValueError(f"{name}.clip_high must be >= 0, got {self.clip_high!r}")
        if self.dual_clip is not None:
            if self.dual_clip <= 1:
                raise ValueError(f"{name}.dual_clip must be > 1 or None, got {self.dual_clip!r}")
            if self.loss == PolicyLossKind.GSPO:
                raise ValueError(f"{name}.dual_clip is not defined for loss='gspo'")
        if self.loss == PolicyLossKind.GSPO and self.aggregation != LossAggregation.TOKEN_MEAN:
            raise ValueError(f"{name}.aggregation: GSPO always averages over sequences; leave it at 'token-mean'")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"{name}.max_length must be positive or None, got {self.max_length!r}")
        for field in ("kl_coef", "entropy_coef", "router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, field) < 0:
                raise ValueError(f"{name}.{field} must be >= 0, got {getattr(self, field)!r}")
        self._check_correction(name)
        if self.temperature <= 0:
            raise ValueError(f"{name}.temperature must be positive, got {self.temperature!r}")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"{name}.logprob_chunk_size must be positive, got {self.logprob_chunk_size!r}")
        if self.length_bucket is not None:
            if isinstance(self.length_bucket, bool) or not isinstance(self.length_bucket, int) or self.length_bucket < 1:
                raise ValueError(f"{name}.length_bucket must be a positive integer or None, got {self.length_bucket!r}")
            if self.aggregation == LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM and self.max_length is None:
                raise ValueError(f"{name}.length_bucket with aggregation 'seq-mean-token-sum-norm' needs max_length: "
                                 "its constant would otherwise be the trimmed batch length")
        self._check_packing(name)
        try:
            _ = self.inference_micro_batching
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ValueError(f"{name}.optimizer must be an OptimizerConfig, got {type(self.optimizer).__name__}")
        _ = self.layout  # validates epochs / mini-batches / micro-batches

    def _check_packing(self, name: str) -> None:
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"{name}.max_tokens_per_micro_batch must be a positive integer or None, got {budget!r}")
        if not isinstance(self.packing, bool):
            raise ValueError(f"{name}.packing must be true or false, got {self.packing!r}")
        if not self.packing:
            if budget is not None:
                raise ValueError(f"{name}.max_tokens_per_micro_batch={budget} sizes packed rows; it needs packing=True")
            return
        if budget is None:
            raise ValueError(f"{name}.packing needs max_tokens_per_micro_batch (the tokens of one packed row)")
        # the token budget chooses the micro-batches and the rows' length: these would be ignored
        for option, default in (("num_microbatches", 1), ("inference_rows", None), ("inference_memory_gib", None)):
            if getattr(self, option) != default:
                raise ValueError(f"{name}.{option}={getattr(self, option)!r} does not apply with packing=True "
                                 f"(micro-batches are chosen by max_tokens_per_micro_batch); leave it at {default!r}")
        if self.length_bucket is not None and self.length_bucket >= budget:
            raise ValueError(f"{name}.length_bucket={self.length_bucket} narrows packed rows of "
                             f"max_tokens_per_micro_batch={budget} tokens; it must be smaller (or None)")
        if self.aggregation == LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM and self.max_length is None:
            raise ValueError(f"{name}.packing with aggregation 'seq-mean-token-sum-norm' needs max_length: its constant "
                             "would otherwise be the packed row's length")

    def _check_correction(self, name: str) -> None:
        object.__setattr__(self, "correction", _enum(CorrectionKind, self.correction, f"{name}.correction"))
        if self.importance_cap is not None and not self.importance_cap > 0:
            raise ValueError(f"{name}.importance_cap must be positive, got {self.importance_cap!r}")
        for low, high in (("icepop_low", "icepop_high"), ("geometric_low", "geometric_high")):
            if not 0 < getattr(self, low) <= getattr(self, high):
                raise ValueError(f"{name}.{low}/{high} must satisfy 0 < low <= high, "
                                 f"got {getattr(self, low)!r}, {getattr(self, high)!r}")
        defaults = {field.name: field.default for field in dataclasses.fields(PolicyConfig)}
        # options the chosen correction does not read must keep their defaults: a set value would be ignored
        used = {CorrectionKind.TOKEN_TIS: {"importance_cap"}, CorrectionKind.SEQUENCE_TIS: {"importance_cap"},
                CorrectionKind.ICEPOP: {"icepop_low", "icepop_high"},
                CorrectionKind.GEOMETRIC_MASK: {"geometric_low", "geometric_high"}, CorrectionKind.NONE: set()}
        for option in ("correction", "importance_cap", "icepop_low", "icepop_high", "geometric_low", "geometric_high"):
            value = getattr(self, option)
            if value == defaults[option]:
                continue
            value = str(value) if isinstance(value, enum.Enum) else value
            if not self.decoupled:  # the corrections read the old-log-prob pass and the sampler's log-probs
                raise ValueError(f"{name}.{option}={value!r} needs decoupled=True")
            if option != "correction" and option not in used[self.correction]:
                raise ValueError(f"{name}.{option}={value!r} is not read by correction {self.correction.value!r}; "
                                 f"set it back to {defaults[option]!r} (command line: before the correction)")
        if self.decoupled and self.correction == CorrectionKind.SEQUENCE_TIS and self.importance_cap is None:
            raise ValueError(f"{name}.correction='sequence-tis' needs importance_cap (its truncation C)")

    @property
    def correction_band(self) -> tuple[float, float] | None:
        """The accepted ratio band of a masking correction (None for the others)."""
        bands = {CorrectionKind.ICEPOP: (self.icepop_low, self.icepop_high),
                 CorrectionKind.GEOMETRIC_MASK: (self.geometric_low, self.geometric_high)}
        return bands.get(self.correction)

    @property
    def layout(self) -> UpdateLayout:
        return UpdateLayout(epochs=self.epochs, num_minibatches=self.num_minibatches, num_microbatches=self.num_microbatches)

    @property
    def inference_micro_batching(self) -> InferenceMicroBatching:
        return InferenceMicroBatching(rows=self.inference_rows, memory_gib=self.inference_memory_gib)

    def required_fields(self) -> tuple[str, ...]:
        """TrainBatch fields the policy part of the update reads (besides tokens and masks)."""
        fields = ["advantages"]
        if self.router_replay:
            fields.append("expert_ids")
        if self.kl_coef > 0:
            fields.append("ref_logprobs")
        if self.decoupled:
            fields += ["old_logprobs", "behaviour_logprobs"]
        elif self.layout.optimizer_steps > 1:
            fields.append("old_logprobs")
        return tuple(fields)


def policy_denominators(cfg: PolicyConfig, batch: TrainBatch) -> dict[str, Array]:
    """The outer denominators of the policy loss and of the KL/entropy terms over a whole mini-batch."""
    policy_aggregation = LossAggregation.SEQ_MEAN_TOKEN_MEAN if cfg.loss == PolicyLossKind.GSPO else cfg.aggregation
    return {
        "policy": aggregation_denominator(batch.response_mask, policy_aggregation, batch.segment_ids),
        "terms": aggregation_denominator(batch.response_mask, cfg.aggregation, batch.segment_ids),
        "tokens": jnp.sum(batch.token_mask.astype(jnp.float32)),  # what the router terms average over
    }


def policy_objective(
    cfg: PolicyConfig,
    logprobs: Float[Array, "b t"],
    entropy: Float[Array, "b t"] | None,
    batch: TrainBatch,
    denominators: dict[str, Array],
) -> tuple[Array, Metrics]:
    """Policy loss + KL + entropy terms for one (micro-)batch; `logprobs` from the current parameters."""
    mask, segment_ids = batch.response_mask, batch.segment_ids
    # pi_old: the old-log-prob pass, or without one (a single optimiser step) this forward, which it equals
    old = batch.old_logprobs if batch.old_logprobs is not None else jax.lax.stop_gradient(logprobs)
    weights, correction_metrics = None, {}
    if batch.behaviour_logprobs is not None:
        correction_metrics = mismatch_metrics(old, batch.behaviour_logprobs, mask)
        if cfg.decoupled:
            weights, applied = correction_weights(cfg.correction, old, batch.behaviour_logprobs, mask,
                                                  cap=cfg.importance_cap, band=cfg.correction_band,
                                                  segment_ids=segment_ids)
            correction_metrics.update(applied)
    if cfg.loss == PolicyLossKind.GSPO:
        loss, metrics = gspo_loss(
            logprobs, old, batch.advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, weights=weights,
            denominator=denominators["policy"], segment_ids=segment_ids,
        )
    else:
        loss, metrics = policy_loss(
            logprobs, old, batch.advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip, aggregation=cfg.aggregation, max_length=cfg.max_length, weights=weights,
            denominator=denominators["policy"], segment_ids=segment_ids,
        )
    metrics.update(correction_metrics)
    terms = dict(aggregation=cfg.aggregation, max_length=cfg.max_length, denominator=denominators["terms"],
                 segment_ids=segment_ids)
    if cfg.kl_coef > 0:
        kl, _ = kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_kind, mask)
        kl_loss = aggregate(kl, mask, **terms)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    if entropy is not None:  # logged whether or not it is in the loss: a collapsing policy shows here first
        mask_f = mask.astype(jnp.float32)
        metrics["entropy"] = jax.lax.stop_gradient((entropy * mask_f).sum() / jnp.maximum(mask_f.sum(), 1.0))
    if cfg.entropy_coef > 0:
        bonus, _ = entropy_bonus(entropy, mask, **terms)
        loss = loss + cfg.entropy_coef * bonus
        metrics["entropy_loss"] = bonus  # -entropy
    return loss, metrics


def update_inputs(batch: TrainBatch, cfg: PolicyConfig, *extra: str) -> TrainBatch:
    """The fields of `batch` an update reads, as device-ready dtypes; the others are dropped so that the
    update's input structure depends only on the config (old_logprobs is kept when present, and so are the
    behaviour log-probs: the mismatch metrics read them)."""
    keep = set(cfg.required_fields()) | set(extra) | {"old_logprobs", "behaviour_logprobs"}
    floats = {
        name: None if getattr(batch, name) is None or name not in keep else _as_dtype(getattr(batch, name), jnp.float32)
        for name in ("behaviour_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "returns")
    }
    expert_ids = None if batch.expert_ids is None or "expert_ids" not in keep else _as_dtype(batch.expert_ids, jnp.int32)
    return TrainBatch(
        tokens=_as_dtype(batch.tokens, jnp.int32),
        token_mask=_as_dtype(batch.token_mask, jnp.bool_),
        response_mask=_as_dtype(batch.response_mask, jnp.bool_),
        expert_ids=expert_ids,
        segment_ids=None if batch.segment_ids is None else _as_dtype(batch.segment_ids, jnp.int32),
        **floats,
    )


def _as_dtype(value: Any, dtype: Any) -> Any:
    """`value` as a device-ready array of `dtype`; an abstract one (for lowering) stays abstract, its sharding kept."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding)
    return jnp.asarray(value, dtype)


class PolicyUpdates:
    """`update` and `lower_update` of a learner: the batch is checked (fields the config needs, rows that split
    over the mesh) and cut to `update_inputs` before its jitted `_update(state, frozen, inputs)` runs. Subclasses
    set `cfg`, `frozen` (the parameters they do not train, `rpegjax.learners.trainable`; None: none) and
    `_update`, and give `rows`, their batch sharding."""

    cfg: Any
    model_cfg: ModelConfig  # the policy's, for memory estimates
    frozen: Any
    _update: Any

    @property
    def rows(self):
        raise NotImplementedError

    @property
    def router_replay(self) -> bool:
        """Whether the training forward replays the rollout's routing (`PolicyConfig.router_replay`)."""
        return self.cfg.router_replay

    def update(self, state, batch: TrainBatch):
        """One update on `batch` (epochs x mini-batches x micro-batches); donates `state`."""
        return self._update(state, self.frozen, self._update_inputs(batch))

    def lower_update(self, state, batch: TrainBatch) -> jax.stages.Lowered:
        """The program `update(state, batch)` runs, lowered for these shapes; `state` and `batch` may be abstract
        (`jax.ShapeDtypeStruct`s with shardings: nothing is allocated). `.compile().cost_analysis()` /
        `.memory_analysis()` give XLA's FLOP and memory figures (ground truth for the performance model)."""
        return self._update.lower(state, self.frozen, self._update_inputs(batch))

    def trimmed_length(self, token_mask) -> int:
        """The length inference and update programs run rows of this mask at (`rpegjax.learners.lengths`); an
        abstract mask (lowering ahead of time) runs at its whole length, the longest bucket."""
        full = token_mask.shape[1]
        if self.cfg.length_bucket is None or isinstance(token_mask, jax.ShapeDtypeStruct):
            return full
        return bucket_length(longest_row(token_mask), full, self.cfg.length_bucket)

    def inference_packing(self, token_mask, *, shards: int = 1) -> PackingPlan | None:
        """How an inference stage packs rows of this mask (`rpegjax.learners.packing`; None: it does not, packing
        off): rows of max_tokens_per_micro_batch (or narrower, `length_bucket`), one per row shard per
        micro-batch. An abstract mask (lowering ahead of time) packs as if every row were full."""
        if not self.cfg.packing:
            return None
        where = f"{type(self).__name__} inference"
        rows, full = token_mask.shape
        if isinstance(token_mask, jax.ShapeDtypeStruct):  # every row full, at the budget's width
            return plan_packing(np.full(rows, full), self.cfg.max_tokens_per_micro_batch, shards=shards, where=where)
        return plan_packing(sequence_lengths(token_mask, where), self.cfg.max_tokens_per_micro_batch, shards=shards,
                            width_bucket=self.cfg.length_bucket, where=where)

    def inference_micro_batches(self, rows: int, length: int, *, shards: int = 1, tensor: int = 1) -> int:
        """How many row micro-batches an inference stage over `rows` rows of `length` tokens runs in."""
        return self.cfg.inference_micro_batching.micro_batches(
            rows, length, self.model_cfg, logprob_chunk=self.cfg.logprob_chunk_size, shards=shards, tensor=tensor,
            where=f"{type(self).__name__} inference")

    def _update_inputs(self, batch: TrainBatch) -> TrainBatch:
        """The update's input: checked, cut to the fields it reads, trimmed to the length bucket, or packed."""
        where = f"{type(self).__name__}.update"
        cfg = self.cfg
        batch.validate()
        batch.require(where, *cfg.required_fields())
        if batch.segment_ids is not None:
            raise ValueError(f"{where} takes one sequence per row; it packs them itself (packing=True)")
        cfg.layout.check_batch(batch.batch_size)
        if not cfg.packing:
            check_rows_divide(batch.batch_size, self.rows, where)
            return update_inputs(trim_batch(batch, self.trimmed_length(batch.token_mask)), cfg)
        shards = row_shards(self.rows)
        if isinstance(batch.tokens, jax.ShapeDtypeStruct):  # lowering ahead of time: every row full
            return abstract_packed_batch(update_inputs(batch, cfg), cfg.max_tokens_per_micro_batch,
                                         minibatches=cfg.num_minibatches, shards=shards)
        plan = plan_packing(sequence_lengths(batch.token_mask, where), cfg.max_tokens_per_micro_batch,
                            minibatches=cfg.num_minibatches, shards=shards, width_bucket=cfg.length_bucket, where=where)
        return pack_batch(update_inputs(batch, cfg), plan)
