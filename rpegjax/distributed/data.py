"""What a joined process does with data: a mesh over every process's devices, its own rows of a
global batch, and global arrays built from per-process rows (gathers and checks: `collectives`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.sharding.mesh import make_hybrid_mesh


def global_mesh(axis_sizes: Mapping[str, int]) -> Mesh:
    """A mesh over every process's devices (`jax.devices()`), axes in `axis_sizes` order, laid out over the
    hosts (`rpegjax.sharding.make_hybrid_mesh`): the slowest-varying axes split processes, the tensor axis stays
    inside one. Put the axis with the least traffic (data, then fsdp) first, tensor last.
    """
    return make_hybrid_mesh(axis_sizes, jax.devices())


def process_rows(
    rows: int,
    process: int | None = None,
    count: int | None = None,
    *,
    sharding: NamedSharding | None = None,
) -> slice:
    """The rows of a global batch of `rows` rows that a process owns, for host work (data, rewards): the one
    row splitter of rpegjax.

    Without `sharding`: contiguous blocks in process order whose sizes differ by at most one (process p of P
    gets [p n // P, (p + 1) n // P)); `process` / `count` default to this process and the process count.
    With `sharding` (how the batch's rows are placed, e.g. `GRPOLearner.placement.rows`): the rows held by this
    process's devices, which is what `host_local_to_global` expects from it; ValueError when they are not
    contiguous or the sharding cannot split `rows`.
    """
    if not isinstance(rows, int | np.integer) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"process_rows: rows must be a non-negative integer, got {rows!r}")
    if sharding is None:
        process = jax.process_index() if process is None else process
        count = jax.process_count() if count is None else count
        if not 0 <= process < count:
            raise ValueError(f"process_rows: process {process} is not one of {count} processes")
        return slice(process * rows // count, (process + 1) * rows // count)
    if process is not None or count is not None:
        raise ValueError("process_rows: give either a sharding or process/count, not both")
    first = sharding.spec[0] if len(sharding.spec) else None
    row_sharding = NamedSharding(sharding.mesh, PartitionSpec(first))
    try:
        index_map = row_sharding.addressable_devices_indices_map((rows,))
    except ValueError as error:
        raise ValueError(f"process_rows: {rows} rows cannot be split as {row_sharding.spec}: {error}") from None
    spans = sorted({(index[0].start or 0, rows if index[0].stop is None else index[0].stop) for index in index_map.values()})
    start, stop = spans[0]
    for low, high in spans[1:]:
        if low != stop:
            raise ValueError(
                f"process_rows: this process's rows under {sharding.spec} are not contiguous ({spans}); "
                "order the mesh so that the row axes split processes first"
            )
        stop = high
    return slice(start, stop)


def host_local_to_global(tree: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """Builds globally sharded arrays from each process's rows (`jax.make_array_from_process_local_data`).

    Every leaf of `tree` holds this process's part of a global array, laid out as `spec` on `mesh`
    says (rows from `process_rows(n, sharding=NamedSharding(mesh, spec))` for row-sharded data, the whole
    array for dims not split over processes). `spec` applies to every leaf; entries beyond a leaf's
    rank must be None (so one spec serves [b] and [b, t] leaves). In one process this is a
    `device_put`. Returns the same tree of `jax.Array`s with global shapes.
    """
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"host_local_to_global: spec must be a PartitionSpec, got {type(spec).__name__}")

    def to_global(path, leaf):
        local = np.asarray(leaf)
        entries = tuple(spec)
        if any(entry is not None for entry in entries[local.ndim :]):
            raise ValueError(
                f"host_local_to_global: leaf {jax.tree_util.keystr(path)} of shape {local.shape} has fewer dims than spec {spec}"
            )
        sharding = NamedSharding(mesh, PartitionSpec(*entries[: local.ndim]))
        try:
            return jax.make_array_from_process_local_data(sharding, local)
        except ValueError as error:
            raise ValueError(
                f"host_local_to_global: leaf {jax.tree_util.keystr(path)} of local shape {local.shape} "
                f"does not fit {sharding.spec} on mesh {dict(mesh.shape)}: {error}"
            ) from None

    return jax.tree_util.tree_map_with_path(to_global, tree)
