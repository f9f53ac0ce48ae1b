"""Device meshes built from named axis sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh


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
