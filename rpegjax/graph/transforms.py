"""Graph rewrites the planner composes. Each is a pure function Graph -> Graph returning a validated graph,
and raises `GraphError` naming the stage when its precondition fails. The input graph is never modified.

* `bounded_async(g, k)`: generation at step t reads actor weights of version t - k (parameter edge offset k + 1).
* `share_actor_critic(g)`: critic = actor trunk + value head; value inference merges into the actor's
  old-log-prob stage and the critic update into the actor update.
* `fuse(g, stages)` / `default_fusion(g)`: stages reading one batch on one placement run as one program.
* `microbatch(g, stage, n)`: a stage (or its whole fused group) runs in n pieces.
* `place(g, stage, submesh, parallel)`: moves a stage (or its whole fused group) to a sub-mesh.
* `disaggregate(g, n, rollout, train)`: generation on the first n devices, every other device stage on the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from rpegjax.graph.ir import (
    HOST_PLACEMENT,
    INFERENCE_KINDS,
    Edge,
    Graph,
    GraphError,
    Payload,
    Placement,
    Stage,
    StageKind,
    replace_stages,
)
from rpegjax.graph.validation import check_fusable


def _rebuild(graph: Graph, *, stages: Iterable[Stage] | None = None, edges: Iterable[Edge] | None = None, **changes) -> Graph:
    if stages is not None:
        changes["stages"] = tuple(stages)
    if edges is not None:
        changes["edges"] = tuple(edges)
    return dataclasses.replace(graph, **changes).validate()


def _group_members(graph: Graph, name: str) -> list[Stage]:
    """The stage and, when it is fused, the other members of its group (they move and split together)."""
    stage = graph.stage(name)
    if stage.fused_group is None:
        return [stage]
    return [s for s in graph.stages if s.fused_group == stage.fused_group]


# ------------------------------------------------------------------------------------------ asynchrony
def bounded_async(graph: Graph, k: int) -> Graph:
    """Generation at step t uses actor weights of version t - k; k = 0 is synchronous on-policy.

    Every generate stage's parameter edges get offset k + 1 (see the version convention in `ir`) and
    `async_bound` becomes k. Other edges keep their offsets; lowering k below an existing data offset fails
    validation naming that stage.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise GraphError(f"bounded_async: k must be an integer >= 0 (versions of staleness), got {k!r}")
    generators = graph.stages_of_kind(StageKind.GENERATE)
    if not generators:
        raise GraphError("bounded_async: the graph has no generate stage")
    names = {s.name for s in generators}
    for stage in generators:
        if not any(e.is_params for e in graph.in_edges(stage.name)):
            raise GraphError(f"bounded_async: generate stage {stage.name!r} reads no parameters from the graph", stage=stage.name)
    edges = [
        dataclasses.replace(e, version_offset=k + 1) if e.dst in names and e.is_params else e for e in graph.edges
    ]
    return _rebuild(graph, edges=edges, async_bound=k)


# ----------------------------------------------------------------------------------- actor-critic sharing
def _only_stage(graph: Graph, kind: StageKind, purpose: str) -> Stage:
    stages = [s for s in graph.stages if s.kind is kind]
    if len(stages) != 1:
        names = [s.name for s in stages]
        raise GraphError(
            f"share_actor_critic: needs exactly one {kind.value} stage {purpose}, found {names or 'none'}",
            stage=names[1] if len(names) > 1 else None)
    return stages[0]


