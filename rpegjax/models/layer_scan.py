"""The layer stack under full rematerialisation with a hand-written backward that writes each layer's parameter
gradients into the buffer of the stacked parameters it has finished reading.

Differentiating `lax.scan(jax.checkpoint(layer), x, stacked)` keeps two stacked buffers through the backward loop:
the stacked parameters (every remaining layer's forward is recomputed from them) and the stacked gradients being
written (layer l's at step l). At step l the parameters of layers > l are read for the last time and the gradients
of layers < l are not written yet, so one buffer holds both: `remat_scan`'s backward starts from the stacked
parameters and overwrites slice l with layer l's gradients once it has used them. For the 7B update (compute-dtype
kernels stacked, `rpegjax.models.transformer._compute_kernels`) that is one bf16 copy of the layers' weights less at
the backward's peak (docs/benchmarks.md, issue 25 session 11).

The forward keeps each layer's input (what full remat keeps); the backward recomputes layer l from it and takes the
vjp, as `jax.checkpoint` with `nothing_saveable` does, so the gradients are the same.
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def remat_scan(layer: LayerFn, x: Float[Array, "b t d"], params: Any, per_layer: Any, shared: Any
               ) -> Float[Array, "b t d"]:
    """x after every layer: `layer(x, params[l], per_layer[l], shared)` for l = 0..L-1, where `params` and
    `per_layer` are pytrees stacked on axis 0 (L layers). Differentiable in `x` and `params`; `per_layer` and
    `shared` (positions, masks, keys, layer indices) are not (their cotangents are zero)."""
    return _forward(layer, x, params, per_layer, shared)[0]


def _forward(layer: LayerFn, x, params, per_layer, shared):
    def body(x, inputs):
        layer_params, layer_inputs = inputs
        return layer(x, layer_params, layer_inputs, shared), x

    return jax.lax.scan(body, x, (params, per_layer))


def _remat_scan_fwd(layer: LayerFn, x, params, per_layer, shared):
    out, inputs = _forward(layer, x, params, per_layer, shared)
    return out, (inputs, params, per_layer, shared)


def _remat_scan_bwd(layer: LayerFn, residuals, g_out):
    inputs, params, per_layer, shared = residuals

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

    layers = jax.tree.leaves(inputs)[0].shape[0]
    (g_x, g_params), _ = jax.lax.scan(step, (g_out, params), jnp.arange(layers), reverse=True)
    return g_x, g_params, None, None  # None: zero cotangents (positions, masks, keys, indices)


remat_scan.defvjp(_remat_scan_fwd, _remat_scan_bwd)
