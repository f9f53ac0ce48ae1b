"""The layer kinds a decoder stacks, and what a kind declares about the state it keeps for generation.

A layer is a mixer kind (how tokens see each other: full attention, sliding-window attention, ...) and an MLP kind
(dense, experts); `ModelConfig.layer_kind(i)` names layer i's. Each mixer kind has one module that owns
everything about it (docs/architecture.md, "Layer kinds"): parameters and Hugging Face names, the training forward,
the generation state it keeps per sequence and its decode step in both samplers. `rpegjax.models.layer_stack` maps
each kind to that module through explicit dicts.

A generation state is a flat `flax.struct.dataclass` of arrays whose leading axis is the row (slot) or, for a paged
pool, the slot replica; each class describes its arrays in a class attribute `ARRAYS: dict[str, StateArray]`
(field name -> logical axes, the axis of cache positions, pooled or per row). The samplers handle every kind's state
through these descriptions alone: admit copies a prefilled row into its slots (the positions a prefill wrote, or the
whole per-row state), live buckets take and put rows (a window of the positions' axis, or the whole row), the
paged sampler shares pools over the bucket and carries per-row state through chunked prefills.

Pure Python and numpy-free: read by `ModelConfig` and the perf model too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable, Sequence
from typing import Any


class MixerKind(enum.StrEnum):
    """How a layer mixes tokens; the values are Hugging Face's `layer_types` entries."""

    FULL_ATTENTION = "full_attention"  # causal attention over every earlier token (`models.full_attention`)
    SLIDING_ATTENTION = "sliding_attention"  # causal attention over the last `sliding_window` tokens


class MlpKind(enum.StrEnum):
    """A layer's feed-forward part."""

    DENSE = "dense"  # gated MLP (`models.mlp`)
    EXPERTS = "experts"  # routed experts (`models.moe`)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    mixer: MixerKind
    mlp: MlpKind


@dataclasses.dataclass(frozen=True)
class StateArray:
    """How the samplers treat one array of a layer's generation state.

    `logical`: its logical sharding axes (the first is the row axis: `axes.BATCH`, also for a pool's replica axis).
    `positions`: the axis of cache positions (contiguous states only), or None for state kept per row whatever the
    length (a recurrent state, a convolution window): admit and live buckets then move the whole row.
    `pooled`: a paged pool, [replicas, ...] with page ids from a page table, shared by every row of a call; False for
    an array with one row per slot.
    """

    logical: tuple[str | None, ...]
    positions: int | None = None
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.positions is not None and (self.pooled or not 0 < self.positions < len(self.logical)):
            raise ValueError(f"StateArray: positions={self.positions} must be a non-leading axis of "
                             f"{self.logical} of an unpooled array")


def state_arrays(state: Any) -> dict[str, tuple[Any, StateArray]]:
    """{field: (array, its `StateArray`)} of a generation state (a dataclass with `ARRAYS`)."""
    return {name: (getattr(state, name), spec) for name, spec in type(state).ARRAYS.items()}


def map_state(function, state: Any, *others: Any) -> Any:
    """`state` with each array replaced by `function(spec, array, *the same field of others)`."""
    return state.replace(**{name: function(spec, array, *(getattr(other, name) for other in others))
                            for name, (array, spec) in state_arrays(state).items()})


@dataclasses.dataclass(frozen=True)
class PageGroup:
    """The positions a paged layer keeps pages for: every one (`window` None), or the last `window` (sliding
    attention: pages wholly before the window are freed). Layers of one group share page tables and page ids."""

    window: int | None = None


@dataclasses.dataclass(frozen=True)
class StackSegment:
    """Layers start .. start + len(unit) * repeats - 1: `unit` (a tuple of kinds) repeated `repeats` times."""

    start: int
    unit: tuple[Hashable, ...]
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + len(self.unit) * self.repeats


def stack_segments(kinds: Sequence[Hashable]) -> tuple[StackSegment, ...]:
    """The layer stack as consecutive segments of one repeated unit each, for the layer scan (one compiled body per
    segment). Greedy from the first layer: the unit repeated at least twice whose repeats cover the most layers (the
    shortest such), else the first layer alone; then the rest. One kind: one segment of unit 1; Gemma 3's 62 layers
    of five sliding and one full: a unit of six repeated 10 times, then two sliding layers."""
    kinds = tuple(kinds)
    segments, start = [], 0
    while start < len(kinds):
        rest = kinds[start:]
        repeats, period = 1, 1
        for size in range(1, len(rest) // 2 + 1):
            count = 1
            while (count + 1) * size <= len(rest) and rest[count * size:(count + 1) * size] == rest[:size]:
                count += 1
            if count > 1 and count * size > repeats * period * (repeats > 1):
                repeats, period = count, size
        segments.append(StackSegment(start=start, unit=rest[:period], repeats=repeats))
        start += repeats * period
    return tuple(segments)
