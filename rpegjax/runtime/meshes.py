"""The device meshes a graph's placements name: where each device stage runs.

A placement's devices are `jax.devices()` at its `device_indices` (explicit ones, else the first `size`). A stage's
mesh is its placement's devices arranged by the stage's effective parallel sizes (its own layout, else its
placement's), axes in the order the graph gives them. When those devices belong to several processes (hosts), the
mesh follows the hardware (`rpegjax.sharding.mesh.hybrid_device_grid`): every axis's part across processes varies
slowest, and the tensor axis stays inside one process; sizes that cannot be laid out so are refused. The runtime checks that the programs
it is handed run each stage on exactly these devices; `rpegjax.runtime.assembly` builds learner and sampler on them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rpegjax.graph.ir import Graph, GraphError, StageKind
from rpegjax.sharding.mesh import hybrid_device_grid


def placement_devices(graph: Graph, placement: str, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices of `placement`: `devices` (default `jax.devices()`; a dry run passes compile-only devices of
    another platform) at its `device_indices`."""
    devices = jax.devices() if devices is None else list(devices)
    indices = graph.placements[placement].device_indices
    if max(indices) >= len(devices):
        raise GraphError(f"placement {placement!r} uses device {max(indices)}, but only {len(devices)} devices exist "
                         f"(graph planned for {graph.num_devices})")
    return [devices[i] for i in indices]


def stage_mesh(graph: Graph, stage: str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh `stage` runs on: its placement's devices (of `devices`, default `jax.devices()`) shaped by its
    effective parallel sizes."""
    spec = graph.stage(stage)
    if spec.host:
        raise GraphError(f"stage {stage!r} runs on the host and has no mesh", stage=stage)
    sizes = dict(graph.parallel_of(stage))
    devices = placement_devices(graph, spec.placement, devices)
    if len({device.process_index for device in devices}) == 1:
        grid = np.array(devices, dtype=object).reshape(tuple(sizes.values()))
    else:
        try:
            grid = hybrid_device_grid(sizes, devices)
        except ValueError as error:
            raise GraphError(f"stage {stage!r} (placement {spec.placement!r}): {error}", stage=stage) from None
    return Mesh(grid, tuple(sizes))


def device_ids(mesh: Mesh | None) -> frozenset[int]:
    """Ids of the devices a program on `mesh` uses; without a mesh, the default device's."""
    devices = jax.devices()[:1] if mesh is None else mesh.devices.flat
    return frozenset(device.id for device in devices)


def layout(sizes: Mapping[str, int]) -> dict[str, int]:
    """Axis sizes without the size-1 axes: two layouts that differ only by those place arrays alike."""
    return {axis: size for axis, size in sizes.items() if size > 1}


def same_layout(mesh: Mesh | None, sizes: Mapping[str, int]) -> bool:
    """Whether a program on `mesh` (None: one device) has the layout `sizes` asks for."""
    have = {} if mesh is None else layout(dict(mesh.shape))
    return have == layout(sizes)


def placed_meshes(graph: Graph, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh | None, Mesh | None]:
    """(training mesh, generation mesh) the graph places its update and generate stages on; None for the
    default device alone in a one-process run (no mesh needed). With several processes a one-device placement
    keeps its mesh: other processes must know where its arrays live (e.g. to transfer weights there). `devices`:
    as `stage_mesh`'s."""

    def mesh_or_none(stage) -> Mesh | None:
        mesh = stage_mesh(graph, stage.name, devices)
        alone = jax.process_count() == 1 and mesh.size == 1 and mesh.devices.flat[0] == jax.devices()[0]
        return None if alone else mesh

    return (mesh_or_none(graph.stages_of_kind(StageKind.ACTOR_UPDATE)[0]),
            mesh_or_none(graph.stages_of_kind(StageKind.GENERATE)[0]))
