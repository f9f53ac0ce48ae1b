"""Arrays between disjoint groups of processes (a disaggregated plan's generation and training processes) through
`jax.experimental.transfer`: no home-made RPC, no collective that both groups must launch in step.

Why this mechanism (JAX 0.10.2, measured on CPU with gloo, 4 processes x 2 devices):
- `jax.device_put` onto a sharding whose devices belong to other processes is refused unless the backend supports
  cross-host transfers ("The backend (cpu) does not support cross-host device transfers. Please set
  jax_cross_host_transfer_socket_address ..."); with that flag set the call returns, but the receiving processes
  wait in `block_until_ready` forever. Source and target must also have the same mesh shape and spec ("input and
  target sharding should have the same set of devices" otherwise).
- One jitted program over a mesh of both groups would move the data with a collective, but every process of both
  groups would have to launch it at the same point of its program order, which ties the generation thread to the
  trainer's.
- The transfer library works: each process runs a transfer server; a sender offers its shards under a number
  (`await_pull`, returns at once), the receiver pulls them onto its own devices (`pull`, waits until offered).

So a transfer is planned identically in every process from the source and target shardings alone (`plan_transfer`):
every target device gets its block from a source device that holds the same block (replicas of the source are used
in turn), and the shards each (source process, target process) pair exchanges travel as one pull. Senders call
`send`, receivers `receive`; neither waits for the other except the receiver for data not offered yet. For
weights the source layout is the generation layout laid over the training devices (`layout_on`): one jitted
all-gather on the training mesh, then a transfer of whole tensor-parallel shards.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from rpegjax import distributed
from rpegjax.distributed.hosts import ProcessAddress



class ProcessTransfers:
    """This process's transfer server and the addresses of every process's server.

    Constructing it is a collective of all processes (the addresses are all-gathered once, at set-up). The server
    and its per-device transports listen on `address.host` (the address other hosts reach this one at:
    `DistributedConfig.address()`; 127.0.0.1 on one host); the server on a port of `address.ports` when it sets a
    range (its fixed slot among the processes of the host), the transports (as many in every process) on ephemeral
    ports."""

    def __init__(self, address: ProcessAddress = ProcessAddress()):
        client = jax.local_devices()[0].client
        hosts = distributed.gather_text(address.host)
        me = jax.process_index()
        slot = hosts[:me].count(hosts[me])  # this process's turn among the processes of its host
        port = address.ports_for(slot, 1)[0]
        host = f"[{address.host}]" if ":" in address.host else address.host
        # the bulk transports bind every connection they open to their address: a fixed port there fails at the
        # second connection ("Address already in use"), so they take ephemeral ports. Both ends of a connection
        # must have as many (processes with fewer transports than a peer crash binding the missing ones): one per
        # device of the process with the most
        transports = max(int(count) for count in distributed.gather_text(str(jax.local_device_count())))
        try:
            self.server = jax_transfer.start_transfer_server(client, f"{host}:{port}", [f"{host}:0"] * transports)
        except jax.errors.JaxRuntimeError as error:
            raise OSError(f"process {me}: the transfer server cannot listen on {host} port {port}: {error}") from None
        self.addresses = distributed.gather_text(self.server.address())
        self._connections: dict[int, Any] = {}
        self._lock = threading.Lock()  # the rollout and trainer threads may both pull

    def connection(self, process: int) -> Any:
        """The (cached) connection to `process`'s transfer server."""
        with self._lock:
            if process not in self._connections:
                self._connections[process] = self.server.connect(self.addresses[process])
            return self._connections[process]


