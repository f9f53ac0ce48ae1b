"""Optimiser state in host memory between updates (`Execution.optimizer_offload`).

In a colocated plan generation and training share the devices, and AdamW's state (two moments per parameter,
float32: two thirds of a float32 learner's persistent bytes) is idle while the sampler decodes. With offload the
runtime keeps it in pinned host memory (JAX's `pinned_host` memory kind) from the end of one update to the start
of the next: `to_device` before the update program (which takes and donates it on the devices, as without
offload) and `to_host` after it. Parameters stay on the devices (every stage reads them). The copies are exact:
the same bytes, moved.

Each move waits for its copy and then deletes the old buffers (JAX cannot donate across memory kinds), so the
memory is free when the move returns. The transfer time is costed by the performance model over the device's host
link (`DeviceSpec.host_bandwidth`), in the update stage.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Sharding

HOST_MEMORY = "pinned_host"


class OptimizerOffload:
    """Moves a `TrainState`'s optimiser state between the devices (`shardings`, the learner's state shardings) and
    pinned host memory with the same layout. Raises ValueError at construction when the devices have no pinned host
    memory (the plan asked for what this backend cannot do)."""

    def __init__(self, shardings: Any):
        if shardings is None:
            raise ValueError("Execution.optimizer_offload needs the learner on a mesh (its state shardings say "
                             "where each buffer lives); this learner has none")
        self.device_shardings = shardings.opt_state
        leaves = jax.tree.leaves(self.device_shardings)
        device = next(iter(leaves[0].device_set))
        kinds = {memory.kind for memory in device.addressable_memories()}
        if HOST_MEMORY not in kinds:
            raise ValueError(f"Execution.optimizer_offload: {device.platform} device {device.id} has no "
                             f"{HOST_MEMORY!r} memory (it has {sorted(kinds)}); plan without offload")
        self.host_shardings = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), self.device_shardings,
                                           is_leaf=lambda x: isinstance(x, Sharding))

    def to_host(self, state: Any) -> Any:
        """`state` with its optimiser state in pinned host memory; its device buffers are freed."""
        return state.replace(opt_state=_move(state.opt_state, self.host_shardings))

    def to_device(self, state: Any) -> Any:
        """`state` with its optimiser state back on the devices, laid out as the update program takes it; its host
        buffers are freed."""
        return state.replace(opt_state=_move(state.opt_state, self.device_shardings))


def _move(tree: Any, shardings: Any) -> Any:
    """`tree` copied to `shardings`, its old buffers deleted once the copy is done (JAX cannot donate across memory
    kinds): the memory is free whoever still holds the old arrays, and a stale reference fails loudly."""
    moved = jax.block_until_ready(jax.device_put(tree, shardings))
    for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(moved), strict=True):
        if old is not new:  # already where it belongs: device_put returned the array itself
            old.delete()
    return moved


def on_host(tree: Any) -> bool:
    """Whether every array of `tree` lies in pinned host memory."""
    return all(getattr(leaf.sharding, "memory_kind", None) == HOST_MEMORY for leaf in jax.tree.leaves(tree))
