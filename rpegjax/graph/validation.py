"""Whole-graph rules of the RPEG (`Graph.validate()` calls `validate_graph`).

Each rule raises `GraphError` whose message and `.stage` name the offending stage:

1. stage names are unique; edges join existing stages, carry a payload the producer writes and the consumer
   reads, and no (src, dst, payload) edge repeats;
2. every stage input arrives over exactly one edge, or is listed in `Graph.external` (never both);
3. version offsets point back in time (>= 0) and no further than the asynchrony bound: `async_bound` for data,
   `async_bound + 1` for `params:` payloads (the update's output is read one step later, see `ir`);
4. same-step (offset 0) edges form no cycle;
5. device stages name an existing placement; placements fit `num_devices`; a stage's own parallel sizes
   multiply to its placement's size;
6. a fused group has >= 2 device stages sharing placement, parallel sizes, micro-batch count and a batch (a
   data input from the same producer, payload and offset), none depending on another within the step.
"""

from __future__ import annotations

import math
from collections import Counter

from rpegjax.graph.ir import Graph, GraphError, Stage


def batch_inputs(graph: Graph, name: str) -> frozenset[tuple[str, str, int]]:
    """The (src, payload, offset) data edges (not parameters) that `name` reads: the batches it consumes."""
    return frozenset((e.src, e.payload, e.version_offset) for e in graph.in_edges(name) if not e.is_params)


def validate_graph(graph: Graph) -> None:
    _check_names(graph)
    _check_edges(graph)
    _check_inputs(graph)
    _check_offsets(graph)
    graph.topological_order()  # raises on a same-step cycle, naming the stages on it
    _check_placements(graph)
    _check_fused_groups(graph)
    _check_partial_rollouts(graph)


def _check_partial_rollouts(graph: Graph) -> None:
    lag = graph.execution.max_token_lag
    if graph.execution.partial_rollouts and lag is not None and lag <= graph.async_bound:
        raise GraphError(f"Execution.max_token_lag ({lag}) must exceed the asynchrony bound ({graph.async_bound}): new "
                         "tokens already lag by it, no sequence could be carried")


def _check_names(graph: Graph) -> None:
    if not graph.stages:
        raise GraphError("graph has no stages")
    counts = Counter(graph.stage_names)
    for name, count in counts.items():
        if count > 1:
            raise GraphError(f"stage {name!r} is declared {count} times; stage names must be unique", stage=name)
    external = Counter(graph.external)
    for payload, count in external.items():
        if count > 1:
            raise GraphError(f"external payload {payload!r} is listed {count} times")


def _check_edges(graph: Graph) -> None:
    stages = {s.name: s for s in graph.stages}
    seen: set[tuple[str, str, str]] = set()
    for edge in graph.edges:
        if edge.dst not in stages:
            raise GraphError(f"edge {edge.label()} goes to unknown stage {edge.dst!r}", stage=edge.dst)
        if edge.src not in stages:
            raise GraphError(f"stage {edge.dst!r} reads {edge.payload!r} from unknown stage {edge.src!r}", stage=edge.dst)
        if edge.payload not in stages[edge.src].outputs:
            raise GraphError(
                f"stage {edge.src!r} does not output {edge.payload!r} (outputs {list(stages[edge.src].outputs)}), "
                f"but stage {edge.dst!r} reads it from there", stage=edge.src)
        if edge.payload not in stages[edge.dst].inputs:
            raise GraphError(
                f"stage {edge.dst!r} receives {edge.payload!r} from {edge.src!r} but does not list it as an input "
                f"(inputs {list(stages[edge.dst].inputs)})", stage=edge.dst)
        key = (edge.src, edge.dst, edge.payload)
        if key in seen:
            raise GraphError(f"stage {edge.dst!r} reads {edge.payload!r} from {edge.src!r} over two edges", stage=edge.dst)
        seen.add(key)


def _check_inputs(graph: Graph) -> None:
    external = set(graph.external)
    for stage in graph.stages:
        for payload in stage.inputs:
            sources = [e.src for e in graph.in_edges(stage.name) if e.payload == payload]
            if payload in external and sources:
                raise GraphError(
                    f"stage {stage.name!r} input {payload!r} is external but also arrives from {sources}", stage=stage.name)
            if payload not in external and not sources:
                raise GraphError(
                    f"stage {stage.name!r} input {payload!r} has no producer (no edge brings it and it is not external)",
                    stage=stage.name)
            if len(sources) > 1:
                raise GraphError(f"stage {stage.name!r} input {payload!r} has several producers {sources}", stage=stage.name)


