"""Rules tables: logical axis -> mesh axes, for parameters and for activations.

A parallelism strategy is a `ShardingRules`; the planner chooses one, models only name logical axes.
A logical dimension that its mapped mesh axes do not divide is an error naming the array, dimension and
axes (replicating it silently would repeat that work on every device of those axes): pick a mesh or
shapes that divide. Mesh axes the mesh lacks or has at size 1 are skipped, so one table serves meshes
with and without, say, a `fsdp` axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.sharding import axes

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """Where each logical axis goes, separately for parameters and activations."""

    params: Mapping[str, MeshAxes]
    activations: Mapping[str, MeshAxes]

    def __hash__(self) -> int:  # hashable so that jit can take rules as a static argument
        return hash((tuple(sorted(self.params.items())), tuple(sorted(self.activations.items()))))

    @classmethod
    def fsdp_tp(cls, *, sequence_parallel: bool = False) -> ShardingRules:
        """FSDP over `fsdp` (parameters' embedding dim), tensor parallelism over `tensor`, batch over data x fsdp.

        A `context` axis (context parallelism) splits each row's sequence; weights are sharded over it as over
        `fsdp` (its devices hold different tokens of the same rows, like data-parallel ones). With
        `sequence_parallel` the residual stream between the tensor-parallel blocks is also split on its sequence
        over `tensor` (Megatron-style: all-gathered before the column-parallel projections, reduce-scattered after
        the row-parallel ones), so the layer inputs remat keeps are not repeated on every tensor device.

        An `expert` axis (expert parallelism) splits a mixture-of-experts layer's experts (logical EXPERT, of
        parameters and of the dispatched tokens: `rpegjax.models.expert_parallel`); for everything else it is
        data-like: rows split over it, and weights' embedding dim too (as over `fsdp`).
        """
        tensor, context, expert = axes.TENSOR_AXIS, axes.CONTEXT_AXIS, axes.EXPERT_AXIS
        return cls(
            params={
                axes.EXPERT: expert,
                axes.EMBED: (axes.FSDP_AXIS, context, expert),
                axes.MLP: tensor,
                axes.HEADS: tensor,
                axes.KV_HEADS: tensor,
                axes.VOCAB: tensor,
            },
            activations={
                axes.BATCH: (axes.DATA_AXIS, axes.FSDP_AXIS, expert),
                axes.EXPERT: expert,
                axes.SEQ: context,
                axes.RESIDUAL_SEQ: (context, tensor) if sequence_parallel else context,
                axes.HEADS: tensor,
                axes.KV_HEADS: tensor,
                axes.MLP: tensor,
                axes.VOCAB: tensor,
            },
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream's sequence is split over more mesh axes than the other activations'."""
        return _mesh_axes_tuple(self.activations.get(axes.RESIDUAL_SEQ)) != _mesh_axes_tuple(
            self.activations.get(axes.SEQ))