def _absorb(graph: Graph, edges: list[Edge], *, into: Stage, absorbed: Stage) -> tuple[Stage, list[Edge]]:
    """Moves `absorbed`'s data inputs and outputs (not its critic parameters) onto `into`; returns both updated."""
    reads = {e.payload: e for e in edges if e.dst == into.name}
    internal = {e.payload for e in edges if e.src == absorbed.name and e.dst == into.name and e.version_offset == 0}
    inputs = [p for p in into.inputs if p not in internal]  # read from the other half: internal after the merge
    kept = []
    for edge in edges:
        if edge.src == absorbed.name and edge.dst == into.name and edge.version_offset == 0:
            continue
        if edge.dst != absorbed.name:
            kept.append(edge)
            continue
        if edge.payload == Payload.CRITIC_PARAMS or (edge.src == into.name and edge.version_offset == 0):
            continue  # the critic's weights are the actor's from now on; a read of the other half is internal
        existing = reads.get(edge.payload)
        if existing is not None:
            if (existing.src, existing.version_offset) != (edge.src, edge.version_offset):
                raise GraphError(
                    f"share_actor_critic: {absorbed.name!r} reads {edge.payload!r} from {edge.src!r}@t-{edge.version_offset} "
                    f"but {into.name!r} reads it from {existing.src!r}@t-{existing.version_offset}", stage=absorbed.name)
            continue
        kept.append(dataclasses.replace(edge, dst=into.name))
        inputs.append(edge.payload)
    inputs += [p for p in absorbed.inputs if p in graph.external and p not in inputs]
    outputs = list(into.outputs) + [p for p in absorbed.outputs if p != Payload.CRITIC_PARAMS and p not in into.outputs]
    options = {**into.options, **{f"critic_{key}": value for key, value in absorbed.options.items()}}
    merged = dataclasses.replace(
        into, inputs=tuple(inputs), outputs=tuple(outputs),
        merged_kinds=(*into.merged_kinds, absorbed.kind, *absorbed.merged_kinds), options=options)
    rewired = [
        dataclasses.replace(e, src=into.name) if e.src == absorbed.name and e.payload != Payload.CRITIC_PARAMS else e
        for e in kept
    ]
    return merged, rewired


def share_actor_critic(graph: Graph) -> Graph:
    """The critic becomes the actor trunk plus a value head.

    critic_value merges into the old_logprob stage (one forward pass gives log-probs and values) and
    critic_update into actor_update (one optimiser step on policy + value loss). Reads of `params:critic` by
    any other stage become reads of `params:actor` from actor_update at the same offset. Roles: the merged
    stages keep role actor and record the absorbed kinds in `merged_kinds`.
    Refused when the graph has no critic, or no single old_logprob/actor_update stage to merge into.
    """
    if graph.shares_actor_critic:
        raise GraphError("share_actor_critic: the critic already shares the actor's trunk")
    value = _only_stage(graph, StageKind.CRITIC_VALUE, "(the critic to share)")
    critic_update = _only_stage(graph, StageKind.CRITIC_UPDATE, "(the critic to share)")
    old = _only_stage(graph, StageKind.OLD_LOGPROB, f"to absorb {value.name!r}")
    actor_update = _only_stage(graph, StageKind.ACTOR_UPDATE, f"to absorb {critic_update.name!r}")
    edges = list(graph.edges)
    old, edges = _absorb(graph, edges, into=old, absorbed=value)
    actor_update, edges = _absorb(graph, edges, into=actor_update, absorbed=critic_update)
    removed = {value.name, critic_update.name}
    final_edges, readers = [], {}
    for edge in edges:
        if edge.src in removed or edge.dst in removed:
            if edge.payload == Payload.CRITIC_PARAMS and edge.dst not in removed:
                readers[edge.dst] = dataclasses.replace(edge, src=actor_update.name, payload=Payload.ACTOR_PARAMS)
            continue
        final_edges.append(edge)
    stages = []
    for stage in graph.stages:
        if stage.name in removed:
            continue
        stage = {old.name: old, actor_update.name: actor_update}.get(stage.name, stage)
        if stage.name in readers:
            inputs = [p for p in stage.inputs if p != Payload.CRITIC_PARAMS]
            if Payload.ACTOR_PARAMS in inputs:
                raise GraphError(
                    f"share_actor_critic: stage {stage.name!r} reads both params:actor and params:critic", stage=stage.name)
            stage = dataclasses.replace(stage, inputs=(*inputs, str(Payload.ACTOR_PARAMS)))
            final_edges.append(readers[stage.name])
        stages.append(stage)
    return _rebuild(graph, stages=_dissolve_singleton_groups(stages), edges=final_edges)


def _dissolve_singleton_groups(stages: Sequence[Stage]) -> list[Stage]:
    counts: dict[str, int] = {}
    for stage in stages:
        if stage.fused_group is not None:
            counts[stage.fused_group] = counts.get(stage.fused_group, 0) + 1
    return [
        dataclasses.replace(s, fused_group=None) if s.fused_group is not None and counts[s.fused_group] < 2 else s
        for s in stages
    ]


