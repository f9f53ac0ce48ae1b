"""What the runtime needs of a learner: one interface that GRPO and PPO both implement.

The runtime builds its stage programs from these functions alone (`rpegjax.runtime.programs`), so a new
algorithm plugs in by implementing this protocol, without a branch in the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
from jaxtyping import Array, Float

from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.packing import PackingPlan
from rpegjax.learners.placement import ModelPlacement, Params
from rpegjax.learners.update import TrainState
from rpegjax.models.config import ModelConfig
from rpegjax.sharding.rules import ActivationSharding

Metrics = dict[str, Array]
# (params, tokens [b, t], token mask [b, t], activation sharding or None, segment_ids= packed rows' segments or None)
# -> per-token values [b, t]
TokenFunction = Callable[[Params, Any, Any, ActivationSharding | None], Float[Array, "b t"]]


class Learner(Protocol):
    """A learner holds jitted update/inference functions; the state they transform lives outside.

    `params` are the initial parameters of every model it trains (GRPO: the policy's tree; PPO:
    `{"actor": ..., "critic": ...}`), placed on `placement.mesh`: the trainable ones, which is all of them unless
    the policy carries LoRA adapters (then the adapters; the frozen base is held by the learner,
    `rpegjax.learners.trainable`). `model_params` puts the frozen part back beside trainable parameters;
    `actor_params` gives the policy's whole tree from them (old log-probs and generation read it);
    `reference_params()` the reference policy's (the initial policy; with LoRA its base, adapters off, no copy).
    The pure (unjitted) token functions are what the runtime fuses into inference programs: `logprobs_fn` takes
    the policy's whole parameters (or the reference's); `values_fn` and `logprobs_and_values_fn` (None without a
    critic) take the learner's whole parameters. `router_replay`: whether its training forward replays the rollout's
    routing (the batch then carries `expert_ids` of the policy's `model_cfg`, `rpegjax.generate.decode.routing_shape`).
    """

    placement: ModelPlacement  # the policy's: mesh, parameter and row shardings
    state_shardings: TrainState | None  # of `init_state()`'s state on the mesh (None without one)
    frozen: Params | None  # the parameters it holds but does not train (LoRA's base; None: none)
    values_fn: TokenFunction | None
    logprobs_and_values_fn: Callable | None
    model_cfg: ModelConfig  # the policy's

    @property
    def router_replay(self) -> bool: ...

    @property
    def params(self) -> Params: ...

    def actor_params(self, params: Params) -> Params: ...

    def model_params(self, params: Params) -> Params: ...

    def reference_params(self) -> Params: ...

    def init_state(self, params: Params | None = None) -> TrainState: ...

    def update(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]: ...

    def lower_update(self, state: TrainState, batch: TrainBatch) -> jax.stages.Lowered:
        """The program `update` runs, lowered; `state` and `batch` may be abstract (`jax.ShapeDtypeStruct`)."""
        ...

    def compute_advantages(self, batch: TrainBatch) -> tuple[TrainBatch, Metrics]: ...

    def logprobs_fn(self, params: Params, tokens, token_mask, sharding: ActivationSharding | None = None,
                    segment_ids=None, expert_ids=None) -> Float[Array, "b t"]: ...

    def trimmed_length(self, token_mask) -> int:
        """The length a batch with this token mask runs at (`rpegjax.learners.lengths`)."""
        ...

    def inference_packing(self, token_mask, *, shards: int = 1) -> PackingPlan | None:
        """How an inference stage packs rows of this mask (None: unpacked) (`rpegjax.learners.packing`)."""
        ...

    def inference_micro_batches(self, rows: int, length: int, *, shards: int = 1, tensor: int = 1) -> int:
        """How many row micro-batches an inference stage runs in (`rpegjax.learners.inference`)."""
        ...
