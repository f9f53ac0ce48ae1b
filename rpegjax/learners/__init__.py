"""Pure loss / advantage functions (GRPO, PPO+GAE, DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO, decoupled PPO,
KL estimators) and the learner objects that bundle them with an optax optimiser."""

from rpegjax.learners.advantages import (
    AdvantageKind,
    compute_advantages,
    discounted_returns,
    gae,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from rpegjax.learners.batch import TrainBatch, pack_rollouts, shift_to_tokens
from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.losses import (
    KLKind,
    LossAggregation,
    aggregate,
    aggregation_denominator,
    entropy_bonus,
    gspo_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)
from rpegjax.learners.objective import PolicyConfig, PolicyLossKind
from rpegjax.learners.optim import OptimizerConfig, Schedule, make_optimizer, make_schedule
from rpegjax.learners.ppo import CriticMode, PPOConfig, PPOLearner
from rpegjax.learners.scoring import SequenceScores, score_sequences, sequence_logprobs, sequence_values
from rpegjax.learners.update import TrainState, UpdateLayout

__all__ = [
    "AdvantageKind",
    "CriticMode",
    "GRPOConfig",
    "GRPOLearner",
    "KLKind",
    "LossAggregation",
    "OptimizerConfig",
    "PPOConfig",
    "PPOLearner",
    "PolicyConfig",
    "PolicyLossKind",
    "Schedule",
    "SequenceScores",
    "TrainBatch",
    "TrainState",
    "UpdateLayout",
    "aggregate",
    "aggregation_denominator",
    "compute_advantages",
    "discounted_returns",
    "entropy_bonus",
    "gae",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "make_optimizer",
    "make_schedule",
    "outcome_token_rewards",
    "pack_rollouts",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "score_sequences",
    "sequence_logprobs",
    "sequence_values",
    "shift_to_tokens",
    "value_loss",
    "whiten",
]
