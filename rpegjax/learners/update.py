"""The update loop shared by every learner: epochs x mini-batches x micro-batches in one jitted function.

One call of the update consumes one batch of b rows:

    for epoch in 1..E:                        (lax.scan)
        for mini-batch j in 1..M:             (lax.scan; one optimiser step each)
            g = sum over micro-batches u of grad loss(params, micro-batch j,u)    (lax.scan)
            params, opt_state = optimiser(g)

Rows are dealt to micro-batches interleaved: row r = i*(M*U) + j*U + u goes to mini-batch j,
micro-batch u. When rows are sharded in contiguous blocks over the data axes, this split keeps
every micro-batch spread evenly over the same devices (no row moves between devices), and the split
does not depend on the mesh, so a sharded update computes exactly what an unsharded one does.

Losses are normalised by denominators computed over the whole mini-batch (see
`rpegjax.learners.losses.aggregate`), so the summed micro-batch gradients equal the mini-batch
gradient exactly, up to float rounding.

Random draws of the training forward (LoRA dropout): with a `seed`, micro-batch u of the optimiser step
with state.step = n gets the key fold_in(fold_in(key(seed), n), u). It depends on the step count the state
carries, not on the call, so a resumed run draws what an uninterrupted one does, and not on the mesh (JAX's
partitionable threefry), so a sharded update draws the masks an unsharded one does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Int

from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.optim import split_over_data
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ShardingRules, logical_to_spec

Params = Any
Metrics = dict[str, Array]
# loss(params, micro-batch, denominators, key) -> (loss, metrics); denominators come from `DenominatorFn`, key is the
# micro-batch's random key (None when the update has no seed)
LossFn = Callable[[Params, TrainBatch, Any, Array | None], tuple[Array, Metrics]]
DenominatorFn = Callable[[TrainBatch], Any]


@flax.struct.dataclass
class TrainState:
    """What an update replaces: parameters, optimiser state and the optimiser step count."""

    params: Params
    opt_state: optax.OptState
    step: Int[Array, ""]


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateLayout:
    """How one batch is consumed: `epochs` passes, each of `num_minibatches` optimiser steps, each
    accumulating gradients over `num_microbatches` micro-batches."""

    epochs: int = 1
    num_minibatches: int = 1
    num_microbatches: int = 1

    def __post_init__(self) -> None:
        for name in ("epochs", "num_minibatches", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"UpdateLayout.{name} must be a positive integer, got {value!r}")

    @property
    def optimizer_steps(self) -> int:
        return self.epochs * self.num_minibatches

    def check_batch(self, rows: int) -> None:
        parts = self.num_minibatches * self.num_microbatches
        if rows % parts:
            raise ValueError(
                f"a batch of {rows} rows does not split into num_minibatches={self.num_minibatches} x "
                f"num_microbatches={self.num_microbatches} equal micro-batches"
            )


def split_rows(batch: Any, layout: UpdateLayout) -> Any:
    """[b, ...] -> [M, U, b / (M U), ...] with row r = i*(M*U) + j*U + u at [j, u, i] (see module docstring)."""
    m, u = layout.num_minibatches, layout.num_microbatches

    def split(x: Array) -> Array:
        x = x.reshape(x.shape[0] // (m * u), m, u, *x.shape[1:])
        return jnp.moveaxis(x, 0, 2)

    return jax.tree.map(split, batch)


def _combine(metrics: Metrics, *, additive: bool = False) -> Metrics:
    """Reduces metrics stacked on axis 0: max for `*_max`, min for `*_min`, mean otherwise; with
    `additive`, sum for `*_loss` (loss terms normalised over the whole mini-batch, summed over its
    micro-batches)."""
    reducers = {"_max": jnp.max, "_min": jnp.min}
    if additive:
        reducers["_loss"] = jnp.sum
    out = {}
    for key, value in metrics.items():
        reduce = next((fn for suffix, fn in reducers.items() if key.endswith(suffix)), jnp.mean)
        out[key] = reduce(value, axis=0)
    return out


def accumulate_gradients(
    loss_fn: LossFn, params: Params, micro_batches: TrainBatch, denominators: Any, key: Array | None = None
) -> tuple[Params, Array, Metrics]:
    """Sum over the leading (micro-batch) axis of grad loss_fn; returns (gradients, summed loss, metrics).
    Micro-batch u's loss gets the key fold_in(key, u) (None without a key)."""

    def micro_step(total, micro):
        micro, index = micro
        micro_key = None if key is None else jax.random.fold_in(key, index)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, micro, denominators, micro_key)
        return jax.tree.map(jnp.add, total, grads), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    count = jax.tree.leaves(micro_batches)[0].shape[0]
    indices = None if key is None else jnp.arange(count, dtype=jnp.uint32)
    grads, (losses, metrics) = jax.lax.scan(micro_step, zeros, (micro_batches, indices))
    return grads, jnp.sum(losses), _combine(metrics, additive=True)