def _check_offsets(graph: Graph) -> None:
    for edge in graph.edges:
        if edge.version_offset < 0:
            raise GraphError(
                f"stage {edge.dst!r} reads {edge.payload!r} from {edge.src!r} with offset {edge.version_offset}: "
                "edges may only point back in time (offset >= 0)", stage=edge.dst)
        bound = graph.async_bound + 1 if edge.is_params else graph.async_bound
        if edge.version_offset > bound:
            what = "parameter edges" if edge.is_params else "data edges"
            raise GraphError(
                f"stage {edge.dst!r} reads {edge.payload!r} from {edge.src!r} {edge.version_offset} steps back, but "
                f"with async_bound={graph.async_bound} {what} may reach at most {bound} steps back", stage=edge.dst)
        if edge.version_offset == 0 and edge.src == edge.dst:
            raise GraphError(f"stage {edge.dst!r} reads its own output {edge.payload!r} within the same step", stage=edge.dst)


def _check_placements(graph: Graph) -> None:
    for placement in graph.placements.values():
        if placement.size > graph.num_devices:
            raise GraphError(
                f"placement {placement.name!r} needs {placement.size} devices ({dict(placement.parallel)}) but the graph "
                f"has {graph.num_devices}")
        if placement.devices is not None and max(placement.devices) >= graph.num_devices:
            raise GraphError(
                f"placement {placement.name!r} uses device {max(placement.devices)} but the graph has devices "
                f"0..{graph.num_devices - 1}")
    for stage in graph.stages:
        if stage.host:
            continue
        if stage.placement not in graph.placements:
            raise GraphError(
                f"stage {stage.name!r} is placed on unknown placement {stage.placement!r} "
                f"(placements: {list(graph.placements)})", stage=stage.name)
        placement = graph.placements[stage.placement]
        if stage.parallel is not None and math.prod(stage.parallel.values()) != placement.size:
            raise GraphError(
                f"stage {stage.name!r} parallel sizes {dict(stage.parallel)} multiply to "
                f"{math.prod(stage.parallel.values())}, but placement {placement.name!r} has {placement.size} devices",
                stage=stage.name)


def check_fusable(graph: Graph, members: list[Stage], group: str) -> None:
    """Raises unless `members` may run as one program (rule 6); shared by validation and `transforms.fuse`."""
    if len(members) < 2:
        names = [m.name for m in members]
        raise GraphError(f"fused group {group!r} needs at least two stages, got {names}", stage=names[0] if names else None)
    first = members[0]
    for stage in members:
        if stage.host:
            raise GraphError(f"stage {stage.name!r} runs on the host and cannot join fused group {group!r}", stage=stage.name)
    for stage in members[1:]:
        if stage.placement != first.placement:
            raise GraphError(
                f"stage {stage.name!r} (placement {stage.placement!r}) cannot fuse with {first.name!r} "
                f"(placement {first.placement!r}) in group {group!r}: fused stages share one placement", stage=stage.name)
        if graph.parallel_of(stage.name) != graph.parallel_of(first.name):
            raise GraphError(
                f"stage {stage.name!r} parallel sizes {dict(graph.parallel_of(stage.name))} differ from {first.name!r} "
                f"{dict(graph.parallel_of(first.name))} in group {group!r}", stage=stage.name)
        if stage.microbatches != first.microbatches:
            raise GraphError(
                f"stage {stage.name!r} has {stage.microbatches} micro-batches but {first.name!r} has "
                f"{first.microbatches} in group {group!r}", stage=stage.name)
    shared = frozenset.intersection(*(batch_inputs(graph, m.name) for m in members))
    if not shared:
        names = [m.name for m in members]
        raise GraphError(
            f"stages {names} read no common batch (same producer, payload and offset), so they cannot fuse "
            f"in group {group!r}", stage=names[-1])
    for later in members:
        for earlier in members:
            if later is not earlier and graph.depends_on(later.name, earlier.name):
                raise GraphError(
                    f"stage {later.name!r} depends on {earlier.name!r} within the step, so they cannot fuse "
                    f"in group {group!r}", stage=later.name)


def _check_fused_groups(graph: Graph) -> None:
    groups: dict[str, list[Stage]] = {}
    for stage in graph.stages:
        if stage.fused_group is not None:
            groups.setdefault(stage.fused_group, []).append(stage)
    for group, members in groups.items():
        check_fusable(graph, members, group)
