"""The full-sequence layer stack, unrolled (each layer optionally rematerialised) or as `lax.scan`s.

A stack of one kind scans one layer body over every layer. A stack of several kinds (Gemma 3's five sliding layers
and one global, Qwen3.5's three linear and one full) is cut into segments of one repeated unit
(`kinds.stack_segments`), and each segment scans its unit: one compiled body of the unit's layers, each layer
rematerialised on its own, so a backward step holds one layer's recomputed activations as in a one-kind stack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

from rpegjax.models.kinds import StackSegment, stack_segments
from rpegjax.models.layer_scan import remat_scan
from rpegjax.models.lora import LoRAParam
from rpegjax.models.mlp import MLP
from rpegjax.models.moe import Routing, SparseMoE
from rpegjax.options import RematPolicy, remat_runs
from rpegjax.sharding.rules import ActivationSharding

# What a rematerialised layer saves: DOTS keeps the 2-D projection and MLP matmuls' outputs (not attention's
# batched [t, t] products, which would undo the point of blockwise attention); FULL keeps only the layer input.
REMAT_POLICIES = {
    RematPolicy.DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    RematPolicy.FULL: jax.checkpoint_policies.nothing_saveable,
}


def remat_layer(policy: RematPolicy, sharding: ActivationSharding | None):
    """`apply(layer, x, rope, mask, dropout_key, expert_ids, segment_ids) -> (x, routing)` of one full-sequence layer,
    rematerialised unless policy is NONE (the recomputation redraws the same dropout masks: the key is an input).

    `jax.checkpoint` of a pure function of the layer's state, not `nnx.remat`: the latter writes the state back into
    the layer's variables, which fails when they come from different traces (a LoRA model's adapters traced by the
    gradient, its frozen base by the enclosing jit)."""

    def apply(layer, x, rope, mask, dropout_key, expert_ids=None, segment_ids=None):
        out, _, routing = layer(x, rope, mask, None, None, sharding, dropout_key, expert_ids, segment_ids)
        return out, routing

    if policy is RematPolicy.NONE:
        return apply

    def rematerialised(layer, x, rope, mask, dropout_key, expert_ids=None, segment_ids=None):
        graphdef, state = nnx.split(layer)

        def pure(state, x, rope, mask, dropout_key, expert_ids, segment_ids):
            return apply(nnx.merge(graphdef, state), x, rope, mask, dropout_key, expert_ids, segment_ids)

        return jax.checkpoint(pure, policy=REMAT_POLICIES[policy])(state, x, rope, mask, dropout_key, expert_ids,
                                                                   segment_ids)

    return rematerialised


def scan_layers(layers: nnx.List, x, ropes: Sequence, mask, policy: RematPolicy, sharding: ActivationSharding | None,
                dropout_key: Array | None = None, expert_ids: Array | None = None,
                segment_ids: Array | None = None, *, compute_dtype=None,
                sparse: Sequence[int] = ()) -> tuple[Array, Routing | None]:
    """The full-sequence layer stack as `lax.scan`s over the layers' parameters stacked at trace time; `ropes[l]`:
    layer l's RoPE tables, `sparse`: the indices of the layers that route to experts.

    One compiled body per segment, whatever the depth; and under remat the recomputation lives inside the backward
    loop's iterations, where no scheduler can hoist it next to the forward (with unrolled layers XLA's CPU
    scheduler does, keeping every layer's activations alive). Parameters stay per layer in the model, so
    checkpoints and the Hugging Face layout are unchanged; the stacking costs one copy of the layer weights, made
    of the dense projections' kernels in `compute_dtype` (`compute_kernels`). Under full remat a dense stack without
    adapters runs through `remat_scan` instead: its forward loop reads each layer's own parameters (no copy) and
    only its backward loop stacks them, in a buffer that also takes their gradients.
    With `dropout_key`, layer l's LoRA dropout key is fold_in(dropout_key, l), as in the unrolled stack.
    Returns the output and (for sparse layers) their routing stacked as `Decoder.routed_hidden_states` gives it;
    `expert_ids` [b t s k] replays one routing per sparse layer.
    """
    # layers of one kind with one RoPE setting share a body (the tables are compared by identity: one per setting)
    kinds = tuple((type(layer.attention), type(layer.mlp), id(rope)) for layer, rope in zip(layers, ropes, strict=True))
    segments = stack_segments(kinds)
    if policy is RematPolicy.FULL and _dense_without_adapters(layers):
        cast = functools.partial(compute_kernels, dtype=compute_dtype, dense_mlp=True)
        for segment in segments:
            x = _remat_scan_segment(layers, segment, cast, x, ropes, mask, sharding, segment_ids)
        return x, None
    if len(segments) == 1 and len(segments[0].unit) == 1:  # one kind: the layer body itself
        return _scan_one_kind(layers, x, ropes[0], mask, policy, sharding, dropout_key, expert_ids, segment_ids,
                              compute_dtype)
    routings: dict[int, Routing] = {}
    for segment in segments:
        x, routed = _scan_segment(layers, segment, x, ropes, mask, policy, sharding, dropout_key, expert_ids,
                                  segment_ids, compute_dtype, tuple(sparse))
        routings.update(routed)
    if not routings:
        return x, None
    ordered = [routings[index] for index in sorted(routings)]
    return x, jax.tree.map(lambda *r: jnp.stack(r, axis=2), *ordered)


def _stacked_kernels(layers: Sequence, dtype):
    return jax.tree.map(lambda *values: jnp.stack(values),
                        *(compute_kernels(nnx.state(layer), dtype, isinstance(layer.mlp, MLP)) for layer in layers))


def _scan_one_kind(layers, x, rope, mask, policy, sharding, dropout_key, expert_ids, segment_ids, compute_dtype):
    """Every layer one kind: one scan over the stacked layers, the body checkpointed as a whole."""
    graphdef = nnx.graphdef(layers[0])
    stacked = _stacked_kernels(layers, compute_dtype)

    def body(x, layer):
        state, index, ids = layer
        layer_key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        out, _, routing = nnx.merge(graphdef, state)(x, rope, mask, None, None, sharding, layer_key, ids, segment_ids)
        return out, routing

    if policy is not RematPolicy.NONE:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[policy])
    indices = None if dropout_key is None else jnp.arange(len(layers), dtype=jnp.uint32)
    per_layer_ids = None if expert_ids is None else jnp.moveaxis(expert_ids, 2, 0)
    out, routing = jax.lax.scan(body, x, (stacked, indices, per_layer_ids))
    return out, jax.tree.map(lambda r: jnp.moveaxis(r, 0, 2), routing)


def _scan_segment(layers, segment: StackSegment, x, ropes, mask, policy, sharding, dropout_key, expert_ids,
                  segment_ids, compute_dtype, sparse: tuple[int, ...]) -> tuple[Array, dict[int, Routing]]:
    """One segment: a scan over the repeats of its unit, each unit layer checkpointed on its own. Returns the output
    and the routing of each of the segment's sparse layers, by layer index."""
    size = len(segment.unit)
    members = [list(range(segment.start + j, segment.stop, size)) for j in range(size)]  # unit position -> layers
    graphdefs = [nnx.graphdef(layers[m[0]]) for m in members]
    stacked = [_stacked_kernels([layers[i] for i in m], compute_dtype) for m in members]
    indices = [jnp.asarray(m, jnp.uint32) for m in members]
    ids = [None if expert_ids is None or m[0] not in sparse
           else jnp.moveaxis(expert_ids[:, :, [sparse.index(i) for i in m]], 2, 0) for m in members]

    def sub_layer(j):
        def apply(x, state, index, layer_ids):
            layer_key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
            out, _, routing = nnx.merge(graphdefs[j], state)(x, ropes[members[j][0]], mask, None, None, sharding,
                                                             layer_key, layer_ids, segment_ids)
            return out, routing

        return apply if policy is RematPolicy.NONE else jax.checkpoint(apply, policy=REMAT_POLICIES[policy])

    applies = [sub_layer(j) for j in range(size)]

    def body(x, unit):
        routings = []
        for j, (state, index, layer_ids) in enumerate(unit):
            x, routing = applies[j](x, state, index, layer_ids)
            routings.append(routing)
        return x, routings

    x, routings = jax.lax.scan(body, x, list(zip(stacked, indices, ids, strict=True)))
    routed = {}
    for j, routing in enumerate(routings):
        if routing is not None:
            for r, index in enumerate(members[j]):
                routed[index] = jax.tree.map(lambda a, r=r: a[r], routing)
    return x, routed


