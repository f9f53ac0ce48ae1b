"""The layer stack under full rematerialisation with a hand-written backward: the layers' parameters are stacked
only for the backward loop, whose buffer also takes their gradients.

Differentiating `lax.scan(jax.checkpoint(layer), x, stacked)` over the per-layer parameters stacked (as their
compute-dtype casts) keeps that stack from before the forward loop to the end of the backward one: through the
forward loop and whatever runs between the loops (the update's log-prob head), beside the kept layer inputs; and the
backward loop holds a second stacked buffer, the gradients being written (layer l's at step l). Here:

- the forward loop reads layer l's parameters from the caller's per-layer arrays (`lax.switch` on l, cast per
  layer by `cast`): no stack;
- the backward stacks them once the output's cotangent has arrived (an optimization barrier on the parameters, the
  kept inputs and that cotangent orders the stack after the forward loop and the head's backward);
- at backward step l the parameters of layers > l have been read for the last time and the gradients of layers < l
  are not written yet, so one buffer holds both: the backward overwrites slice l of the stack with layer l's
  gradients once it has used them, and the stack's transpose (unstack, cast back) gives the per-layer gradients.

For the 7B update (`rpegjax.models.stack_scan.compute_kernels`: bf16 kernels) that is one bf16 copy of the
layers' weights less in the backward loop and none in the forward loop or at the head (docs/benchmarks.md,
"W-long").

The forward keeps each layer's input (what full remat keeps); the backward recomputes layer l from it and takes the
vjp, as `jax.checkpoint` with `nothing_saveable` does, so the gradients are the same.

With `runs` = n > 1 the layers run in n consecutive runs, each with its own forward and backward loop and its
own kept-inputs buffer. Run k's backward (k = n..1) stacks run k's parameters only once the cotangent of run k's
output has arrived, and its kept inputs are freed when it ends; the runs done keep their gradients in compute dtype
until the last backward loop (an optimization barrier), then cast back. Backward run k holds the kept inputs of runs
1..k and the stacks of runs k..n: at most the kept inputs and 1/n of the stack, or the stack and 1/n of the kept
inputs, where one run holds both whole (7B update at 16k, fsdp8: 1.2 GiB less per device; docs/benchmarks.md,
"W-long"). Each run compiles its own layer body.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# layer(x, params of one layer, per-layer inputs, shared inputs) -> x
LayerFn = Callable[[Array, Any, Any, Any], Array]
# cast(params of one layer) -> those parameters as the layer reads them (e.g. kernels as their compute-dtype casts)
CastFn = Callable[[Any], Any]


def remat_scan(layer: LayerFn, cast: CastFn, x: Float[Array, "b t d"], params: list[Any], per_layer: Any,
               shared: Any, *, runs: int = 1) -> Float[Array, "b t d"]:
    """x after every layer: `layer(x, cast(params[l]), per_layer[l], shared)` for l = 0..L-1, where `params` holds
    one pytree per layer, `per_layer` is a pytree stacked on axis 0 (L layers) and `cast` is differentiable.
    Differentiable in `x` and `params`; `per_layer` and `shared` (positions, masks, keys, layer indices) are not
    (their cotangents are zero).

    `runs` (1 to L) splits the layers into that many consecutive runs of near-equal length, each with its own
    forward and backward loop (one compiled layer body per run): a run's kept inputs are freed once its backward
    has run, and only then is the next run's stack built (module docstring)."""
    if not 1 <= runs <= len(params):
        raise ValueError(f"remat_scan: runs={runs} must be between 1 and the {len(params)} layers")
    bounds = tuple(round(i * len(params) / runs) for i in range(runs + 1))
    return _remat_scan(layer, cast, bounds, x, params, per_layer, shared)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _remat_scan(layer: LayerFn, cast: CastFn, bounds: tuple[int, ...], x, params, per_layer, shared):
    return _forward(layer, cast, bounds, x, params, per_layer, shared)[0]


