"""Device meshes built from named axis sizes, over one host's devices or laid out over the hardware's granules.

Across hosts (or TPU slices) the network is an order of magnitude slower than inside one. `make_hybrid_mesh`
splits every axis into a part inside a granule (a process's devices, or a slice) and a part across granules,
with JAX's `create_hybrid_device_mesh`, and keeps the tensor axis, whose collectives run in every layer, inside
one granule.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from rpegjax.sharding.axes import TENSOR_AXIS


def resolve_axis_sizes(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Replaces one size of -1 by what the other sizes leave of `num_devices`.

    Raises ValueError naming the axes when the sizes do not multiply to the device count.
    """
    sizes = dict(axis_sizes)
    if not sizes:
        raise ValueError("mesh needs at least one axis, got none")
    wildcards = [name for name, size in sizes.items() if size == -1]
    for name, size in sizes.items():
        if size != -1 and (not isinstance(size, int) or size < 1):
            raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers or -1")
    if len(wildcards) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {wildcards}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if wildcards:
        if num_devices % known:
            raise ValueError(
                f"mesh {sizes} cannot fill {num_devices} devices: {num_devices} is not divisible by {known}"
            )
        sizes[wildcards[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"mesh {sizes} has {known} devices but {num_devices} are available; "
            "make the sizes multiply to the device count or set one of them to -1"
        )
    return sizes


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a mesh whose axes are named and sized by `axis_sizes` (insertion order = mesh order).

    Example: `make_mesh({"data": 2, "fsdp": -1, "tensor": 2})` on 8 devices gives data 2 x fsdp 2 x tensor 2.
    The last axis varies fastest, so put the axis with the heaviest traffic (tensor) last: on GPU its
    devices are then neighbours inside a node.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(axis_sizes, len(devices))
    grid = np.array(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes.keys()))


def parse_mesh(text: str) -> dict[str, int]:
    """Parses `"data=2,fsdp=-1,tensor=2"` into axis sizes (for command lines)."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"mesh spec {text!r}: expected name=size pairs separated by commas, got {part!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh spec {text!r}: size of axis {name!r} is not an integer: {value!r}") from None
    return sizes


class Granule(enum.StrEnum):
    """The unit of the fast network: a process's devices (one host, or one node's GPUs), or a TPU slice."""

    PROCESS = "process"
    SLICE = "slice"


# Axes whose collectives run in every layer: they never leave a granule.
INNER_AXES = (TENSOR_AXIS,)


def split_across_granules(axis_sizes: Mapping[str, int], granules: int, devices_per_granule: int, *,
                          across: Mapping[str, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(within, across): each axis's size as (size inside a granule) x (number of granules it spans).

    `across` fixes the split of the axes it names; the other granules go to the remaining axes from the first
    (slowest-varying, least traffic: data, then fsdp) on, each taking as many as divide its size. The tensor axis
    stays inside a granule. Raises ValueError naming the axes when the sizes do not factor so.
    """
    sizes = resolve_axis_sizes(axis_sizes, granules * devices_per_granule)
    fixed = dict(across or {})
    unknown = sorted(set(fixed) - set(sizes))
    if unknown:
        raise ValueError(f"hybrid mesh {sizes}: across-granule sizes name unknown axes {unknown}")
    for name, count in fixed.items():
        if not isinstance(count, int) or count < 1 or sizes[name] % count:
            raise ValueError(f"hybrid mesh {sizes}: axis {name!r} of size {sizes[name]} cannot span {count!r} granules")
        if name in INNER_AXES and count > 1:
            raise ValueError(f"hybrid mesh {sizes}: axis {name!r} must stay inside one granule (its collectives run "
                             f"in every layer), got it across {count}")
    left = granules // math.gcd(granules, math.prod(fixed.values()))
    outer = {}
    for name, size in sizes.items():
        if name in fixed:
            outer[name] = fixed[name]
            continue
        outer[name] = 1 if name in INNER_AXES else math.gcd(size, left)
        left //= outer[name]
    if math.prod(outer.values()) != granules:
        inner = {name: sizes[name] for name in INNER_AXES if name in sizes}
        raise ValueError(f"hybrid mesh {sizes} does not factor over {granules} granules of {devices_per_granule} "
                         f"devices: the axes could span {outer} granules (product {math.prod(outer.values())}); "
                         f"{inner or 'no axis'} must fit inside one granule")
    within = {name: size // outer[name] for name, size in sizes.items()}
    return within, outer


def hybrid_device_grid(axis_sizes: Mapping[str, int], devices: Sequence[Any], *, granule: Granule = Granule.PROCESS,
                       across: Mapping[str, int] | None = None) -> np.ndarray:
    """The devices arranged as `axis_sizes` (dims in that order), each axis's across-granule part slowest
    (`split_across_granules`): `jax.experimental.mesh_utils.create_hybrid_device_mesh`."""
    attribute = "process_index" if granule == Granule.PROCESS else "slice_index"
    missing = [device for device in devices if not hasattr(device, attribute)]
    if missing:
        raise ValueError(f"hybrid mesh by {granule.value}: device {missing[0]} has no {attribute}; use "
                         f"granule={Granule.PROCESS.value!r}")
    groups: dict[int, int] = {}
    for device in devices:
        groups[getattr(device, attribute)] = groups.get(getattr(device, attribute), 0) + 1
    counts = sorted(set(groups.values()))
    if len(counts) != 1:
        raise ValueError(f"hybrid mesh by {granule.value}: granules hold different numbers of the devices "
                         f"({dict(sorted(groups.items()))}); a hybrid mesh needs equal granules")
    within, outer = split_across_granules(axis_sizes, len(groups), counts[0], across=across)
    return mesh_utils.create_hybrid_device_mesh(list(within.values()), list(outer.values()), list(devices),
                                                process_is_granule=granule == Granule.PROCESS)


def make_hybrid_mesh(axis_sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None, *,
                     granule: Granule = Granule.PROCESS, across: Mapping[str, int] | None = None) -> Mesh:
    """A mesh that follows the hardware: `axis_sizes` laid out by `hybrid_device_grid` (tensor inside a granule).

    Example: 4 processes x 2 GPUs, `{"data": 4, "tensor": 2}` gives data across the 4 processes and tensor
    inside each; `{"data": 2, "fsdp": 2, "tensor": 2}` puts data and fsdp across processes."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(axis_sizes, len(devices))
    return Mesh(hybrid_device_grid(sizes, devices, granule=granule, across=across), tuple(sizes))
