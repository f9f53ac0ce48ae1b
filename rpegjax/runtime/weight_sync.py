"""Weight-sync programs: the generation copy of the actor's weights, made from a training state.

Three paths, one cast: `sync` copies into the sampler's layout (a jitted cast on shared devices; onto other
devices, where a jitted program cannot output, a `device_put` after the cast); `copy_actor` copies into any
layout on the training devices (e.g. held-out evaluation's sampler there); `staged_sync` copies into the
generation layout laid over the training devices, which a run over process groups then sends away. Every
jitted copy can be lowered for an abstract state (`lower_sync`, `lower_copy`): the dry run compiles them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rpegjax.generate.sampler import Sampler
from rpegjax.learners.protocol import Learner
from rpegjax.models.lora import merge_adapters
from rpegjax.models.precision import cast_floating
from rpegjax.runtime import transfers
from rpegjax.runtime.meshes import device_ids
from rpegjax.sharding.abstract import with_shardings


class WeightSyncPrograms:
    """Copies of the actor weights of a learner's state for `sampler`, cast to `generation_dtype` when given
    (`rpegjax.models.precision`; None: kept as trained); a policy with LoRA adapters and a sampler of its base
    model get the adapters merged into the kernels there. A copy, never the same buffers: the next update
    donates the training ones."""

    def __init__(self, learner: Learner, sampler: Sampler, generation_dtype: str | None = None):
        self.learner = learner
        self.sampler = sampler
        cast = (lambda params: jax.tree.map(jnp.copy, params)) if generation_dtype is None else (
            lambda params: cast_floating(params, generation_dtype))
        lora = learner.placement.lora
        merge = lora is not None and sampler.lora is None  # a base-model sampler: adapters merged into the copy
        if merge:
            cast_only = cast
            cast = lambda params: cast_only(merge_adapters(params, lora.scale))  # noqa: E731
        self._cast = cast
        self._staging: Any = None  # `staging_shardings()`, built on first use (training processes over process groups)
        self._copies: dict[int, tuple[Any, Callable]] = {}  # `copy_actor`'s programs by layout
        train_mesh = learner.placement.mesh
        # weights are cast on the training devices, in the copy
        self.shared_devices = device_ids(sampler.mesh) == device_ids(train_mesh)
        if self.shared_devices:
            self._sync_program = jax.jit(cast, out_shardings=sampler.params_sharding)
        else:  # disjoint devices: `device_put` moves and reshards after the cast (none when nothing changes)
            self._sync_program = None if generation_dtype is None and not merge else jax.jit(cast)
        self.dispatches = 0  # programs launched by `sync` and `staged_sync`

    def actor_params_of(self, state: Any) -> Any:
        """The policy's parameters in a learner's train state."""
        return self.learner.actor_params(state.params)

    def sync(self, state: Any) -> Any:
        """Generation-layout copy of the actor weights of `state`."""
        self.dispatches += 1
        params = self.actor_params_of(state)
        if self.shared_devices:
            return self._sync_program(params)
        target = self.sampler.params_sharding if self.sampler.params_sharding is not None else jax.devices()[0]
        return jax.device_put(params if self._sync_program is None else self._sync_program(params), target,
                              may_alias=False)

    def lower_sync(self, state: Any) -> jax.stages.Lowered | None:
        """The program `sync(state)` runs, lowered (`state` may be abstract); None when it runs none (disjoint
        devices and nothing to cast: the copy is a transfer)."""
        if self._sync_program is None:
            return None
        return self._sync_program.lower(self.actor_params_of(state))

    def staging_shardings(self) -> Any:
        """The generation layout laid over the training devices (`rpegjax.runtime.transfers.layout_on`): what
        `staged_sync` outputs, so that a transfer moves whole generation shards to the generation processes."""
        return transfers.layout_on(self.sampler.params_sharding, list(self.learner.placement.mesh.devices.flat))

    def generation_shapes(self) -> Any:
        """Shapes and dtypes of the generation copy of the actor weights (computed abstractly: no program runs)."""
        return jax.eval_shape(self._cast, self.learner.actor_params(self.learner.params))

    def abstract_copy(self) -> Any:
        """The generation copy as abstract arrays in the sampler's layout: what generation programs are lowered with."""
        shapes = self.generation_shapes()
        if self.sampler.params_sharding is None:
            return shapes
        return with_shardings(shapes, self.sampler.params_sharding)

    def _copy_program(self, shardings: Any) -> Callable:
        key = id(shardings)
        if key not in self._copies:
            self._copies[key] = (shardings, jax.jit(self._cast, out_shardings=shardings))  # holds `shardings` alive
        return self._copies[key][1]

    def copy_actor(self, state: Any, shardings: Any) -> Any:
        """The generation copy of the actor weights of `state` (as `sync` computes it) laid out as `shardings`
        on the training devices (e.g. a sampler of held-out evaluation there); one program per layout."""
        return self._copy_program(shardings)(self.actor_params_of(state))

    def lower_copy(self, state: Any, shardings: Any) -> jax.stages.Lowered:
        """The program `copy_actor(state, shardings)` runs, lowered (`state` may be abstract)."""
        return self._copy_program(shardings).lower(self.actor_params_of(state))

    def staged_sync(self, state: Any) -> Any:
        """The generation copy of the actor weights of `state` in `staging_shardings` (on the training devices),
        computed as `sync` computes it: a disaggregated run over process groups sends it to the generation
        processes."""
        self.dispatches += 1
        return self.copy_actor(state, self._staging_layout())

    def lower_staged_sync(self, state: Any) -> jax.stages.Lowered:
        """The program `staged_sync(state)` runs, lowered (`state` may be abstract)."""
        return self.lower_copy(state, self._staging_layout())

    def _staging_layout(self) -> Any:
        if self._staging is None:  # one object: `copy_actor` keeps one program per layout object
            self._staging = self.staging_shardings()
        return self._staging
