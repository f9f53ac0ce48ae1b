"""Human-readable views of an RPEG: a text listing and a Graphviz DOT picture."""

from __future__ import annotations

from rpegjax.graph.ir import Graph, Stage

_KIND_COLOURS = {
    "generate": "#8dd3c7", "reward": "#ffffb3", "ref_logprob": "#bebada", "old_logprob": "#fb8072",
    "critic_value": "#80b1d3", "advantage": "#fdb462", "actor_update": "#b3de69", "critic_update": "#fccde5",
    "weight_sync": "#d9d9d9",
}


def _sizes(sizes) -> str:
    return "x".join(f"{axis}={size}" for axis, size in sizes.items())


def _stage_line(graph: Graph, stage: Stage) -> str:
    where = "host" if stage.host else f"{stage.placement}[{_sizes(graph.parallel_of(stage.name))}]"
    extras = []
    if stage.merged_kinds:
        extras.append("+" + "+".join(k.value for k in stage.merged_kinds))
    if stage.microbatches > 1:
        extras.append(f"microbatches={stage.microbatches}")
    if stage.fused_group:
        extras.append(f"fused={stage.fused_group}")
    extras += [f"{key}={value}" for key, value in stage.options.items()]
    reads = ", ".join(
        f"{e.payload}<-{e.src}" + (f"@t-{e.version_offset}" if e.version_offset else "")
        for e in graph.in_edges(stage.name)
    )
    external = [p for p in stage.inputs if p in graph.external]
    if external:
        reads = ", ".join(filter(None, [reads, *(f"{p}<-external" for p in external)]))
    tail = f" ({'; '.join(extras)})" if extras else ""
    return f"  {stage.name}: {stage.kind.value}/{stage.role.value} on {where}{tail}\n      reads {reads or '-'}"


def graph_to_text(graph: Graph) -> str:
    """A listing: header, placements, then stages in topological order with what each reads."""
    header = f"RPEG {graph.name or '(unnamed)'}"
    if graph.algorithm is not None:
        header += f" [{graph.algorithm.value}]"
    lines = [f"{header}: async_bound={graph.async_bound}, devices={graph.num_devices}", "placements:"]
    for placement in graph.placements.values():
        devices = "any" if placement.devices is None else ",".join(map(str, placement.devices))
        lines.append(f"  {placement.name}: {placement.size} devices ({devices}) {_sizes(placement.parallel)}")
    lines.append("stages:")
    lines += [_stage_line(graph, graph.stage(name)) for name in graph.topological_order()]
    return "\n".join(lines)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def graph_to_dot(graph: Graph) -> str:
    """Graphviz DOT: one cluster per placement (and host), nested clusters per fused group; cross-step edges
    are dashed and labelled with their offset."""
    lines = [f"digraph {_quote(graph.name or 'rpeg')} {{", "  rankdir=TB;", "  node [shape=box, style=filled];"]
    clusters: dict[str, list[Stage]] = {}
    for stage in graph.stages:
        clusters.setdefault(stage.placement, []).append(stage)
    for index, (placement, stages) in enumerate(clusters.items()):
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f"    label={_quote(placement)};")
        groups: dict[str | None, list[Stage]] = {}
        for stage in stages:
            groups.setdefault(stage.fused_group, []).append(stage)
        for group_index, (group, members) in enumerate(groups.items()):
            indent = "    "
            if group is not None:
                lines.append(f"    subgraph cluster_{index}_{group_index} {{ label={_quote('fused: ' + group)}; style=dashed;")
                indent = "      "
            for stage in members:
                parts = [stage.name, f"{stage.kind.value}/{stage.role.value}"]
                if stage.merged_kinds:
                    parts.append("+" + "+".join(k.value for k in stage.merged_kinds))
                if stage.microbatches > 1:
                    parts.append(f"x{stage.microbatches} micro-batches")
                label = "\\n".join(_quote(part)[1:-1] for part in parts)  # DOT's own line break
                colour = _KIND_COLOURS.get(stage.kind.value, "white")
                lines.append(f"{indent}{_quote(stage.name)} [label=\"{label}\", fillcolor={_quote(colour)}];")
            if group is not None:
                lines.append("    }")
        lines.append("  }")
    for edge in graph.edges:
        attributes = [f"label={_quote(edge.payload + (f' @t-{edge.version_offset}' if edge.version_offset else ''))}"]
        if edge.version_offset:
            attributes += ["style=dashed", "constraint=false"]
        lines.append(f"  {_quote(edge.src)} -> {_quote(edge.dst)} [{', '.join(attributes)}];")
    lines.append("}")
    return "\n".join(lines)