# ------------------------------------------------------------------------------------------------ fusion
def fuse(graph: Graph, stages: Sequence[str], *, group: str | None = None) -> Graph:
    """Stages reading the same batch on the same placement become one fused group (one jitted program).

    `group` defaults to the member names joined by "+" in topological order. Refused for fewer than two
    stages, unknown or host stages, stages already fused, different placements/parallel sizes/micro-batch
    counts, no common batch, or a same-step dependency between members.
    """
    names = list(dict.fromkeys(stages))
    if len(names) < 2:
        raise GraphError(f"fuse: needs at least two distinct stages, got {list(stages)}", stage=names[0] if names else None)
    members = [graph.stage(name) for name in names]
    for stage in members:
        if stage.fused_group is not None:
            raise GraphError(f"fuse: stage {stage.name!r} is already in fused group {stage.fused_group!r}", stage=stage.name)
    order = graph.topological_order()
    members.sort(key=lambda s: order.index(s.name))
    group = group or "+".join(s.name for s in members)
    if any(s.fused_group == group for s in graph.stages):
        raise GraphError(f"fuse: group name {group!r} is already used")
    check_fusable(graph, members, group)
    return _rebuild(graph, stages=replace_stages(graph, [dataclasses.replace(s, fused_group=group) for s in members]).stages)


def default_fusion(graph: Graph) -> Graph:
    """Fuses every legal group of unfused inference stages (reference/old log-probs, values).

    Candidates are grouped greedily in topological order: a stage joins the first open group it can legally
    fuse with (same placement, parallel sizes and micro-batch count, a shared batch, no dependency).
    Returns the graph unchanged (validated) when nothing can fuse.
    """
    candidates = [
        graph.stage(name) for name in graph.topological_order()
        if graph.stage(name).fused_group is None and not graph.stage(name).host
        and INFERENCE_KINDS.intersection(graph.stage(name).kinds)
    ]
    groups: list[list[Stage]] = []
    for stage in candidates:
        for members in groups:
            try:
                check_fusable(graph, [*members, stage], "candidate")
            except GraphError:
                continue
            members.append(stage)
            break
        else:
            groups.append([stage])
    for members in groups:
        if len(members) > 1:
            graph = fuse(graph, [s.name for s in members])
    return graph.validate()


# ------------------------------------------------------------------------------------------ scheduling
def microbatch(graph: Graph, stage: str, n: int) -> Graph:
    """The stage runs in `n` pieces so that its consumers can start on finished pieces; n = 1 undoes it.

    A fused stage's whole group is split (a group is one program). Refused for n < 1 and for weight_sync,
    which moves whole parameter sets and has no batch to split.
    """
    target = graph.stage(stage)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GraphError(f"microbatch: stage {stage!r} needs an integer number of micro-batches >= 1, got {n!r}", stage=stage)
    if StageKind.WEIGHT_SYNC in target.kinds:
        raise GraphError(f"microbatch: stage {stage!r} is a weight sync; it moves parameters, not a batch", stage=stage)
    members = _group_members(graph, stage)
    return _rebuild(graph, stages=replace_stages(graph, [dataclasses.replace(s, microbatches=n) for s in members]).stages)


