"""LoRA: low-rank adapters on the attention and MLP projections.

A targeted projection with kernel W (ours is [in..., out...], e.g. q_proj [d, h, e], o_proj [h, e, d]) computes

    y = x W + s * (x A) B,        s = alpha / rank,

with A [in..., r] and B [r, out...]. In the training update's forward, with dropout p > 0 (PEFT's `lora_dropout`),
the adapter reads an inverted-dropout copy of its input, y = x W + s * (dropout_p(x) A) B: each element kept with
probability 1 - p and scaled by 1 / (1 - p), a fresh mask per adapter, layer, micro-batch and optimiser step drawn
from the key the update passes down (`Decoder.hidden_states(dropout_key=)`). Without a key (log-probs, the
reference, generation) and in merged weights there is no dropout. A starts random (normal, std 1/sqrt(in)) and B at zero, so a freshly
adapted model computes exactly what its base does. Only A and B are trained (`LoRAParam`, a subclass of
`nnx.Param` that filters pick out); the base weights stay frozen and serve as the reference policy with the
adapters switched off. The merged kernel W + s * A B (`merge_adapters`) gives the same function with the base
model's layout, for generation and for export as plain Hugging Face weights.

Sharding: A's input dims carry the base kernel's logical axes (FSDP over the embedding, tensor over heads of
o_proj), B's output dims the kernel's output axes; the rank dim is replicated.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


class LoRATarget(enum.StrEnum):
    """A projection that can carry an adapter (Hugging Face module names without `_proj`)."""

    Q = "q"
    K = "k"
    V = "v"
    O = "o"  # noqa: E741  (the attention output projection)
    GATE = "gate"
    UP = "up"
    DOWN = "down"


ATTENTION_TARGETS = (LoRATarget.Q, LoRATarget.K, LoRATarget.V, LoRATarget.O)
MLP_TARGETS = (LoRATarget.GATE, LoRATarget.UP, LoRATarget.DOWN)


class LoRAGeneration(enum.StrEnum):
    """Which weights the sampler decodes with when the policy carries adapters."""

    MERGED = "merged"  # the base model with W + s A B merged into the generation copy at each weight sync
    ADAPTERS = "adapters"  # the adapted model: every projection pays the two extra rank-r matmuls per token


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Adapters of rank `rank` on the `targets` projections of every layer, scaled by alpha / rank."""

    rank: int
    alpha: float = 16.0
    targets: tuple[LoRATarget, ...] = (*ATTENTION_TARGETS, *MLP_TARGETS)
    dropout: float = 0.0  # probability of dropping an adapter input element in the training forward

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAConfig.alpha must be a positive number, got {self.alpha!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        try:
            targets = tuple(LoRATarget(t) for t in targets)
        except ValueError:
            raise ValueError(f"LoRAConfig.targets must be among {[t.value for t in LoRATarget]}, "
                             f"got {list(self.targets)!r}") from None
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(f"LoRAConfig.targets must be non-empty and without repeats, got {list(self.targets)!r}")
        object.__setattr__(self, "targets", targets)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAConfig.dropout must be a probability in [0, 1), got {self.dropout!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRAParam(nnx.Param):
    """An adapter weight: the only parameters trained when a model carries adapters."""


def adapter_name(target: LoRATarget) -> str:
    """The attribute of the adapter of `target` beside its kernel (`q_proj` -> `q_proj_lora`)."""
    return f"{target.value}_proj_lora"


class Adapter(nnx.Module):
    """A [in..., r] and B [r, out...] of one projection whose kernel has shape `in_shape + out_shape`."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], in_axes: tuple[str | None, ...],
                 out_axes: tuple[str | None, ...], cfg: LoRAConfig, dtype: Any, *, rngs: nnx.Rngs):
        fan_in = math.prod(in_shape)
        a = jax.random.normal(rngs.params(), (*in_shape, cfg.rank), jnp.float32) / math.sqrt(fan_in)
        self.a = LoRAParam(a.astype(dtype), logical_axes=(*in_axes, None))
        self.b = LoRAParam(jnp.zeros((cfg.rank, *out_shape), dtype), logical_axes=(None, *out_axes))
        self.scale = cfg.scale
        self.dropout = cfg.dropout

    def __call__(self, x: Float[Array, "n i"], dtype: Any, dropout_key: Array | None = None) -> Float[Array, "n o"]:
        """s * (x A) B for x flattened to [n, prod(in)]; the output flattened to [n, prod(out)]. With `dropout_key`
        and dropout p > 0, x is replaced by x * keep / (1 - p), keep ~ Bernoulli(1 - p) per element from the key."""
        a, b = self.a.get_value().astype(dtype), self.b.get_value().astype(dtype)
        a = a.reshape(-1, a.shape[-1])
        if dropout_key is not None and self.dropout > 0:
            x = dropout_input(x, self.dropout, dropout_key)
        return (x @ a) @ (b.reshape(b.shape[0], -1) * jnp.asarray(self.scale, dtype))


def dropout_input(x: Float[Array, "n i"], rate: float, key: Array) -> Float[Array, "n i"]:
    """Inverted dropout: x * keep / (1 - rate), keep ~ Bernoulli(1 - rate) per element (in x's dtype)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def target_key(layer_key: Array, target: LoRATarget) -> Array:
    """The dropout key of one adapter from its layer's: independent masks for every target of a layer."""
    return jax.random.fold_in(layer_key, list(LoRATarget).index(target))


def adapter_delta(a: Array, b: Array, scale: float) -> Array:
    """s * A B with the kernel's shape in... + out...: what `merge_adapters` adds to a kernel, in float32."""
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    rank = a.shape[-1]
    delta = a32.reshape(-1, rank) @ b32.reshape(rank, -1) * scale
    return delta.reshape(*a.shape[:-1], *b.shape[1:])


def adapter_paths(state: nnx.State) -> list[tuple[tuple, tuple]]:
    """(adapter path, kernel path) of every adapter in a model's state, e.g.
    (('layers', 0, 'attention', 'q_proj_lora'), ('layers', 0, 'attention', 'q_proj'))."""
    found = []
    for path, _ in nnx.to_flat_state(state):
        if len(path) >= 2 and path[-1] == "a" and isinstance(path[-2], str) and path[-2].endswith("_lora"):
            found.append((path[:-1], (*path[:-2], path[-2].removesuffix("_lora"))))
    return found


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, base) of a model state: the `LoRAParam`s, and every other variable."""
    adapters, base = nnx.split_state(state, LoRAParam, ...)
    return adapters, base


def merge_adapters(state: nnx.State, scale: float) -> nnx.State:
    """The base state with every adapted kernel replaced by W + s * A B (cast back to W's dtype): the
    adapted model's function in the base model's layout. Runs under jit (e.g. in the weight sync)."""
    adapters, base = split_adapters(state)
    flat_adapters = dict(nnx.to_flat_state(adapters))
    merged = dict(nnx.to_flat_state(base))
    for adapter, kernel in adapter_paths(state):
        a, b = flat_adapters[(*adapter, "a")].get_value(), flat_adapters[(*adapter, "b")].get_value()
        w = merged[kernel].get_value()
        merged[kernel] = merged[kernel].replace((w.astype(jnp.float32) + adapter_delta(a, b, scale)).astype(w.dtype))
    return nnx.from_flat_state(merged)


def count_parameters(state: nnx.State) -> int:
    return sum(int(math.prod(leaf.shape)) for leaf in jax.tree.leaves(state))
