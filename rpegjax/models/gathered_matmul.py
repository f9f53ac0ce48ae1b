"""A dense projection on an FSDP-sharded kernel that keeps the kernel's shard, not its gathered copy, for the
backward (ZeRO-3): the backward gathers the kernel again.

Differentiating `x @ gathered_weight(w)` keeps the gathered kernel as the matmul's residual from the layer's forward
until its backward; without remat every layer's gathered kernel stays live at once (the fsdp8 update of the NeMo-RL
Llama-3.1-8B one-step-off plan on the H100 target held 13.3 GB more temporaries per device that way: `scripts/plan.py
... --verify --verify-target cuda-h100`, docs/benchmarks.md "W-plan"). Here the residuals are x and the parameter `w` itself, which is live
anyway (and, in the layer scan, a slice of the scanned stack the scan forwards, not a stacked copy).

Meant for the layer scan without remat (`projections.regathers`): there the backward's gather sits in the backward
loop's iteration, where it is needed (under remat the recomputation gathers the kernel anyway).
Between unrolled layers nothing orders it after the forward (XLA:CPU's scheduler hoists every gather to the
program's start, doubling what the gathers keep live; an optimization barrier on the kernel and the output
gradient did not stop it), so unrolled layers keep autodiff's one gather.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from jaxtyping import Array, Float

from rpegjax.sharding.rules import ActivationSharding


def _gathered(w: Array, dtype, sharding: ActivationSharding, logical: Sequence[str | None], name: str) -> Array:
    return sharding.gathered_weight(w.astype(dtype), logical, name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def gathered_matmul(x: Float[Array, "n i"], w: Array, dtype, sharding: ActivationSharding,
                    logical: Sequence[str | None], name: str) -> Float[Array, "n o"]:
    """x W for x [n, i] and W = `w` cast to `dtype` and gathered whole over its embedding dim's data-like axes
    (`ActivationSharding.gathered_weight`; `logical`: w's parameter axes), W's leading dims holding the i inputs.
    The gradient of `w` is constrained to w's own sharding (a reduce-scatter) and returned in w's dtype."""
    return x @ _gathered(w, dtype, sharding, logical, name).reshape(x.shape[-1], -1)


def _forward(x, w, dtype, sharding, logical, name):
    return gathered_matmul(x, w, dtype, sharding, logical, name), (x, w)


def _backward(dtype, sharding, logical, name, residuals, dy):
    x, w = residuals
    kernel = _gathered(w, dtype, sharding, logical, name).reshape(x.shape[-1], -1)
    dx = dy @ kernel.T
    # the per-device partial sums laid out as the gathered kernel, then reduce-scattered to w's shard (what autodiff
    # of the gather does); constrained to the shard directly, the SPMD partitioner gathered x over the rows instead
    dw = sharding.gathered_weight((x.T @ dy).reshape(w.shape), logical, name=f"{name} gradient")
    dw = sharding.sharded_weight(dw, logical, name=f"{name} gradient")
    return dx.astype(x.dtype), dw.astype(w.dtype)


gathered_matmul.defvjp(_forward, _backward)
