"""The dense projections every layer kind builds its parameters from: initialisation, LoRA adapters beside a kernel,
and the matmul that gathers a sharded kernel and adds its adapter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from rpegjax.models.config import ModelConfig
from rpegjax.models.gathered_matmul import gathered_matmul
from rpegjax.models.lora import Adapter, LoRAConfig, LoRATarget, adapter_name, target_key
from rpegjax.options import RematPolicy
from rpegjax.sharding.rules import ActivationSharding


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, fan_in: int) -> nnx.Param:
    """A kernel drawn from N(0, 1 / fan_in)."""
    value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(value.astype(dtype), logical_axes=logical)


def zeros(shape, logical, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=logical)


def add_adapters(module: nnx.Module, targets: tuple[LoRATarget, ...], lora: LoRAConfig | None, in_dims: dict,
                 rngs: nnx.Rngs) -> None:
    """Puts an `Adapter` beside each targeted kernel of `module` (`q_proj` -> `q_proj_lora`); `in_dims[target]`
    is how many leading dims of that kernel are its input."""
    if lora is None:
        return
    for target in targets:
        if target not in lora.targets:
            continue
        kernel = getattr(module, f"{target.value}_proj")
        shape, logical = kernel.get_value().shape, kernel.get_metadata()["logical_axes"]
        n = in_dims[target]
        setattr(module, adapter_name(target), Adapter(shape[:n], shape[n:], logical[:n], logical[n:], lora,
                                                      kernel.get_value().dtype, rngs=rngs))


def regathers(cfg: ModelConfig) -> bool:
    """Whether the dense projections gather their kernels again in the backward (`adapted_matmul`): in the layer scan
    without remat. Under remat the recomputation gathers them already, and the DOTS policy sees no dot inside a
    custom VJP: it would recompute the projections it exists to keep (W-plan 7B update: 21% more matmul FLOPs)."""
    return cfg.scan_layers and cfg.remat is RematPolicy.NONE


def adapted_matmul(module: nnx.Module, name: str, x: Float[Array, "n i"], dtype, sharding: ActivationSharding | None,
                   dropout_key: Array | None = None) -> Array:
    """x W for x [n, i] and `module.name`'s kernel W (its leading dims hold the i inputs) cast to the compute `dtype`,
    plus s (x A) B when `name` is adapted (its input under LoRA dropout when the layer's `dropout_key` is given).

    Under an activation sharding W is gathered whole over its embedding dim's data-like axes
    (`ActivationSharding.gathered_weight`). In the layer scan without remat (`module.regather`, `regathers`) the
    backward gathers it again from the shard (`gathered_matmul`) rather than keeping the gathered copy as a stacked
    residual. Unrolled layers keep the autodiff of one gather: there XLA:CPU's scheduler hoists every gather to the
    program's start, so a second gather in the backward doubles what stays live (tried: the per-layer growth of the
    temporaries went from one layer's weights to two)."""
    variable = getattr(module, name)
    w, logical = variable.get_value(), tuple(variable.get_metadata()["logical_axes"])
    if sharding is not None and module.regather:
        y = gathered_matmul(x, w, dtype, sharding, logical, name)
    else:
        kernel = w.astype(dtype) if sharding is None else sharding.gathered_weight(w.astype(dtype), logical, name=name)
        y = x @ kernel.reshape(x.shape[-1], -1)
    adapter = getattr(module, f"{name}_lora", None)
    if adapter is None:
        return y
    key = None if dropout_key is None else target_key(dropout_key, LoRATarget(name.removesuffix("_proj")))
    return y + adapter(x, dtype, key)