@dataclasses.dataclass(frozen=True)
class Route:
    """One shard's way: leaf `leaf`'s block `index` from `source` to `target` (devices)."""

    leaf: int
    index: tuple[tuple[int, int], ...]  # (start, stop) per dimension
    source: jax.Device
    target: jax.Device


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Every shard's route, grouped by (source process, target process) in one fixed order; the same in every
    process. `shapes` are the leaves' shapes and dtypes, `targets` their target shardings, `treedef` the tree's."""

    shapes: tuple[jax.ShapeDtypeStruct, ...]
    targets: tuple[NamedSharding, ...]
    treedef: Any
    routes: dict[tuple[int, int], tuple[Route, ...]]

    @property
    def nbytes(self) -> int:
        """Bytes the transfer moves (every target shard once)."""
        return sum(self._route_bytes(route) for routes in self.routes.values() for route in routes)

    def received_bytes(self, process: int) -> int:
        """Bytes `process` pulls."""
        return sum(self._route_bytes(route) for pair, routes in self.routes.items() if pair[1] == process
                   for route in routes)

    def _route_bytes(self, route: Route) -> int:
        return int(np.prod([stop - start for start, stop in route.index])) * self.shapes[route.leaf].dtype.itemsize


def _blocks(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[jax.Device, tuple[tuple[int, int], ...]]:
    """Each device's block of an array of `shape` under `sharding`, as (start, stop) per dimension."""
    return {device: tuple(slice_.indices(size)[:2] for slice_, size in zip(index, shape))
            for device, index in sharding.devices_indices_map(shape).items()}


def plan_transfer(like: Any, sources: Any, targets: Any) -> TransferPlan:
    """The routes that move a tree of arrays shaped like `like` (arrays or `jax.ShapeDtypeStruct`s) from the
    shardings `sources` to the shardings `targets` (trees of the same structure; a single sharding applies to every
    leaf). Pure: the same in every process. Raises ValueError naming the leaf when a target block has no source
    device holding exactly that block (lay the source out as the target first: `layout_on`)."""
    leaves, treedef = jax.tree.flatten(like)
    shapes = tuple(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves)
    source_leaves = _broadcast(sources, treedef, "sources")
    target_leaves = _broadcast(targets, treedef, "targets")
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
    routes: dict[tuple[int, int], list[Route]] = {}
    for leaf, (shape, source, target) in enumerate(zip(shapes, source_leaves, target_leaves)):
        holders: dict[tuple, list[jax.Device]] = {}
        for device, block in sorted(_blocks(source, shape.shape).items(), key=lambda item: item[0].id):
            holders.setdefault(block, []).append(device)
        used: dict[tuple, int] = {}
        for device, block in sorted(_blocks(target, shape.shape).items(), key=lambda item: item[0].id):
            if block not in holders:
                raise ValueError(f"transfer of leaf {paths[leaf] or '<root>'} {shape.shape}: no source device holds "
                                 f"the block {block} that target device {device.id} needs (source {source}, target "
                                 f"{target}); lay the source out like the target first")
            candidates = holders[block]
            source_device = candidates[used.get(block, 0) % len(candidates)]  # spread over the source's replicas
            used[block] = used.get(block, 0) + 1
            pair = (source_device.process_index, device.process_index)
            routes.setdefault(pair, []).append(Route(leaf, block, source_device, device))
    return TransferPlan(shapes=shapes, targets=tuple(target_leaves), treedef=treedef,
                        routes={pair: tuple(found) for pair, found in sorted(routes.items())})


def _broadcast(shardings: Any, treedef: Any, what: str) -> list[jax.sharding.Sharding]:
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * treedef.num_leaves
    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"plan_transfer: {what} has {len(leaves)} shardings for {treedef.num_leaves} arrays")
    return leaves


def _pull_id(transfer_id: int, pair: tuple[int, int]) -> int:
    count = jax.process_count()
    return (transfer_id * count + pair[0]) * count + pair[1]


def send(transfers: ProcessTransfers, plan: TransferPlan, transfer_id: int, tree: Any) -> None:
    """Offers this process's shards of `tree` (laid out as the plan's sources) to the processes that pull them.
    Returns at once; the server keeps the shards until they are pulled. `transfer_id` (a non-negative integer,
    e.g. a weights version) must be unique among the transfers in flight and the same in sender and receiver."""
    me = jax.process_index()
    leaves = jax.tree.leaves(tree)
    if len(leaves) != len(plan.shapes):
        raise ValueError(f"send: the tree has {len(leaves)} arrays, the plan {len(plan.shapes)}")
    shards = [{shard.device: shard.data for shard in leaf.addressable_shards} for leaf in leaves]
    for pair, routes in plan.routes.items():
        if pair[0] == me:
            transfers.server.await_pull(_pull_id(transfer_id, pair), [shards[r.leaf][r.source] for r in routes])


