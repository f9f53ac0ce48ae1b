"""A model split once into graphdef + parameters, and where its parameters and batches live on a mesh.

Learners receive the mesh and rules explicitly; without a mesh everything stays on the default device
and jitted functions carry no sharding annotations.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rpegjax.learners.update import batch_sharding, replicated
from rpegjax.models.lora import LoRAConfig, LoRAParam
from rpegjax.models.transformer import Decoder
from rpegjax.sharding.rules import ActivationSharding, ShardingRules, check_param_shardings, param_shardings

Params = Any


@dataclasses.dataclass(frozen=True)
class ModelPlacement:
    graphdef: nnx.GraphDef
    mesh: Mesh | None
    param_shardings: Params | None  # NamedShardings, same tree as the params
    activations: ActivationSharding | None
    rows: NamedSharding | None  # batch arrays: rows over the data axes
    lora: LoRAConfig | None = None  # the model's adapters, if any
    base_graphdef: nnx.GraphDef | None = None  # a model with adapters: its base, run by `merge` on base params

    @classmethod
    def split(cls, model: Decoder, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> tuple[ModelPlacement, Params]:
        """Splits `model` into graphdef + params; with a mesh, computes shardings (rules default to
        `ShardingRules.fsdp_tp()`) and places the params (a copy when they move)."""
        graphdef, params = nnx.split(model)
        base_graphdef = None if model.lora is None else nnx.graphdef(model.without_lora())
        if mesh is None:
            if rules is not None:
                raise ValueError("sharding rules were given without a mesh")
            return cls(graphdef, None, None, None, None, model.lora, base_graphdef), params
        rules = ShardingRules.fsdp_tp() if rules is None else rules
        replicated_params = check_param_shardings(params, mesh, rules)
        if replicated_params:  # a large weight the rules meant to shard but whose dims the mesh does not divide
            warnings.warn(f"parameters left fully replicated on mesh {dict(mesh.shape)}: {replicated_params}", stacklevel=2)
        shardings = param_shardings(params, mesh, rules)
        placement = cls(graphdef, mesh, shardings, ActivationSharding(mesh, rules), batch_sharding(mesh, rules),
                        model.lora, base_graphdef)
        return placement, placement.place(params)

    def place(self, params: Params) -> Params:
        """Puts `params` (same tree as this model's) where the rules say; unchanged without a mesh.

        Abstract params (a model built under `nnx.eval_shape`) become ShapeDtypeStructs carrying their
        shardings, so that a learner can be lowered and compiled ahead of time with nothing allocated."""
        if self.mesh is None:
            return params
        if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params)):
            return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                                params, self.param_shardings)
        if len({device.process_index for device in self.mesh.devices.flat}) == jax.process_count():
            return jax.device_put(params, self.param_shardings)
        # a mesh of some processes only (one role's group in a run over process groups): each process builds its
        # own shards from its whole copy (alike in every process, by the same-decisions contract); a process of the
        # other role builds arrays without shards. A device_put would attempt a cross-process transfer, which
        # backends without one (CPU) refuse.
        return jax.tree.map(_place_in_group, params, self.param_shardings)

    def merge(self, params: Params) -> Decoder:
        """The model of `params`: this model's whole parameters, or (a model with adapters) its base's alone,
        which run as the base model (adapters off: the LoRA reference policy)."""
        if self.base_graphdef is not None and not has_adapters(params):
            return nnx.merge(self.base_graphdef, params)
        return nnx.merge(self.graphdef, params)

    @property
    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else replicated(self.mesh)


def has_adapters(params: Params) -> bool:
    """Whether a model's parameters include LoRA adapters."""
    return any(isinstance(variable, LoRAParam) for _, variable in nnx.to_flat_state(params))


def has_dropout(lora: LoRAConfig | None) -> bool:
    """Whether a model with adapters `lora` (None: none) draws LoRA dropout masks in its training forward."""
    return lora is not None and lora.dropout > 0


def jit_with_shardings(fn, in_shardings, out_shardings, *, mesh: Mesh | None, donate_argnums=()) -> Any:
    """`jax.jit` with explicit shardings on a mesh, plain `jax.jit` without one."""
    if mesh is None:
        return jax.jit(fn, donate_argnums=donate_argnums)
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums)


def _place_in_group(leaf: jax.Array, sharding: NamedSharding) -> jax.Array:
    if not sharding.addressable_devices:
        return jax.make_array_from_single_device_arrays(leaf.shape, sharding, [], dtype=leaf.dtype)
    if sharding.is_fully_addressable or (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable):
        return jax.device_put(leaf, sharding)  # within this process, or already on the group's mesh (a critic's trunk)
    host = np.asarray(leaf)
    return jax.make_array_from_callback(leaf.shape, sharding, lambda index: host[index], dtype=host.dtype)
