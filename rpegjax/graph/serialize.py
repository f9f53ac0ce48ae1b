"""JSON-ready dicts for RPEGs (`Graph.to_dict` / `Graph.from_dict`); a round trip gives an equal graph."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rpegjax.graph.ir import Edge, Execution, Graph, GraphError, Placement, Stage

GRAPH_FORMAT = "rpegjax-graph-1"


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    return {
        "format": GRAPH_FORMAT,
        "name": graph.name,
        "algorithm": None if graph.algorithm is None else graph.algorithm.value,
        "async_bound": graph.async_bound,
        "num_devices": graph.num_devices,
        "execution": graph.execution.to_dict(),
        "external": list(graph.external),
        "placements": [
            {"name": p.name, "parallel": dict(p.parallel), "devices": None if p.devices is None else list(p.devices)}
            for p in graph.placements.values()
        ],
        "stages": [
            {
                "name": s.name, "kind": s.kind.value, "role": s.role.value, "placement": s.placement,
                "inputs": list(s.inputs), "outputs": list(s.outputs),
                "parallel": None if s.parallel is None else dict(s.parallel),
                "microbatches": s.microbatches, "fused_group": s.fused_group, "host": s.host,
                "merged_kinds": [k.value for k in s.merged_kinds], "options": dict(s.options),
            }
            for s in graph.stages
        ],
        "edges": [
            {"src": e.src, "dst": e.dst, "payload": e.payload, "version_offset": e.version_offset} for e in graph.edges
        ],
    }


def graph_from_dict(data: Mapping[str, Any]) -> Graph:
    """Rebuilds a graph (not validated: call `.validate()`); GraphError when `data` is not a graph dict."""
    if not isinstance(data, Mapping):
        raise GraphError(f"graph JSON must be an object, got {type(data).__name__}")
    if data.get("format", GRAPH_FORMAT) != GRAPH_FORMAT:
        raise GraphError(f"graph JSON has format {data.get('format')!r}; this version reads {GRAPH_FORMAT!r}")
    try:
        placements = {
            p["name"]: Placement(name=p["name"], parallel=p["parallel"],
                                 devices=None if p["devices"] is None else tuple(p["devices"]))
            for p in data["placements"]
        }
        stages = tuple(
            Stage(**{**s, "inputs": tuple(s["inputs"]), "outputs": tuple(s["outputs"]),
                     "merged_kinds": tuple(s["merged_kinds"])})
            for s in data["stages"]
        )
        edges = tuple(Edge(**e) for e in data["edges"])
        # graphs written before execution options existed run with the defaults (the runtime's own)
        execution = Execution.from_dict(data.get("execution", {}), where="graph JSON execution")
        return Graph(stages=stages, edges=edges, placements=placements, async_bound=data["async_bound"],
                     num_devices=data["num_devices"], external=tuple(data["external"]),
                     algorithm=data["algorithm"], name=data["name"], execution=execution)
    except (KeyError, TypeError) as error:
        raise GraphError(f"graph JSON is malformed: {type(error).__name__}: {error}") from None