def receive(transfers: ProcessTransfers, plan: TransferPlan, transfer_id: int) -> Any:
    """This process's part of the tree sent as `transfer_id`: global arrays with the plan's target shardings
    (holding the shards of this process's devices). The pulls run asynchronously: the arrays are ready once every
    sender has offered its shards and they have arrived (`jax.block_until_ready`). Each offer is pulled once: a
    receiver that reads a transfer again keeps what it received."""
    me = jax.process_index()
    pulled: list[dict[jax.Device, jax.Array]] = [{} for _ in plan.shapes]
    for pair, routes in plan.routes.items():
        if pair[1] != me:
            continue
        specs = [jax.ShapeDtypeStruct(tuple(stop - start for start, stop in r.index), plan.shapes[r.leaf].dtype,
                                      sharding=SingleDeviceSharding(r.target)) for r in routes]
        arrays = transfers.connection(pair[0]).pull(_pull_id(transfer_id, pair), specs)
        for route, array in zip(routes, arrays):
            pulled[route.leaf][route.target] = array
    leaves = []
    for shape, target, shards in zip(plan.shapes, plan.targets, pulled):
        mine = [shards[device] for device in target.addressable_devices_indices_map(shape.shape)]
        leaves.append(jax.make_array_from_single_device_arrays(shape.shape, target, mine, dtype=shape.dtype))
    return jax.tree.unflatten(plan.treedef, leaves)


def layout_on(targets: Any, devices: Sequence[jax.Device]) -> Any:
    """The target shardings (a tree of `NamedSharding`s on one mesh) laid over `devices` instead, so that every
    target block has a source device holding exactly that block (`plan_transfer`): the mesh axes the specs split
    keep their sizes, the axes they do not (replicas) are resized so that the mesh has `len(devices)` devices (an
    axis of replicas is added when there is none). Any device counts work whose ratio the replicas absorb: four
    generation devices of tensor=2 fed from two, six or eight training devices. Raises ValueError naming the
    split axes when `len(devices)` is not a multiple of the blocks they make."""
    leaves = jax.tree.leaves(targets, is_leaf=lambda x: isinstance(x, NamedSharding))
    if not leaves:
        return targets
    mesh = leaves[0].mesh
    split = {axis for sharding in leaves for entry in sharding.spec if entry is not None
             for axis in ((entry,) if isinstance(entry, str) else entry)}
    blocks = int(np.prod([mesh.shape[axis] for axis in split], dtype=np.int64))
    if len(devices) % blocks:
        raise ValueError(f"layout_on: the target layout splits weights over axes {sorted(split)} into {blocks} "
                         f"blocks; {len(devices)} source devices cannot hold them in whole copies (give the source "
                         f"a multiple of {blocks} devices)")
    replicas = len(devices) // blocks
    names, sizes = list(mesh.axis_names), [mesh.shape[axis] if axis in split else 1 for axis in mesh.axis_names]
    free = [index for index, axis in enumerate(names) if axis not in split]
    if free:
        sizes[free[0]] = replicas
    elif replicas > 1:
        names.append("staging_replicas")
        sizes.append(replicas)
    grid = Mesh(np.array(list(devices), dtype=object).reshape(sizes), tuple(names))

    def move(sharding: NamedSharding) -> NamedSharding:
        if sharding.mesh.shape != mesh.shape:
            raise ValueError(f"layout_on: the targets lie on meshes {dict(mesh.shape)} and {dict(sharding.mesh.shape)}")
        return NamedSharding(grid, sharding.spec)

    return jax.tree.map(move, targets, is_leaf=lambda x: isinstance(x, NamedSharding))
