"""Weight sync: parameters from the training layout to the generation layout (the graph's weight_sync stage).

Training usually shards parameters over FSDP and tensor axes; generation wants them replicated over the
slots' data axis and split over heads on the tensor axis, so every decode step reads local weights
and only the attention/MLP outputs are reduced; a mixture-of-experts model's experts stay split over the
`expert` axis (each device reads its own experts; tokens travel to them). The two layouts may live on different meshes (colocated
or disaggregated stages); `jax.device_put` moves and reshards in one call either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rpegjax.sharding import axes
from rpegjax.sharding.rules import ShardingRules, param_shardings


def generation_rules(
    *,
    batch_axes: tuple[str, ...] = (axes.DATA_AXIS, axes.FSDP_AXIS, axes.EXPERT_AXIS),
    tensor_axis: str = axes.TENSOR_AXIS,
) -> ShardingRules:
    """Tensor parallelism over heads, KV heads, MLP and vocabulary; slots (batch) over `batch_axes`;
    nothing sharded over the embedding dimension, so a decode step gathers no weights.

    Every mesh axis that is not the tensor axis should be a batch axis (`generation_batch_axes`):
    an axis left out would hold a full copy of every slot and repeat its decode work.

    Expert parallelism: the `expert` axis, a batch axis here, also splits a mixture-of-experts layer's experts
    (logical EXPERT, of the parameters and of the dispatched tokens), as training's `fsdp_tp` rules do: each device
    holds x/E experts and exchanges its slots' tokens with the devices holding their experts
    (`rpegjax.models.expert_parallel`). A dense model has no EXPERT axis: there it is a plain batch axis.
    """
    if tensor_axis in batch_axes:
        raise ValueError(f"generation_rules: batch_axes {batch_axes} must not contain the tensor axis {tensor_axis!r}")
    tensor = {axes.HEADS: tensor_axis, axes.KV_HEADS: tensor_axis, axes.MLP: tensor_axis, axes.VOCAB: tensor_axis}
    # the experts split only over an axis that splits the rows too: each expert shard dispatches its own slots
    experts = {axes.EXPERT: axes.EXPERT_AXIS} if axes.EXPERT_AXIS in batch_axes else {}
    return ShardingRules(params={**tensor, **experts},
                         activations={axes.BATCH: tuple(batch_axes), **tensor, **experts})


def generation_batch_axes(mesh: Mesh, *, tensor_axis: str = axes.TENSOR_AXIS) -> tuple[str, ...]:
    """The mesh axes slots split over in generation: all but the tensor axis, in mesh order."""
    return tuple(name for name in mesh.axis_names if name != tensor_axis)


def reshard_params(state: nnx.State, mesh: Mesh, rules: ShardingRules, *, dtype=None) -> nnx.State:
    """Places every parameter of `state` with the sharding `rules` give it on `mesh`.

    With `dtype` (e.g. jnp.bfloat16), floating-point parameters are also cast, on the target devices
    after the move, so the sampler can run lower precision than the training master weights.
    The result never shares buffers with `state` (even where the layouts already agree), so a learner
    update that donates the training parameters cannot invalidate the generation copy.
    """
    shardings = param_shardings(state, mesh, rules)
    moved = jax.device_put(state, shardings, may_alias=False)
    if dtype is None:
        return moved

    def cast(s):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, s)

    return jax.jit(cast, out_shardings=shardings)(moved)