# ------------------------------------------------------------------------------------------- placement
def place(graph: Graph, stage: str, submesh: str, parallel: Mapping[str, int] | None = None,
          *, devices: Sequence[int] | None = None) -> Graph:
    """Puts `stage` (with its fused group) on the sub-mesh `submesh` with `parallel` axis sizes.

    A new sub-mesh is created from `parallel` (required then) and optional explicit `devices`; the sizes must
    fit the graph's device count. On an existing sub-mesh, `parallel` (optional) becomes the stage's own
    layout and must multiply to that sub-mesh's size; `devices`, if given, must match it. Stages on the same
    sub-mesh time-share its devices; stages on disjoint sub-meshes can overlap in time.
    """
    target = graph.stage(stage)
    if target.host:
        raise GraphError(f"place: stage {stage!r} runs on the host controller and has no sub-mesh", stage=stage)
    if submesh == HOST_PLACEMENT:
        raise GraphError(f"place: stage {stage!r} is a device stage and cannot move to {HOST_PLACEMENT!r}", stage=stage)
    placements = dict(graph.placements)
    existing = placements.get(submesh)
    if existing is None:
        if parallel is None:
            raise GraphError(f"place: stage {stage!r} goes to new sub-mesh {submesh!r}, which needs parallel sizes", stage=stage)
        try:
            placement = Placement(name=submesh, parallel=parallel, devices=None if devices is None else tuple(devices))
        except GraphError as error:
            raise GraphError(f"place: stage {stage!r}: {error}", stage=stage) from None
        if placement.size > graph.num_devices:
            raise GraphError(
                f"place: stage {stage!r} on {submesh!r} needs {placement.size} devices ({dict(placement.parallel)}), "
                f"the graph has {graph.num_devices}", stage=stage)
        if placement.devices is not None and max(placement.devices) >= graph.num_devices:
            raise GraphError(
                f"place: stage {stage!r} on {submesh!r} uses device {max(placement.devices)}, the graph has devices "
                f"0..{graph.num_devices - 1}", stage=stage)
        placements[submesh] = placement
        own_parallel = None
    else:
        if devices is not None and tuple(devices) != existing.devices:
            raise GraphError(
                f"place: stage {stage!r}: sub-mesh {submesh!r} already has devices {existing.devices}, got {tuple(devices)}",
                stage=stage)
        own_parallel = None
        if parallel is not None:
            size = math.prod(parallel.values()) if isinstance(parallel, Mapping) else None
            if size != existing.size:
                raise GraphError(
                    f"place: stage {stage!r} parallel sizes {parallel!r} multiply to {size}, but sub-mesh {submesh!r} "
                    f"has {existing.size} devices", stage=stage)
            own_parallel = None if dict(parallel) == dict(existing.parallel) else parallel
    moved = [dataclasses.replace(s, placement=submesh, parallel=own_parallel) for s in _group_members(graph, stage)]
    stages = replace_stages(graph, moved).stages
    used = {s.placement for s in stages}  # a sub-mesh no stage runs on any more is dropped
    return _rebuild(graph, stages=stages, placements={name: p for name, p in placements.items() if name in used})


ROLLOUT_PLACEMENT, TRAIN_PLACEMENT = "rollout", "train"


def disaggregate(graph: Graph, rollout_devices: int, rollout: Mapping[str, int], train: Mapping[str, int]) -> Graph:
    """Generation on its own devices, everything else on the rest: the generate stage goes to sub-mesh
    `rollout` (devices 0 .. rollout_devices-1, layout `rollout`), every other device stage to `train` (the
    remaining devices, layout `train`). The two then overlap in time under an asynchrony bound k >= 1."""
    n = graph.num_devices
    if isinstance(rollout_devices, bool) or not isinstance(rollout_devices, int) or not 0 < rollout_devices < n:
        raise GraphError(f"disaggregate: rollout_devices must leave devices to both sides of the graph's {n}, "
                         f"got {rollout_devices!r}")
    sides = {ROLLOUT_PLACEMENT: (rollout, range(rollout_devices)), TRAIN_PLACEMENT: (train, range(rollout_devices, n))}
    for name, (sizes, devices) in sides.items():
        if not isinstance(sizes, Mapping) or math.prod(sizes.values()) != len(devices):
            raise GraphError(f"disaggregate: the {name} layout {sizes!r} must multiply to its {len(devices)} devices")
    generates = [s.name for s in graph.stages if StageKind.GENERATE in s.kinds]
    if len(generates) != 1:
        raise GraphError(f"disaggregate: needs exactly one generate stage, found {generates}")
    for stage in [s.name for s in graph.stages if not s.host]:
        side = ROLLOUT_PLACEMENT if stage in generates else TRAIN_PLACEMENT
        if graph.stage(stage).placement != side:  # fused partners moved with an earlier stage
            sizes, devices = sides[side]
            graph = place(graph, stage, side, dict(sizes), devices=tuple(devices))
    return graph


__all__ = ["ROLLOUT_PLACEMENT", "TRAIN_PLACEMENT", "bounded_async", "default_fusion", "disaggregate", "fuse", "microbatch",
           "place", "share_actor_critic"]
