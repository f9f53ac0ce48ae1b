"""The PPO learner: GAE advantages from a critic, clipped policy and value losses.

Two critic layouts (`CriticMode`):
* separate — a second Decoder with a value head (its own trunk); one jitted update steps both models,
  each with its own optimiser (gradient clipping per model): loss = policy objective + value loss;
* shared — the actor has the value head (`ModelConfig(value_head=True)`); one forward pass gives
  log-probs and values and one update steps the joint loss policy objective + vf_coef * value loss.

State: `TrainState` whose params are {"actor": ...} (shared) or {"actor": ..., "critic": ...}.

    batch = batch.replace(ref_logprobs=..., old_logprobs=..., values=learner.values(state.params, batch))
    batch, _ = learner.compute_advantages(batch)      # GAE: advantages [b, t] and returns
    state, metrics = learner.update(state, batch)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float

from rpegjax.learners.advantages import gae, outcome_token_rewards, whiten
from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.losses import aggregation_denominator, kl_penalty, value_loss
from rpegjax.learners.objective import PolicyConfig, PolicyUpdates, policy_denominators, policy_objective, update_inputs
from rpegjax.learners.optim import OptimizerConfig, make_optimizer, make_schedule, optimizer_data_axes
from rpegjax.learners.placement import ModelPlacement, Params, has_adapters, has_dropout, jit_with_shardings
from rpegjax.learners.router import add_router_terms
from rpegjax.learners.scoring import score_sequences
from rpegjax.learners.trainable import join_frozen, split_trainable, with_value_head
from rpegjax.learners.update import (
    Metrics,
    TrainState,
    check_rows_divide,
    make_init,
    make_update,
    row_shards,
    train_state_shardings,
)
from rpegjax.graph.ir import CriticMode
from rpegjax.models.transformer import Decoder
from rpegjax.options import OptimizerSharding
from rpegjax.sharding.rules import ActivationSharding, ShardingRules


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig(PolicyConfig):
    """PPO with GAE. `kl_in_reward_coef` subtracts coef * KL(pi_old || pi_ref) (estimator `kl_kind`) from
    every response token's reward before GAE (the classic RLHF placement; `kl_coef` puts it in the loss).
    The value loss uses the policy's `aggregation`; `vf_coef` weighs it in the shared-trunk joint loss
    (a separate critic is stepped on the value loss alone). `critic_optimizer` defaults to `optimizer`."""

    critic: CriticMode = CriticMode.SEPARATE
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    kl_in_reward_coef: float = 0.0
    critic_optimizer: OptimizerConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            object.__setattr__(self, "critic", CriticMode(self.critic))
        except ValueError:
            raise ValueError(f"PPOConfig.critic must be one of {[c.value for c in CriticMode]}, got {self.critic!r}") from None
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"PPOConfig.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"PPOConfig.value_clip must be positive or None, got {self.value_clip!r}")
        if self.vf_coef <= 0:
            raise ValueError(f"PPOConfig.vf_coef must be positive, got {self.vf_coef!r}")
        if self.kl_in_reward_coef < 0:
            raise ValueError(f"PPOConfig.kl_in_reward_coef must be >= 0, got {self.kl_in_reward_coef!r}")
        if self.critic_optimizer is not None and self.critic == CriticMode.SHARED:
            raise ValueError("PPOConfig.critic_optimizer is only used with critic='separate'")

    def required_fields(self) -> tuple[str, ...]:
        return (*super().required_fields(), "values", "returns")


class PPOLearner(PolicyUpdates):
    """Jitted PPO functions for an actor and a critic (separate model or the actor's own value head).
    Implements `rpegjax.learners.protocol.Learner`: its parameters are `{"actor": ..., "critic": ...?}`. `seed`: of the
    update's random draws, the LoRA dropout masks of an actor with adapter dropout (`rpegjax.learners.update`).
    `optimizer_sharding`: the AdamW moments' layout on the mesh (`rpegjax.options.OptimizerSharding`)."""

    def __init__(
        self,
        cfg: PPOConfig,
        actor: Decoder,
        critic: Decoder | None = None,
        *,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
        seed: int = 0,
        optimizer_sharding: OptimizerSharding = OptimizerSharding.PARAMS,
    ):
        if cfg.critic == CriticMode.SHARED:
            if critic is not None:
                raise ValueError("PPOLearner: critic='shared' uses the actor's value head; do not pass a critic model")
            if not actor.cfg.value_head:
                raise ValueError("PPOLearner: critic='shared' needs an actor built with ModelConfig(value_head=True)")
        else:
            if critic is None:
                raise ValueError("PPOLearner: critic='separate' needs a critic model")
            if not critic.cfg.value_head:
                raise ValueError("PPOLearner: the critic model needs ModelConfig(value_head=True)")
        self.cfg = cfg
        self.model_cfg = actor.cfg
        self.actor, actor_params = ModelPlacement.split(actor, mesh, rules)
        # with LoRA adapters on the actor only they (and a shared value head) train; its base is frozen
        actor_params, actor_frozen = split_trainable(actor_params)
        self._params = {"actor": actor_params}
        self.frozen = None if actor_frozen is None else {"actor": actor_frozen}
        actor_shardings, frozen_shardings = (None, None) if mesh is None else split_trainable(self.actor.param_shardings)
        shardings = {"actor": actor_shardings}
        frozen_shardings = None if frozen_shardings is None else {"actor": frozen_shardings}
        if critic is None:
            self.critic = self.actor
            self.optimizer = make_optimizer(cfg.optimizer)
        else:
            self.critic, critic_params = ModelPlacement.split(critic, mesh, rules)
            self._params["critic"] = critic_params
            shardings["critic"] = self.critic.param_shardings
            self.optimizer = optax.multi_transform(
                {"actor": make_optimizer(cfg.optimizer), "critic": make_optimizer(cfg.critic_optimizer or cfg.optimizer)},
                {"actor": "actor", "critic": "critic"},
            )
        rows, replicated = self.actor.rows, self.actor.replicated
        self.state_shardings = None if mesh is None else train_state_shardings(
            self.optimizer, self._params, shardings, mesh, data_axes=optimizer_data_axes(optimizer_sharding, rows))
        self._init = make_init(self.optimizer, self.state_shardings)
        self.update_traces = 0

        def counted_update(state: TrainState, frozen: Params, batch: TrainBatch) -> tuple[TrainState, Metrics]:
            self.update_traces += 1
            update = make_update(
                lambda params, micro, denominators, key: self._loss(join_frozen(params, frozen), micro, denominators,
                                                                    key),
                self._denominators, self.optimizer, cfg.layout,
                learning_rate_fn=make_schedule(cfg.optimizer), micro_batch_sharding=rows,
                seed=seed if has_dropout(self.actor.lora) else None,
                rows_per_micro_batch=row_shards(rows) if cfg.packing else None,
            )
            return update(state, batch)

        whole_shardings = None if mesh is None else dict(shardings, actor=self.actor.param_shardings)
        self._update = jit_with_shardings(
            counted_update, (self.state_shardings, frozen_shardings, rows), (self.state_shardings, replicated),
            mesh=mesh, donate_argnums=(0,),
        )
        self._logprobs = jit_with_shardings(self.logprobs_fn, (self.actor.param_shardings, rows, rows), rows, mesh=mesh)
        # the reference with LoRA: the actor's frozen base alone (`ModelPlacement.merge` runs it as the base model)
        self._base_logprobs = None if self.frozen is None else jit_with_shardings(
            self.logprobs_fn, (None if frozen_shardings is None else frozen_shardings["actor"], rows, rows), rows,
            mesh=mesh)
        self._values = jit_with_shardings(self.values_fn, (whole_shardings, rows, rows), rows, mesh=mesh)
        self._advantages = jit_with_shardings(self._advantages_fn, (rows,), (rows, replicated), mesh=mesh)
        self._logprobs_and_values = jit_with_shardings(
            self.logprobs_and_values_fn, (whole_shardings, rows, rows), (rows, rows), mesh=mesh
        )

    # ---- pure functions ----------------------------------------------------------------------
    def _denominators(self, batch: TrainBatch):
        value = aggregation_denominator(batch.response_mask, self.cfg.aggregation, batch.segment_ids)
        return dict(policy_denominators(self.cfg, batch), value=value)

    def _loss(self, params: Params, batch: TrainBatch, denominators, dropout_key=None) -> tuple[Array, Metrics]:
        """`dropout_key`: the actor's LoRA dropout (with a shared critic its values come from that same forward)."""
        cfg = self.cfg
        shared = cfg.critic == CriticMode.SHARED
        scores = score_sequences(
            self.actor.merge(params["actor"]), batch.tokens, batch.token_mask, chunk_size=cfg.logprob_chunk_size,
            temperature=cfg.temperature, with_entropy=True, with_values=shared,
            sharding=self.actor.activations, dropout_key=dropout_key, segment_ids=batch.segment_ids,
            expert_ids=batch.expert_ids if cfg.router_replay else None,
        )
        loss, metrics = policy_objective(cfg, scores.logprobs, scores.entropy, batch, denominators)
        loss, metrics = add_router_terms(cfg, loss, metrics, scores.routing, batch, denominators)
        values = scores.values if shared else self._critic_values(params["critic"], batch.tokens, batch.token_mask,
                                                                  segment_ids=batch.segment_ids)
        vf_loss, vf_metrics = value_loss(
            values, batch.values, batch.returns, batch.response_mask, clip=cfg.value_clip,
            aggregation=cfg.aggregation, max_length=cfg.max_length, denominator=denominators["value"],
            segment_ids=batch.segment_ids,
        )
        metrics.update(vf_metrics)
        return loss + (cfg.vf_coef if shared else 1.0) * vf_loss, metrics

    def _critic_values(self, params: Params, tokens, token_mask, sharding: ActivationSharding | None = None,
                       segment_ids=None, expert_ids=None) -> Float[Array, "b t"]:
        return score_sequences(
            self.critic.merge(params), tokens, token_mask, with_logprobs=False, with_values=True,
            sharding=sharding or self.critic.activations, segment_ids=segment_ids, expert_ids=expert_ids,
        ).values

    def logprobs_fn(self, params: Params, tokens, token_mask, sharding: ActivationSharding | None = None,
                    segment_ids=None, expert_ids=None) -> Float[Array, "b t"]:
        """Pure per-token log-probs of the actor (`params` its weights); `sharding`, `segment_ids`, `expert_ids` as
        in GRPOLearner.logprobs_fn."""
        return score_sequences(
            self.actor.merge(params), tokens, token_mask, chunk_size=self.cfg.logprob_chunk_size,
            temperature=self.cfg.temperature, sharding=sharding or self.actor.activations, segment_ids=segment_ids,
            expert_ids=expert_ids,
        ).logprobs

    def values_fn(self, params: Params, tokens, token_mask, sharding: ActivationSharding | None = None,
                  segment_ids=None, expert_ids=None) -> Float[Array, "b t"]:
        """Pure per-token values; `params` the learner's whole parameters (`model_params`; the critic's weights are
        picked here). `expert_ids` (replay) route a shared critic's trunk, as the update's joint forward does."""
        if self.cfg.critic == CriticMode.SHARED:
            return self._critic_values(params["actor"], tokens, token_mask, sharding, segment_ids, expert_ids)
        return self._critic_values(params["critic"], tokens, token_mask, sharding, segment_ids)

    def logprobs_and_values_fn(self, params: Params, tokens, token_mask, sharding: ActivationSharding | None = None,
                               segment_ids=None, expert_ids=None):
        """Pure per-token (log-probs, values) from the whole state's params; with a shared critic one pass over
        the trunk gives both (the runtime uses it when a stage computes both). `expert_ids` (replay) route the
        actor's pass; a separate critic routes freely, as in the update."""
        if self.cfg.critic == CriticMode.SHARED:
            scores = score_sequences(
                self.actor.merge(params["actor"]), tokens, token_mask, chunk_size=self.cfg.logprob_chunk_size,
                temperature=self.cfg.temperature, with_values=True, sharding=sharding or self.actor.activations,
                segment_ids=segment_ids, expert_ids=expert_ids,
            )
            return scores.logprobs, scores.values
        return (self.logprobs_fn(params["actor"], tokens, token_mask, sharding, segment_ids, expert_ids),
                self._critic_values(params["critic"], tokens, token_mask, sharding, segment_ids))

    def _advantages_fn(self, batch: TrainBatch) -> tuple[TrainBatch, Metrics]:
        cfg = self.cfg
        mask = batch.response_mask
        rewards = outcome_token_rewards(batch.rewards, mask)
        metrics = {}
        if cfg.kl_in_reward_coef > 0:
            kl, _ = kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.kl_kind, mask)
            rewards = rewards - cfg.kl_in_reward_coef * kl
            metrics["kl_in_reward"] = jnp.sum(kl) / jnp.maximum(jnp.sum(mask), 1)
        (advantages, returns), gae_metrics = gae(rewards, batch.values, mask, cfg.gamma, cfg.lam)
        metrics.update(gae_metrics)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        return batch.replace(advantages=advantages, returns=returns), metrics

    # ---- public API --------------------------------------------------------------------------
    @property
    def rows(self):
        return self.actor.rows

    @property
    def params(self) -> Params:
        """{"actor": ..., "critic": ...?}: the trainable parameters of the models the learner was built from (with
        LoRA the actor's adapters and value head; its frozen base is `self.frozen["actor"]`)."""
        return self._params

    def model_params(self, params: Params) -> Params:
        """The learner's whole parameters from trainable ones (`state.params`): the frozen base put back."""
        return join_frozen(params, self.frozen)

    def reference_params(self) -> Params:
        """What the reference log-probs read: the initial actor; with LoRA its frozen base (adapters off, no copy;
        a shared critic's value head beside it, trained but unread by log-probs)."""
        if self.frozen is None:
            return self.actor_params(self._params)
        if self.cfg.critic == CriticMode.SHARED:
            return with_value_head(self.frozen["actor"], self._params["actor"])
        return self.frozen["actor"]

    @property
    def placement(self) -> ModelPlacement:
        """The actor's placement (the policy's mesh and shardings)."""
        return self.actor

    def actor_params(self, params: Params) -> Params:
        """The actor's whole parameters from the learner's trainable ones."""
        return self.model_params(params)["actor"]

    def init_state(self, params: Params | None = None) -> TrainState:
        """A fresh TrainState from `params` (default: the models'; whole models' parameters are cut down to their
        trainable part), with new buffers."""
        if params is None:
            params = self._params
        else:
            params = {name: split_trainable((self.actor if name == "actor" else self.critic).place(p))[0]
                      for name, p in params.items()}
        return self._init(params)

    def logprobs(self, actor_params: Params, batch: TrainBatch) -> Float[Array, "b t"]:
        """Per-token log-probs under `actor_params` (the actor's, or the reference's), TrainBatch-aligned."""
        check_rows_divide(batch.batch_size, self.actor.rows, "PPOLearner.logprobs")
        logprobs = self._logprobs if self._base_logprobs is None or has_adapters(actor_params) else self._base_logprobs
        return logprobs(actor_params, jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.token_mask, bool))

    def values(self, params: Params, batch: TrainBatch) -> Float[Array, "b t"]:
        """Critic values (TrainBatch-aligned) from the learner's params dict (`state.params`)."""
        check_rows_divide(batch.batch_size, self.actor.rows, "PPOLearner.values")
        return self._values(self.model_params(params), jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.token_mask, bool))

    def logprobs_and_values(self, params: Params, batch: TrainBatch) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
        """Old log-probs and values in one dispatch (one forward pass with a shared trunk): the fused
        old-log-prob + critic-value stage."""
        check_rows_divide(batch.batch_size, self.actor.rows, "PPOLearner.logprobs_and_values")
        return self._logprobs_and_values(self.model_params(params), jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.token_mask, bool))

    def compute_advantages(self, batch: TrainBatch) -> tuple[TrainBatch, Metrics]:
        """GAE over response tokens from `rewards` (on each row's last response token) and `values`;
        fills `advantages` [b, t] (whitened when configured) and `returns`."""
        needed = ["rewards", "values"] + (["old_logprobs", "ref_logprobs"] if self.cfg.kl_in_reward_coef > 0 else [])
        batch.require("PPOLearner.compute_advantages", *needed)
        check_rows_divide(batch.batch_size, self.actor.rows, "PPOLearner.compute_advantages")
        inputs = update_inputs(batch, self.cfg, *needed)
        inputs = inputs.replace(rewards=jnp.asarray(batch.rewards, jnp.float32))
        result, metrics = self._advantages(inputs)
        return batch.replace(advantages=result.advantages, returns=result.returns), metrics
