"""Which parameters a learner trains: every parameter of a plain model; of a model with LoRA adapters only the
adapters (and a value head, which has no base to adapt). The rest is frozen: held once by the learner, passed to
its programs as an argument, never copied into the train state, the optimiser state or a checkpoint.

A learner's parameters (`TrainState.params`) are then the trainable part alone; `join_frozen` puts the frozen
part back beside it wherever a whole model is needed (forward passes, weight sync, export).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from rpegjax.learners.placement import has_adapters
from rpegjax.models.lora import LoRAParam

Params = Any

VALUE_HEAD = nnx.Any(nnx.PathContains("value_kernel"), nnx.PathContains("value_bias"))
# with adapters: the adapters, and a value head (trained from scratch, nothing to adapt)
TRAINABLE_WITH_ADAPTERS = nnx.Any(LoRAParam, VALUE_HEAD)


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(trainable, frozen) of one model's state: (state, None) without adapters. Works on any tree with the
    state's variables (e.g. its shardings)."""
    if not has_adapters(state):
        return state, None
    trainable, frozen = nnx.split_state(state, TRAINABLE_WITH_ADAPTERS, ...)
    return trainable, frozen


def join_frozen(trainable: Params, frozen: Params) -> Params:
    """The whole parameters from the trainable part and the frozen part (None: nothing frozen). Both are one
    model's state, or dicts of them by model name (PPO's {"actor": ..., "critic": ...})."""
    if frozen is None:
        return trainable
    if isinstance(trainable, nnx.State):
        return nnx.merge_state(trainable, frozen)
    return {name: join_frozen(value, frozen.get(name)) for name, value in trainable.items()}


def with_value_head(frozen: nnx.State, trainable: nnx.State) -> nnx.State:
    """A model's frozen base completed with the value head of its trainable part: the base model (adapters
    off) of a model with a value head is only whole with one, though its log-probs never read it."""
    head = nnx.split_state(trainable, VALUE_HEAD, ...)[0]
    return nnx.merge_state(frozen, head)