def _dense_without_adapters(layers: nnx.List) -> bool:
    """Whether no layer routes to experts or carries LoRA adapters: `remat_scan`'s backward computes every stacked
    parameter's gradient (a LoRA model's frozen base needs none) and returns no routing."""
    return not any(isinstance(layer.mlp, SparseMoE) or any(isinstance(v, LoRAParam) for _, v in
                                                          nnx.to_flat_state(nnx.state(layer))) for layer in layers)


def _remat_scan_segment(layers, segment: StackSegment, cast: Callable[[nnx.State], nnx.State], x, ropes, mask,
                        sharding: ActivationSharding | None, segment_ids: Array | None) -> Array:
    """One segment of a dense stack under full remat through `rpegjax.models.layer_scan.remat_scan`: a unit's
    parameters (`cast` of each of its layers' states) are what the scan reads per repeat; only its backward stacks
    them, in a buffer that also takes their gradients. A unit of several layers checkpoints each of them, so the
    backward of one repeat recomputes one layer at a time. No dropout key: only LoRA adapters draw one."""
    size = len(segment.unit)
    graphdefs = [nnx.graphdef(layers[segment.start + j]) for j in range(size)]
    # the tables go in with the shared inputs: `remat_scan`'s layer function is a static argument and must not
    # close over traced arrays
    shared = (tuple(ropes[segment.start + j] for j in range(size)), mask, segment_ids)

    def one(j, x, state, shared):
        unit_ropes, mask, segment_ids = shared
        out, _, _ = nnx.merge(graphdefs[j], state)(x, unit_ropes[j], mask, None, None, sharding, None, None,
                                                   segment_ids)
        return out

    runs = remat_runs(segment.repeats)
    if size == 1:
        states = [nnx.state(layers[i]) for i in range(segment.start, segment.stop)]
        return remat_scan(lambda x, state, _, shared: one(0, x, state, shared), cast, x, states, None, shared,
                          runs=runs)

    def unit(x, states, _, shared):
        for j, state in enumerate(states):
            x = jax.checkpoint(functools.partial(one, j), policy=REMAT_POLICIES[RematPolicy.FULL])(x, state, shared)
        return x

    states = [tuple(nnx.state(layers[segment.start + r * size + j]) for j in range(size))
              for r in range(segment.repeats)]
    return remat_scan(unit, lambda states: tuple(cast(state) for state in states), x, states, None, shared, runs=runs)


# The dense layers' projection kernels, which every use casts to the compute dtype first
_PROJECTIONS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def compute_kernels(state: nnx.State, dtype, dense_mlp: bool) -> nnx.State:
    """A layer's `state` with its dense projection kernels (the MLP's if `dense_mlp`, not experts) cast to the compute
    `dtype` (None: unchanged), before the scan stacks them: the layer body casts them to that dtype anyway, so the
    values and the gradients (the body's cotangents are in that dtype, cast back to the parameters' once, after the
    scan) are the same, and the stacked copy and its stacked gradient take half the bytes of float32 masters (7B:
    1.6 GiB each per device at fsdp8; docs/benchmarks.md, "W-long"). Norm scales, biases, adapters and experts stay
    as they are."""
    if dtype is None:
        return state
    cast = {(module, name) for module, names in _PROJECTIONS.items() for name in names
            if module != "mlp" or dense_mlp}

    def convert(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        return leaf.astype(dtype) if keys[:2] in cast and jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree_util.tree_map_with_path(convert, state)
