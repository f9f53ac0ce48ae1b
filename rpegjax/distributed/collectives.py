"""Host values combined over processes: gathers, sums, agreement, text from process 0, barriers.

Every function here is a collective: every process taking part must call it, in the same order (the contract
of `rpegjax.distributed`). With one process each returns its input (or does nothing) without communicating.
Host values travel as bytes in one program over one device per process (`gather_over_mesh`), not through
`jax.experimental.multihost_utils`, whose helpers assume that every process holds as many devices.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def gather_to_all(tree: Any, *, tiled: bool = True) -> Any:
    """Every process's host values, in every process, as numpy.

    Host leaves (numpy, scalars, fully addressable arrays; same shape in every process) are
    concatenated along axis 0 in process order (`tiled=True`, the inverse of `process_rows`
    without a sharding, when the rows split evenly) or stacked on a new axis 0 (`tiled=False`). Global
    `jax.Array`s spanning processes come back whole (their global value): all of them on one mesh are
    replicated by a single jitted call, rather than one program per leaf.
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
    for index, value in zip(rest, _gather_host_values([leaves[i] for i in rest], tiled=tiled)):
        gathered[index] = value
    return jax.tree_util.tree_unflatten(treedef, gathered)


def _identity(values: Any) -> Any:
    return values


def _process_heads() -> Mesh:
    """A mesh of the first device of every process, in process order."""
    first: dict[int, jax.Device] = {}
    for device in jax.devices():
        first.setdefault(device.process_index, device)
    return Mesh(np.array([first[process] for process in sorted(first)], dtype=object), ("processes",))


def _gather_host_values(values: list[Any], *, tiled: bool) -> list[np.ndarray]:
    """Each process's host arrays (the same shapes and dtypes in each) in every process, as bytes in one program
    over one device per process: stacked on a new axis 0 in process order, or (`tiled`) concatenated along axis 0.
    Unlike `jax.experimental.multihost_utils` it does not assume that every process holds as many devices."""
    arrays = [np.ascontiguousarray(np.asarray(value)) for value in values]
    if not arrays:
        return []
    flat = np.concatenate([array.reshape(-1).view(np.uint8) for array in arrays])
    stacked = flat[None] if jax.process_count() == 1 else gather_over_mesh(flat, _process_heads())
    gathered, offset = [], 0
    for array in arrays:
        part = np.ascontiguousarray(stacked[:, offset:offset + array.nbytes]).view(array.dtype)
        part = part.reshape(len(stacked), *array.shape)
        gathered.append(part.reshape(-1, *array.shape[1:]) if tiled and array.ndim else part)
        offset += array.nbytes
    return gathered


def sum_over_processes(value: float, mesh: Mesh | None = None) -> float:
    """The sum of each process's `value` in float64, over every process, or with `mesh` over the processes that
    own its devices only (a collective of those alone: one process group of a run over groups). Values travel
    as bytes: without jax_enable_x64 a float64 would travel as float32."""
    if mesh is not None:
        return _sum_over_mesh_processes(value, mesh)
    if jax.process_count() == 1:
        return value
    gathered = gather_to_all(np.array([value], np.float64).view(np.uint8), tiled=False)
    return float(np.ascontiguousarray(gathered).view(np.float64).sum())


def _sum_over_mesh_processes(value: float, mesh: Mesh) -> float:
    return float(gather_over_mesh(np.array([value], np.float64), mesh).sum())


def gather_over_mesh(value: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Each process's `value` (the same shape and dtype in each), stacked on a new axis 0 in process order, in
    every process owning devices of `mesh`: a collective of those processes alone (one process group of a run
    over groups). One program over `mesh`'s devices: each process writes its value as bytes on its first device,
    zeros elsewhere, and every device receives the replicated rows."""
    value = np.ascontiguousarray(value)
    devices = list(mesh.devices.flat)
    first: dict[int, jax.Device] = {}
    for device in devices:
        first.setdefault(device.process_index, device)
    mine = value.reshape(-1).view(np.uint8)
    flat = Mesh(np.array(devices, dtype=object), ("devices",))

    def block(index) -> np.ndarray:  # row i lives on devices[i]: the value once per process, zeros elsewhere
        device = devices[index[0].start or 0]  # a one-device mesh asks for the whole array: slice(None)
        return (mine if first[device.process_index] is device else np.zeros_like(mine))[None]

    rows = jax.make_array_from_callback((len(devices), mine.size), NamedSharding(flat, PartitionSpec("devices")),
                                        block, dtype=np.uint8)
    gathered = jax.jit(_identity, out_shardings=NamedSharding(flat, PartitionSpec()))(rows)
    whole = np.asarray(gathered.addressable_shards[0].data)
    chosen = whole[[devices.index(first[process]) for process in sorted(first)]]
    return np.ascontiguousarray(chosen).view(value.dtype).reshape(len(first), *value.shape)


def holds_in_every_process(flag: bool) -> bool:
    """Whether `flag` is true in every process (their logical and)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.all(gather_to_all(np.array([flag], np.uint8))))


def broadcast_text(text: str | None) -> str:
    """Process 0's `text` (UTF-8), in every process; the others' argument is ignored (None will do)."""
    if jax.process_index() == 0 and text is None:
        raise ValueError("broadcast_text: process 0 must give the text, got None")
    if jax.process_count() == 1:
        return text
    return gather_text(text if jax.process_index() == 0 else "")[0]


def gather_text(text: str) -> list[str]:
    """Every process's `text` (UTF-8, any length), in process order, in every process."""
    if jax.process_count() == 1:
        return [text]
    mine = np.frombuffer(text.encode(), np.uint8)
    lengths = np.asarray(gather_to_all(np.array([mine.size], np.int32), tiled=False)).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: mine.size] = mine
    rows = np.asarray(gather_to_all(padded, tiled=False)).reshape(lengths.size, -1)
    return [bytes(row[:length]).decode() for row, length in zip(rows, lengths)]


def barrier(name: str, mesh: Mesh | None = None) -> None:
    """Waits until every process reaches the barrier `name` (the same name in every process); with `mesh`, every
    process owning its devices (a collective of those alone: one process group of a run over groups)."""
    if mesh is not None:
        _sum_over_mesh_processes(0.0, mesh)
    elif jax.process_count() > 1:
        names = gather_to_all(np.frombuffer(hashlib.sha256(name.encode()).digest(), np.uint8), tiled=False)
        if not (names == names[0]).all():
            raise RuntimeError(f"barrier {name!r}: the processes reached different barriers (process "
                               f"{jax.process_index()} of {jax.process_count()})")


def spanning_mesh(tree: Any) -> Mesh | None:
    """The mesh of the first array of `tree` spread over several processes (None: this process holds every
    array whole): the processes that must take part in assembling them."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable and isinstance(leaf.sharding, NamedSharding):
            return leaf.sharding.mesh
    return None


def lowest_process(mesh: Mesh) -> int:
    """The first process owning devices of `mesh`: the one that writes what they assemble together."""
    return min(device.process_index for device in mesh.devices.flat)


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
    host values) hashes the same in every process."""
    local = np.frombuffer(tree_digest(value), np.uint8)
    digests = np.asarray(gather_to_all(local, tiled=False)).reshape(-1, local.size)
    differing = [index for index in range(digests.shape[0]) if not np.array_equal(digests[index], digests[0])]
    if differing:
        raise RuntimeError(
            f"{what} differs across processes: process(es) {differing} disagree with process 0 "
            f"(this is process {jax.process_index()}); every process must take the same decisions"
        )
