"""The GRPO learner (and its variants DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO, decoupled PPO).

    learner = GRPOLearner(GRPOConfig(group_size=4, kl_coef=0.04), model, mesh=mesh)
    state = learner.init_state()
    batch = batch.replace(ref_logprobs=learner.logprobs(ref_params, batch))
    batch, _ = learner.compute_advantages(batch)
    state, metrics = learner.update(state, batch)

`update` is jit-compiled once per batch structure (the TrainBatch fields it reads, see
`GRPOConfig.required_fields`); it donates the old state.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float

from rpegjax.learners.advantages import AdvantageKind, compute_advantages
from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.objective import PolicyConfig, PolicyUpdates, policy_denominators, policy_objective
from rpegjax.learners.optim import make_optimizer, make_schedule, optimizer_data_axes
from rpegjax.learners.placement import ModelPlacement, Params, has_adapters, has_dropout, jit_with_shardings
from rpegjax.learners.router import add_router_terms
from rpegjax.learners.scoring import score_sequences
from rpegjax.learners.trainable import join_frozen, split_trainable
from rpegjax.learners.update import (
    Metrics,
    TrainState,
    check_rows_divide,
    make_init,
    make_update,
    row_shards,
    train_state_shardings,
)
from rpegjax.models.transformer import Decoder
from rpegjax.options import OptimizerSharding
from rpegjax.sharding.rules import ActivationSharding, ShardingRules

_OUTCOME_KINDS = (
    AdvantageKind.GRPO,
    AdvantageKind.DR_GRPO,
    AdvantageKind.RLOO,
    AdvantageKind.REINFORCE_PP,
    AdvantageKind.REINFORCE_PP_BASELINE,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig(PolicyConfig):
    """Critic-free policy optimisation: advantages from the rewards of each prompt's group of samples.

    DAPO = clip_high > clip_low (e.g. 0.28 / 0.2), token-mean aggregation, no KL, plus dynamic sampling
    (`rpegjax.learners.group_filter`, run by the runtime's rollout stage) and overlong reward shaping
    (`rpegjax.rewards.format.overlong_penalty`); the job's `--recipe dapo` sets all five. Dr.GRPO =
    advantage 'dr-grpo' with aggregation 'seq-mean-token-sum-norm'; GSPO = loss 'gspo'.
    """

    group_size: int
    advantage: AdvantageKind = AdvantageKind.GRPO
    advantage_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"GRPOConfig.group_size must be a positive integer, got {self.group_size!r}")
        try:
            advantage = AdvantageKind(self.advantage)
        except ValueError:
            advantage = None
        if advantage not in _OUTCOME_KINDS:
            raise ValueError(
                f"GRPOConfig.advantage must be one of {[k.value for k in _OUTCOME_KINDS]}, got {self.advantage!r} "
                "(GAE needs a critic: use PPOConfig)"
            )
        object.__setattr__(self, "advantage", advantage)
        if advantage != AdvantageKind.REINFORCE_PP and self.group_size < 2:  # a group of one has no baseline
            raise ValueError(f"GRPOConfig.group_size must be >= 2 for advantage {advantage.value!r}, got {self.group_size}")
        if self.advantage_eps <= 0:
            raise ValueError(f"GRPOConfig.advantage_eps must be positive, got {self.advantage_eps!r}")


class GRPOLearner(PolicyUpdates):
    """Holds the jitted functions of one policy model; the state they transform lives outside.
    Implements `rpegjax.learners.protocol.Learner` (no critic: `values_fn` is None). `seed`: of the update's random
    draws, the LoRA dropout masks of a model with adapter dropout (`rpegjax.learners.update`). `optimizer_sharding`:
    the AdamW moments' layout on the mesh (`rpegjax.options.OptimizerSharding`)."""

    values_fn = None
    logprobs_and_values_fn = None

    def __init__(self, cfg: GRPOConfig, model: Decoder, *, mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 seed: int = 0, optimizer_sharding: OptimizerSharding = OptimizerSharding.PARAMS):
        self.cfg = cfg
        self.model_cfg = model.cfg
        self.placement, params = ModelPlacement.split(model, mesh, rules)
        # with LoRA adapters only they train; the frozen base is passed to the update beside the state
        self._params, self.frozen = split_trainable(params)
        self.optimizer = make_optimizer(cfg.optimizer)
        placement = self.placement
        trainable_shardings, frozen_shardings = (None, None) if mesh is None else split_trainable(placement.param_shardings)
        self.state_shardings = (
            None if mesh is None else train_state_shardings(self.optimizer, self._params, trainable_shardings, mesh,
                                                            data_axes=optimizer_data_axes(optimizer_sharding, placement.rows))
        )
        self._init = make_init(self.optimizer, self.state_shardings)
        self.update_traces = 0  # how many times `update` was traced (compiled); tests assert it stays 1

        def counted_update(state: TrainState, frozen: Params, batch: TrainBatch) -> tuple[TrainState, Metrics]:
            self.update_traces += 1
            update = make_update(
                lambda params, micro, denominators, key: self._loss(join_frozen(params, frozen), micro, denominators,
                                                                    key),
                lambda batch: policy_denominators(cfg, batch), self.optimizer, cfg.layout,
                learning_rate_fn=make_schedule(cfg.optimizer), micro_batch_sharding=placement.rows,
                seed=seed if has_dropout(placement.lora) else None,
                rows_per_micro_batch=row_shards(placement.rows) if cfg.packing else None,
            )
            return update(state, batch)

        self._update = jit_with_shardings(
            counted_update, (self.state_shardings, frozen_shardings, placement.rows),
            (self.state_shardings, placement.replicated), mesh=mesh, donate_argnums=(0,),
        )
        self._logprobs = jit_with_shardings(
            self.logprobs_fn, (placement.param_shardings, placement.rows, placement.rows), placement.rows, mesh=mesh
        )
        # the reference with LoRA: the frozen base alone (`placement.merge` runs it as the base model)
        self._base_logprobs = None if self.frozen is None else jit_with_shardings(
            self.logprobs_fn, (frozen_shardings, placement.rows, placement.rows), placement.rows, mesh=mesh
        )
        self._advantages = jit_with_shardings(
            self._advantages_fn, (placement.rows, placement.rows), (placement.rows, placement.replicated), mesh=mesh
        )

    # ---- pure functions (jitted above) -------------------------------------------------------
    def _loss(self, params: Params, batch: TrainBatch, denominators, dropout_key=None) -> tuple[Array, Metrics]:
        cfg = self.cfg
        scores = score_sequences(
            self.placement.merge(params), batch.tokens, batch.token_mask, chunk_size=cfg.logprob_chunk_size,
            temperature=cfg.temperature, with_entropy=True, sharding=self.placement.activations, dropout_key=dropout_key,
            expert_ids=batch.expert_ids if cfg.router_replay else None,
            segment_ids=batch.segment_ids,
        )
        loss, metrics = policy_objective(cfg, scores.logprobs, scores.entropy, batch, denominators)
        return add_router_terms(cfg, loss, metrics, scores.routing, batch, denominators)

    def logprobs_fn(self, params: Params, tokens, token_mask, sharding: ActivationSharding | None = None,
                    segment_ids=None, expert_ids=None) -> Float[Array, "b t"]:
        """Pure (unjitted) per-token log-probs, TrainBatch-aligned; the runtime fuses it into inference programs.
        `sharding`: the activation layout of another mesh the params were moved to (default the learner's);
        `segment_ids`: packed rows (`rpegjax.learners.packing`); `expert_ids`: the rollout's routing, replayed."""
        return score_sequences(
            self.placement.merge(params), tokens, token_mask, chunk_size=self.cfg.logprob_chunk_size,
            temperature=self.cfg.temperature, sharding=sharding or self.placement.activations, segment_ids=segment_ids,
            expert_ids=expert_ids,
        ).logprobs

    def _advantages_fn(self, rewards: Float[Array, " b"], response_mask: Bool[Array, "b t"]):
        cfg = self.cfg
        return compute_advantages(
            cfg.advantage, rewards, group_size=cfg.group_size, mask=response_mask, eps=cfg.advantage_eps
        )

    # ---- public API --------------------------------------------------------------------------
    @property
    def rows(self):
        return self.placement.rows

    @property
    def params(self) -> Params:
        """The trainable parameters of the model the learner was built from (placed on the mesh): all of them,
        or with LoRA the adapters (the frozen base is `self.frozen`)."""
        return self._params

    def actor_params(self, params: Params) -> Params:
        """The policy's whole parameters: `params` (trainable) with the frozen base beside them, if any."""
        return join_frozen(params, self.frozen)

    def model_params(self, params: Params) -> Params:
        """The learner's whole parameters from trainable ones: the policy's (GRPO trains one model)."""
        return self.actor_params(params)

    def reference_params(self) -> Params:
        """What the reference log-probs read: the initial policy; with LoRA the frozen base itself (adapters off,
        no copy), which `logprobs_fn` runs as the base model (`ModelPlacement.merge`)."""
        return self.actor_params(self._params) if self.frozen is None else self.frozen

    def place_params(self, params: Params) -> Params:
        """Places another parameter tree of the same model (e.g. the reference) like the policy's."""
        return self.placement.place(params)

    def init_state(self, params: Params | None = None) -> TrainState:
        """A fresh TrainState from `params` (default: the model's; a whole model's parameters are cut down to their
        trainable part), with new buffers."""
        params = self._params if params is None else split_trainable(self.placement.place(params))[0]
        return self._init(params)

    def logprobs(self, params: Params, batch: TrainBatch) -> Float[Array, "b t"]:
        """Per-token log-probs of `batch.tokens` under `params` (the policy's whole parameters, or the reference's:
        `reference_params()`), TrainBatch-aligned."""
        check_rows_divide(batch.batch_size, self.placement.rows, "GRPOLearner.logprobs")
        logprobs = self._logprobs if self._base_logprobs is None or has_adapters(params) else self._base_logprobs
        return logprobs(params, jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.token_mask, bool))

    def compute_advantages(self, batch: TrainBatch) -> tuple[TrainBatch, Metrics]:
        """Fills `batch.advantages` from `batch.rewards` with the configured estimator."""
        batch.require("GRPOLearner.compute_advantages", "rewards")
        check_rows_divide(batch.batch_size, self.placement.rows, "GRPOLearner.compute_advantages")
        advantages, metrics = self._advantages(jnp.asarray(batch.rewards, jnp.float32), jnp.asarray(batch.response_mask, bool))
        return batch.replace(advantages=advantages), metrics