def make_update(
    loss_fn: LossFn,
    denominator_fn: DenominatorFn,
    optimizer: optax.GradientTransformation,
    layout: UpdateLayout,
    *,
    learning_rate_fn: Callable[[Array], Array] | None = None,
    micro_batch_sharding: NamedSharding | None = None,
    seed: int | None = None,
    rows_per_micro_batch: int | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """The pure `update(state, batch) -> (state, metrics)` to jit; metrics are averaged over optimiser
    steps (max/min for `*_max`/`*_min`) and include loss, grad_norm (before clipping) and learning_rate.
    `seed`: the loss receives random keys drawn from it by step and micro-batch (module docstring); None:
    the loss receives None. `rows_per_micro_batch` (packed batches, `rpegjax.learners.packing`): micro-batches
    of this many rows, as many as the batch holds, in place of `layout.num_microbatches`."""

    def minibatch_step(state: TrainState, minibatch: TrainBatch) -> tuple[TrainState, Metrics]:
        rows = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), minibatch)
        denominators = denominator_fn(rows)
        if micro_batch_sharding is not None:
            minibatch = constrain_micro_batches(minibatch, micro_batch_sharding)
        key = None if seed is None else jax.random.fold_in(jax.random.key(seed), state.step)
        grads, loss, metrics = accumulate_gradients(loss_fn, state.params, minibatch, denominators, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        if learning_rate_fn is not None:
            metrics["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    def update(state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
        rows = batch.tokens.shape[0]
        this_layout = layout
        if rows_per_micro_batch is not None:
            micro = rows // (layout.num_minibatches * rows_per_micro_batch)
            this_layout = dataclasses.replace(layout, num_microbatches=max(micro, 1))
        this_layout.check_batch(rows)
        minibatches = split_rows(batch, this_layout)

        def epoch(state, _):
            return jax.lax.scan(minibatch_step, state, minibatches)

        state, metrics = jax.lax.scan(epoch, state, None, length=this_layout.epochs)
        return state, _combine(jax.tree.map(lambda x: x.reshape(-1), metrics))

    return update


def _row_axes(sharding: NamedSharding) -> tuple[tuple[str, ...], int]:
    """The mesh axes that split rows (dim 0) under `sharding`, and how many shards they make."""
    spec = sharding.spec[0] if sharding.spec else None
    names = (spec,) if isinstance(spec, str) else tuple(spec or ())
    shards = 1
    for name in names:
        shards *= sharding.mesh.shape[name]
    return names, shards


def constrain_micro_batches(minibatch: TrainBatch, sharding: NamedSharding) -> TrainBatch:
    """Keeps each micro-batch's rows sharded over the data axes (axis 1 of [U, m, ...]) when they divide m."""
    names, shards = _row_axes(sharding)

    def constrain(x: Array) -> Array:
        if x.shape[1] % shards:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, PartitionSpec(None, names)))

    return jax.tree.map(constrain, minibatch)


# ---- shardings ---------------------------------------------------------------------------------


def batch_sharding(mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    """Rows over the mesh axes the activation rules give the batch axis; every other dim replicated."""
    return NamedSharding(mesh, logical_to_spec((axes.BATCH,), rules.activations, mesh))


def row_shards(sharding: NamedSharding | None) -> int:
    """How many shards the rows of a batch with `sharding` are split into (1 without a mesh)."""
    return 1 if sharding is None else _row_axes(sharding)[1]


def check_rows_divide(rows: int, sharding: NamedSharding | None, where: str) -> None:
    """Raises ValueError when `rows` does not split evenly over the mesh axes that shard rows."""
    if sharding is None:
        return
    names, shards = _row_axes(sharding)
    if rows % shards:
        raise ValueError(f"{where}: a batch of {rows} rows cannot be split over mesh axes {names} ({shards} shards)")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def train_state_shardings(
    optimizer: optax.GradientTransformation, params: Params, params_shardings: Params, mesh: Mesh, *,
    data_axes: tuple[str, ...] = (),
) -> TrainState:
    """Shardings of a TrainState: every optimiser buffer that mirrors a parameter (Adam's mu and nu, also
    inside `optax.multi_transform` or masked states) takes that parameter's sharding, also split over the mesh
    axes `data_axes` (ZeRO-1, `rpegjax.learners.optim.split_over_data`; empty: not); the rest (step
    counts) is replicated. A buffer mirrors a parameter when the parameter's key path ends its own key
    path and the shapes agree."""
    by_path = {
        tuple(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params_shardings), strict=True
        )
    }

    def sharding_of(path, leaf) -> NamedSharding:
        path = tuple(path)
        for start in range(len(path)):
            match = by_path.get(path[start:])
            if match is not None and tuple(match[0]) == tuple(leaf.shape):
                return split_over_data(match[1], leaf.shape, data_axes)
        return replicated(mesh)

    shapes = jax.eval_shape(optimizer.init, params)
    opt_shardings = jax.tree_util.tree_map_with_path(sharding_of, shapes)
    return TrainState(params=params_shardings, opt_state=opt_shardings, step=replicated(mesh))


def make_init(
    optimizer: optax.GradientTransformation, shardings: TrainState | None = None
) -> Callable[[Params], TrainState]:
    """A jitted `init(params) -> TrainState` (optimiser initialised, step 0, fresh buffers), placed with
    `shardings` when given. Build it once: each build compiles anew."""

    def build(params):
        # fresh buffers: the update donates the state, and `params` may still be in use (e.g. as the reference)
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))

    if shardings is None:
        return jax.jit(build)
    jitted = jax.jit(build, in_shardings=(shardings.params,), out_shardings=shardings)
    return lambda params: jitted(jax.device_put(params, shardings.params))