def _mesh_axes_tuple(value: MeshAxes) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def logical_to_spec(
    logical: Sequence[str | None],
    table: Mapping[str, MeshAxes],
    mesh: Mesh,
    shape: Sequence[int] | None = None,
    *,
    name: str = "array",
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec on `mesh`.

    Mesh axes absent from the mesh, of size 1, or already used by an earlier dimension are skipped.
    With `shape`, a dimension that the product of its mesh axes does not divide raises ValueError
    naming `name`, the dimension, its logical axis and the mesh axes.
    """
    if shape is not None and len(shape) != len(logical):
        raise ValueError(f"{name}: logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, logical_name in enumerate(logical):
        chosen = []
        for mesh_axis in _mesh_axes_tuple(table.get(logical_name) if logical_name else None):
            if mesh_axis not in mesh.shape or mesh.shape[mesh_axis] == 1 or mesh_axis in used:
                continue
            chosen.append(mesh_axis)
        if shape is not None and chosen:
            shards = math.prod(mesh.shape[a] for a in chosen)
            if shape[dim] % shards:
                raise ValueError(
                    f"{name} of shape {tuple(shape)}: dimension {dim} ({logical_name!r}, size {shape[dim]}) is not "
                    f"divisible by mesh axes {tuple(chosen)} ({shards} devices); change the mesh or the shape "
                    "rather than repeating that work on every device"
                )
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """PartitionSpecs for every variable of an NNX state, from its `logical_axes` metadata."""

    def spec_of(path, variable: nnx.Variable) -> nnx.Variable:
        logical = variable.get_metadata().get("logical_axes")
        if logical is None:
            spec = PartitionSpec()
        else:
            value = variable.get_value()
            if len(logical) != value.ndim:
                raise ValueError(f"logical axes {logical} do not match a parameter of shape {value.shape}")
            spec = logical_to_spec(logical, rules.params, mesh, value.shape, name=f"parameter {jax.tree_util.keystr(path)}")
        return variable.replace(spec)

    return jax.tree_util.tree_map_with_path(spec_of, state, is_leaf=_is_variable)


def param_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """NamedShardings for every variable of an NNX state (same tree as `state`)."""
    specs = param_specs(state, mesh, rules)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_state(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """Places every array of `state` with the sharding the rules give it."""
    return jax.device_put(state, param_shardings(state, mesh, rules))


def check_param_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules, *, min_size: int = 1 << 20) -> list[str]:
    """Lists the parameters of at least `min_size` elements that end up fully replicated on a mesh of
    several devices although their rules name a mesh axis: a start-up check that big weights are sharded."""
    problems = []
    if mesh.size == 1:
        return problems
    specs = param_specs(state, mesh, rules)
    for (path, variable), (_, spec) in zip(
        nnx.to_flat_state(state), nnx.to_flat_state(specs), strict=True
    ):
        value = variable.get_value()
        logical = variable.get_metadata().get("logical_axes") or ()
        wanted = any(rules.params.get(name) for name in logical if name)
        if value.size >= min_size and wanted and all(s is None for s in spec.get_value()):
            problems.append(f"{'/'.join(map(str, path))} {tuple(value.shape)} is replicated")
    return problems


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """Constrains activations at block boundaries; `None` in place of this object means no constraint."""

    mesh: Mesh
    rules: ShardingRules

    def spec(self, logical: Sequence[str | None], shape: Sequence[int] | None = None, *,
             name: str = "activation") -> PartitionSpec:
        return logical_to_spec(logical, self.rules.activations, self.mesh, shape, name=name)

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int] | None = None, *,
                 name: str = "activation") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape, name=name))

    def mesh_axes(self, logical: str) -> tuple[str, ...]:
        """The mesh axes (present, of size > 1) the activation rules split logical axis `logical` over."""
        return tuple(a for a in _mesh_axes_tuple(self.rules.activations.get(logical))
                     if a in self.mesh.shape and self.mesh.shape[a] > 1)

    def shards(self, logical: str) -> int:
        """How many ways the activation rules split logical axis `logical` on this mesh."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes(logical))

    def constrain(self, x: jax.Array, logical: Sequence[str | None], *, name: str = "activation") -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.sharding(logical, x.shape, name=name))

    def gathered_weight(self, w: jax.Array, logical: Sequence[str | None], *, name: str = "weight") -> jax.Array:
        """A weight (or its compute-dtype cast) `w` with parameter axes `logical`, gathered whole over the axes that
        split its embedding dim (fsdp, context, expert) and still split as the parameter rules say otherwise (over
        `tensor`): FSDP's all-gather, made explicit. Without it XLA's SPMD partitioner may instead all-gather a
        projection's activations over the rows (batch over fsdp) to meet the weight's embedding split: 32B at 32k
        on fsdp16 x tensor2 gathered every row's [b t, f/2] MLP activations, 13.5 GiB per device (cut to 2 layers,
        `benchmarks/bench_memory.py --target cuda-h100 --devices 32 --models 32b --tokens 32768 --layouts
        fsdp16xtp2sp --programs update --layers 2`: 29.34 GiB of temporaries without this constraint, 8.87 with it).
        The backward reduce-scatters the whole gradient to the shard."""
        table = {**self.rules.params, axes.EMBED: None}
        spec = logical_to_spec(logical, table, self.mesh, w.shape, name=name)
        return jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, spec))

    def sharded_weight(self, w: jax.Array, logical: Sequence[str | None], *, name: str = "weight") -> jax.Array:
        """A weight-shaped `w` (a gradient) with parameter axes `logical`, split as the parameter rules split that
        weight: a sum of per-device partials becomes a reduce-scatter where it is made, not a whole copy kept
        until the parameter's own sharding is met (docs/benchmarks.md, "W-long")."""
        spec = logical_to_spec(logical, self.rules.params, self.mesh, w.shape, name=name)
        return jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, spec))


def constrain(x: jax.Array, sharding: ActivationSharding | None, logical: Sequence[str | None]) -> jax.Array:
    """`sharding.constrain(x, logical)`, or `x` unchanged when there is no activation sharding."""
    return x if sharding is None else sharding.constrain(x, logical)