def _run(tree: Any, lo: int, hi: int) -> Any:
    """Layers lo..hi-1 of a pytree stacked on axis 0."""
    return jax.tree.map(lambda a: a[lo:hi], tree)


def _stack(cast: CastFn, params: list[Any]) -> Any:
    return jax.tree.map(lambda *values: jnp.stack(values), *(cast(p) for p in params))


def _forward(layer: LayerFn, cast: CastFn, bounds, x, params, per_layer, shared):
    """The output and each run's kept inputs (one buffer per run)."""
    kept = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        run = params[lo:hi]
        branches = [functools.partial(lambda l, run: cast(run[l]), l) for l in range(len(run))]

        def body(x, inputs, branches=branches, run=run):
            index, layer_inputs = inputs
            # layer `index`'s own arrays, cast: a stack of every layer's would stay live through the loop
            layer_params = jax.lax.switch(index, branches, run)
            return layer(x, layer_params, layer_inputs, shared), x

        x, inputs = jax.lax.scan(body, x, (jnp.arange(hi - lo), _run(per_layer, lo, hi)))
        kept.append(inputs)
    return x, kept


def _remat_scan_fwd(layer: LayerFn, cast: CastFn, bounds, x, params, per_layer, shared):
    out, kept = _forward(layer, cast, bounds, x, params, per_layer, shared)
    return out, (kept, params, per_layer, shared)


def _backward_run(layer: LayerFn, cast: CastFn, g_x, inputs, params, per_layer, shared):
    """One run's backward loop: g_x of the run's input and its parameters' gradients, stacked in compute dtype (the
    buffer that held their casts), with the map back to the parameters' own dtypes."""
    # stacked only now, after the later runs' backward (the output's cotangent) and the head
    params, inputs, g_x = jax.lax.optimization_barrier((params, inputs, g_x))
    stacked, unstack = jax.vjp(functools.partial(_stack, cast), params)

    def step(carry, index):
        g_x, buffer = carry
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=index, axis=0, keepdims=False)
        layer_inputs = jax.tree.map(take, per_layer)
        _, vjp = jax.vjp(lambda p, x: layer(x, p, layer_inputs, shared), jax.tree.map(take, buffer), take(inputs))
        g_params, g_x = vjp(g_x)
        # slice `index` of the buffer was this layer's parameters, read for the last time above
        buffer = jax.tree.map(lambda b, g: jax.lax.dynamic_update_index_in_dim(b, g.astype(b.dtype), index, 0),
                              buffer, g_params)
        return (g_x, buffer), None

    (g_x, g_stacked), _ = jax.lax.scan(step, (g_x, stacked), jnp.arange(len(params)), reverse=True)
    return g_x, g_stacked, unstack


def _remat_scan_bwd(layer: LayerFn, cast: CastFn, bounds, residuals, g_out):
    kept, params, per_layer, shared = residuals
    g_x, runs = g_out, []
    for run, (lo, hi) in reversed(list(enumerate(zip(bounds[:-1], bounds[1:], strict=True)))):
        g_x, g_stacked, unstack = _backward_run(layer, cast, g_x, kept[run], params[lo:hi],
                                                _run(per_layer, lo, hi), shared)
        runs.insert(0, (g_stacked, unstack))
    # the runs' gradients stay in compute dtype until the last backward loop has run (cast back earlier, the runs
    # done would hold float32 gradients, twice the bytes, through the remaining loops)
    g_stacks, g_x = jax.lax.optimization_barrier(([g for g, _ in runs], g_x))
    g_params = [g for (_, unstack), g_stacked in zip(runs, g_stacks, strict=True) for g in unstack(g_stacked)[0]]
    return g_x, g_params, None, None  # None: zero cotangents (positions, masks, keys, indices)


_remat_scan.defvjp(_remat_scan_fwd, _remat_scan_bwd)
