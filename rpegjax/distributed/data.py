"""What a joined process does with data: a mesh over every process's devices, its own rows of a
global batch, global arrays built from per-process rows, gathers, and the same-decisions check.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.sharding.mesh import make_hybrid_mesh


def global_mesh(axis_sizes: Mapping[str, int]) -> Mesh:
    """A mesh over every process's devices (`jax.devices()`), axes in `axis_sizes` order, laid out over the
    hosts (`rpegjax.sharding.make_hybrid_mesh`): the slowest-varying axes split processes, the tensor axis stays
    inside one. Put the axis with the least traffic (data, then fsdp) first, tensor last.
    """
    return make_hybrid_mesh(axis_sizes, jax.devices())


def process_slice(
    rows: int,
    sharding: NamedSharding | None = None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> slice:
    """The rows of a global batch of `rows` rows that this process owns, for host work (data, rewards).

    With `sharding` (how the batch's rows are placed, e.g. `GRPOLearner.placement.rows`): the rows
    held by this process's devices, which is what `host_local_to_global` expects from it. Without:
    equal contiguous blocks in process order (process p gets [p n / P, (p+1) n / P)).
    Raises ValueError when the rows do not split evenly or a process's rows are not contiguous.
    """
    if not isinstance(rows, int | np.integer) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"process_slice: rows must be a positive integer, got {rows!r}")
    if sharding is None:
        index = jax.process_index() if process_index is None else process_index
        count = jax.process_count() if process_count is None else process_count
        if rows % count:
            raise ValueError(f"process_slice: {rows} rows do not split evenly over {count} processes")
        size = rows // count
        return slice(index * size, (index + 1) * size)
    if process_index is not None or process_count is not None:
        raise ValueError("process_slice: give either a sharding or process_index/process_count, not both")
    first = sharding.spec[0] if len(sharding.spec) else None
    row_sharding = NamedSharding(sharding.mesh, PartitionSpec(first))
    try:
        index_map = row_sharding.addressable_devices_indices_map((rows,))
    except ValueError as error:
        raise ValueError(f"process_slice: {rows} rows cannot be split as {row_sharding.spec}: {error}") from None
    spans = sorted({(index[0].start or 0, rows if index[0].stop is None else index[0].stop) for index in index_map.values()})
    start, stop = spans[0]
    for low, high in spans[1:]:
        if low != stop:
            raise ValueError(
                f"process_slice: this process's rows under {sharding.spec} are not contiguous ({spans}); "
                "order the mesh so that the row axes split processes first"
            )
        stop = high
    return slice(start, stop)


def host_local_to_global(tree: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """Builds globally sharded arrays from each process's rows (`jax.make_array_from_process_local_data`).

    Every leaf of `tree` holds this process's part of a global array, laid out as `spec` on `mesh`
    says (rows from `process_slice(n, NamedSharding(mesh, spec))` for row-sharded data, the whole
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


def gather_to_all(tree: Any, *, tiled: bool = True) -> Any:
    """Every process's host values, in every process, as numpy.

    Host leaves (numpy, scalars, fully addressable arrays; same shape in every process) are
    concatenated along axis 0 in process order (`tiled=True`, the inverse of `process_slice`
    without a sharding) or stacked on a new axis 0 (`tiled=False`). Global `jax.Array`s spanning
    processes come back whole (their global value): all of them on one mesh are replicated by a
    single jitted call, rather than one program per leaf. A collective: every process must call it.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    gathered: list[Any] = [None] * len(leaves)
    by_mesh: dict[Mesh, list[int]] = {}
    for index, leaf in enumerate(leaves):
        spans_processes = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        if spans_processes and isinstance(leaf.sharding, NamedSharding):
            by_mesh.setdefault(leaf.sharding.mesh, []).append(index)
    for mesh, indices in by_mesh.items():
        replicate = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))
        for index, value in zip(indices, replicate([leaves[i] for i in indices])):
            gathered[index] = np.asarray(value)  # fully replicated: readable in every process
    rest = [index for index, value in enumerate(gathered) if value is None]
    for index, value in zip(rest, multihost_utils.process_allgather([leaves[i] for i in rest], tiled=tiled)):
        gathered[index] = value
    return jax.tree_util.tree_unflatten(treedef, gathered)


def _identity(values: Any) -> Any:
    return values


# ---- the same-decisions contract --------------------------------------------------------------


def tree_digest(value: Any) -> bytes:
    """SHA-256 of a pytree's structure and leaves: arrays by dtype, shape and bytes, other leaves by repr.

    Raises TypeError for leaves with no stable value across processes: global arrays whose shards
    live in other processes (gather them first) and objects whose repr is an address.
    """
    digest = hashlib.sha256()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
    digest.update(str(treedef).encode())
    for path, leaf in leaves:
        where = jax.tree_util.keystr(path) or "<root>"
        if isinstance(leaf, jax.Array) and not (leaf.is_fully_addressable or leaf.is_fully_replicated):
            raise TypeError(f"tree_digest: leaf {where} is a global array sharded over processes; gather it first")
        if isinstance(leaf, jax.Array | np.ndarray | np.generic):
            array = np.ascontiguousarray(np.asarray(leaf))
            digest.update(f"{where}:{array.dtype.str}:{array.shape}:".encode())
            digest.update(array.tobytes())
            continue
        text = repr(leaf)
        if re.search(r" at 0x[0-9a-fA-F]+", text):
            raise TypeError(f"tree_digest: leaf {where} ({type(leaf).__name__}) has no stable repr: {text}")
        digest.update(f"{where}:{text};".encode())
    return digest.digest()


def assert_same_across_processes(value: Any, what: str) -> None:
    """Raises RuntimeError naming `what` and the processes that disagree unless `value` (a pytree of
    host values) hashes the same in every process. A collective: every process must call it."""
    local = np.frombuffer(tree_digest(value), np.uint8)
    digests = np.asarray(gather_to_all(local, tiled=False)).reshape(-1, local.size)
    differing = [index for index in range(digests.shape[0]) if not np.array_equal(digests[index], digests[0])]
    if differing:
        raise RuntimeError(
            f"{what} differs across processes: process(es) {differing} disagree with process 0 "
            f"(this is process {jax.process_index()}); every process must take the same decisions"
        )
