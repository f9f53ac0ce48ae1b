"""The RPEG IR: construction checks, every validation rule (messages name the stage), queries, version
convention, JSON round trip and renderings. Hand-built graphs, independent of the builders."""

import dataclasses
import json

import pytest

from rpegjax.graph import (
    HOST_PLACEMENT,
    Edge,
    Graph,
    GraphError,
    Placement,
    Role,
    Stage,
    StageKind,
    default_fusion,
    grpo_graph,
    microbatch,
    place,
    ppo_graph,
)
from rpegjax.graph.validation import batch_inputs


def _stage(name, kind, role=Role.ACTOR, *, inputs=(), outputs=(), host=False, **kwargs):
    return Stage(name=name, kind=kind, role=Role.NONE if host else role, placement=HOST_PLACEMENT if host else "all",
                 inputs=inputs, outputs=outputs, host=host, **kwargs)


def _toy(**changes) -> Graph:
    """generate -> reward -> {ref, old} -> update -> (next step) generate, written out by hand."""
    stages = (
        _stage("gen", StageKind.GENERATE, inputs=("prompts", "params:actor"), outputs=("responses",)),
        _stage("score", StageKind.REWARD, inputs=("responses",), outputs=("rewards",), host=True),
        _stage("ref", StageKind.REF_LOGPROB, Role.REFERENCE, inputs=("responses", "params:reference"), outputs=("ref",)),
        _stage("old", StageKind.OLD_LOGPROB, inputs=("responses", "params:actor"), outputs=("old",)),
        _stage("update", StageKind.ACTOR_UPDATE, inputs=("responses", "rewards", "ref", "old", "params:actor"),
               outputs=("params:actor",)),
    )
    edges = (
        Edge(src="update", dst="gen", payload="params:actor", version_offset=1),
        Edge(src="gen", dst="score", payload="responses"),
        Edge(src="gen", dst="ref", payload="responses"),
        Edge(src="gen", dst="old", payload="responses"),
        Edge(src="update", dst="old", payload="params:actor", version_offset=1),
        Edge(src="gen", dst="update", payload="responses"),
        Edge(src="score", dst="update", payload="rewards"),
        Edge(src="ref", dst="update", payload="ref"),
        Edge(src="old", dst="update", payload="old"),
        Edge(src="update", dst="update", payload="params:actor", version_offset=1),
    )
    fields = dict(stages=stages, edges=edges, placements={"all": Placement(name="all", parallel={"data": 2, "tensor": 2})},
                  async_bound=0, num_devices=4, external=("prompts", "params:reference"), name="toy")
    fields.update(changes)
    return Graph(**fields)


def _with_stage(graph, name, **changes):
    return dataclasses.replace(graph, stages=tuple(dataclasses.replace(s, **changes) if s.name == name else s
                                                   for s in graph.stages))


def _with_edges(graph, *, drop=(), add=()):
    edges = [e for e in graph.edges if (e.src, e.dst, e.payload) not in drop]
    return dataclasses.replace(graph, edges=tuple(edges) + tuple(add))


def _fails(graph, stage, *words):
    with pytest.raises(GraphError) as info:
        graph.validate()
    assert info.value.stage == stage, str(info.value)
    assert repr(stage) in str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_toy_graph_is_valid_and_ordered():
    graph = _toy().validate()
    assert graph.topological_order() == ("gen", "score", "ref", "old", "update")
    assert graph.producers("update") == ("gen", "score", "ref", "old", "update")
    assert graph.producers("update", same_step=True) == ("gen", "score", "ref", "old")
    assert graph.consumers("gen") == ("score", "ref", "old", "update")
    assert graph.consumers("update", same_step=True) == ()
    assert graph.stage("old").kind is StageKind.OLD_LOGPROB
    assert graph.placement_of("score") is None and graph.placement_of("ref").size == 4
    assert graph.depends_on("update", "gen") and not graph.depends_on("gen", "update")
    assert batch_inputs(graph, "ref") == frozenset({("gen", "responses", 0)})


def test_topological_order_is_declaration_order_on_ties_and_respects_edges():
    graph = _toy()
    reordered = dataclasses.replace(graph, stages=tuple(reversed(graph.stages))).validate()
    order = reordered.topological_order()
    for edge in graph.edges:
        if edge.version_offset == 0:
            assert order.index(edge.src) < order.index(edge.dst)
    assert order == ("gen", "old", "ref", "score", "update")  # reversed declaration among independent stages


def test_unknown_stage_lookup_names_it():
    with pytest.raises(GraphError, match="'nope'"):
        _toy().stage("nope")


# ----------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("changes, words", [
    (dict(microbatches=0), "microbatches"),
    (dict(microbatches=True), "microbatches"),
    (dict(kind="bogus"), "bogus"),
    (dict(role="bogus"), "bogus"),
    (dict(host=True), "role"),
    (dict(placement=HOST_PLACEMENT), "placement"),
    (dict(inputs=("a", "a")), "inputs"),
    (dict(parallel={"data": 0}), "data"),
    (dict(fused_group=""), "fused_group"),
    (dict(options={"epochs": [1]}), "epochs"),
])
def test_stage_construction_errors_name_the_stage(changes, words):
    fields = dict(name="old", kind="old_logprob", role="actor", placement="all") | changes
    with pytest.raises(GraphError) as info:
        Stage(**fields)
    assert "'old'" in str(info.value) and words in str(info.value)


def test_stage_accepts_enum_string_values():
    stage = Stage(name="g", kind="generate", role="actor", placement="all")
    assert stage.kind is StageKind.GENERATE and stage.role is Role.ACTOR


def test_placement_checks():
    assert Placement(name="p", parallel={"data": 2, "tensor": 2}).size == 4
    assert Placement(name="p", parallel={"data": 2}, devices=(3, 5)).devices == (3, 5)
    with pytest.raises(GraphError, match="multiply to 4"):
        Placement(name="p", parallel={"data": 2, "tensor": 2}, devices=(0, 1))
    with pytest.raises(GraphError, match="duplicates"):
        Placement(name="p", parallel={"data": 2}, devices=(1, 1))
    with pytest.raises(GraphError, match="'tensor'"):
        Placement(name="p", parallel={"tensor": -1})
    with pytest.raises(GraphError, match="non-empty"):
        Placement(name="p", parallel={})
    with pytest.raises(GraphError, match="host"):
        Placement(name=HOST_PLACEMENT, parallel={"data": 1})
    assert hash(Placement(name="p", parallel={"data": 2})) == hash(Placement(name="p", parallel={"data": 2}))


def test_edge_read_version_follows_the_convention():
    params = Edge(src="update", dst="gen", payload="params:actor", version_offset=3)
    assert [params.read_version(t) for t in range(6)] == [0, 0, 0, 1, 2, 3]  # staleness 2 once warmed up
    assert Edge(src="update", dst="old", payload="params:actor", version_offset=1).read_version(7) == 7
    assert Edge(src="gen", dst="score", payload="responses").read_version(7) == 7
    assert Edge(src="gen", dst="update", payload="responses", version_offset=2).read_version(7) == 5


def test_graph_construction_checks_fields():
    with pytest.raises(GraphError, match="async_bound"):
        _toy(async_bound=-1)
    with pytest.raises(GraphError, match="num_devices"):
        _toy(num_devices=0)
    with pytest.raises(GraphError, match="placements\\['x'\\]"):
        _toy(placements={"x": Placement(name="all", parallel={"data": 1})})


# ----------------------------------------------------------------------------------------- validation
def test_duplicate_stage_name():
    graph = _toy()
    _fails(dataclasses.replace(graph, stages=graph.stages + (graph.stage("ref"),)), "ref", "unique")


def test_edge_to_unknown_stage():
    _fails(_with_edges(_toy(), add=[Edge(src="gen", dst="ghost", payload="responses")]), "ghost", "unknown")


def test_edge_from_unknown_stage():
    graph = _with_edges(_toy(), drop=[("score", "update", "rewards")],
                        add=[Edge(src="ghost", dst="update", payload="rewards")])
    _fails(graph, "update", "unknown stage 'ghost'")


def test_edge_payload_not_written_by_producer():
    graph = _with_edges(_toy(), drop=[("score", "update", "rewards")], add=[Edge(src="ref", dst="update", payload="rewards")])
    _fails(graph, "ref", "does not output 'rewards'")


def test_edge_payload_not_an_input_of_consumer():
    _fails(_with_edges(_toy(), add=[Edge(src="gen", dst="score", payload="params:actor")]), "gen")
    graph = _with_edges(_toy(), add=[Edge(src="old", dst="score", payload="old")])
    _fails(graph, "score", "does not list it")


def test_input_without_producer():
    _fails(_with_edges(_toy(), drop=[("old", "update", "old")]), "update", "input 'old' has no producer")
    _fails(_toy(external=("prompts",)), "ref", "'params:reference' has no producer")


def test_input_both_external_and_produced():
    _fails(_toy(external=("prompts", "params:reference", "rewards")), "update", "external but also")


def test_input_with_two_producers():
    graph = _with_stage(_toy(), "old", outputs=("old", "rewards"))
    _fails(_with_edges(graph, add=[Edge(src="old", dst="update", payload="rewards")]), "update", "several producers")


def test_edges_point_back_in_time_only():
    graph = _with_edges(_toy(), drop=[("update", "gen", "params:actor")],
                        add=[Edge(src="update", dst="gen", payload="params:actor", version_offset=-1)])
    _fails(graph, "gen", "back in time")


def _reroute(graph, src, dst, payload, offset):
    return _with_edges(graph, drop=[(src, dst, payload)], add=[Edge(src=src, dst=dst, payload=payload, version_offset=offset)])


def test_parameter_edges_reach_at_most_async_bound_plus_one():
    beyond = _reroute(_toy(), "update", "gen", "params:actor", 2)
    _fails(beyond, "gen", "async_bound=0", "at most 1")
    assert dataclasses.replace(beyond, async_bound=1).validate().async_bound == 1
    _fails(_reroute(_toy(async_bound=1), "update", "gen", "params:actor", 3), "gen", "async_bound=1", "at most 2")


def test_data_edges_reach_at_most_async_bound():
    one_back = _reroute(_toy(async_bound=1), "gen", "update", "responses", 1)
    assert one_back.validate().async_bound == 1
    _fails(dataclasses.replace(one_back, async_bound=0), "update", "data edges may reach at most 0")
    _fails(_reroute(_toy(async_bound=1), "gen", "update", "responses", 2), "update", "data edges may reach at most 1")


def test_same_step_self_edge_and_cycle():
    graph = _with_edges(_toy(), drop=[("update", "update", "params:actor")],
                        add=[Edge(src="update", dst="update", payload="params:actor")])
    _fails(graph, "update", "same step")
    cyclic = _with_stage(_toy(), "gen", inputs=("prompts", "params:actor", "old"))
    cyclic = _with_edges(cyclic, add=[Edge(src="old", dst="gen", payload="old")])
    with pytest.raises(GraphError, match="cycle") as info:
        cyclic.validate()
    assert info.value.stage == "gen" and "'old'" in str(info.value)


def test_unknown_placement():
    _fails(_with_stage(_toy(), "ref", placement="elsewhere"), "ref", "unknown placement 'elsewhere'")


def test_placement_must_fit_devices():
    with pytest.raises(GraphError, match="'all' needs 4 devices"):
        _toy(num_devices=2).validate()
    far = Placement(name="far", parallel={"data": 2}, devices=(3, 4))
    with pytest.raises(GraphError, match="'far' uses device 4"):
        _toy(placements={**_toy().placements, "far": far}).validate()


def test_stage_parallel_must_multiply_to_placement_size():
    assert _with_stage(_toy(), "gen", parallel={"tensor": 4}).validate().parallel_of("gen") == {"tensor": 4}
    _fails(_with_stage(_toy(), "gen", parallel={"tensor": 2}), "gen", "multiply to 2")


def test_fused_group_rules():
    fused = _with_stage(_with_stage(_toy(), "ref", fused_group="inf"), "old", fused_group="inf").validate()
    assert fused.fused_groups() == {"inf": ("ref", "old")}
    assert fused.execution_units() == (("gen",), ("score",), ("ref", "old"), ("update",))

    _fails(_with_stage(_toy(), "ref", fused_group="alone"), "ref", "at least two")
    _fails(_with_stage(fused, "old", microbatches=2), "old", "micro-batches")
    spread = dataclasses.replace(fused, placements={**fused.placements, "b": Placement(name="b", parallel={"data": 4})})
    _fails(_with_stage(spread, "old", placement="b"), "old", "share one placement")
    _fails(_with_stage(fused, "old", parallel={"tensor": 4}), "old", "parallel sizes")
    # a host stage cannot be fused (its construction already requires the host placement)
    host_fused = _with_stage(_with_stage(_toy(), "score", fused_group="h"), "ref", fused_group="h")
    _fails(host_fused, "score", "host")
    # update reads the batch too, but depends on ref within the step
    _fails(_with_stage(_with_stage(_toy(), "ref", fused_group="d"), "update", fused_group="d"), "update", "depends on 'ref'")
    # gen reads no common batch with ref
    _fails(_with_stage(_with_stage(_toy(), "gen", fused_group="n"), "ref", fused_group="n"), "ref", "no common batch")


def test_empty_graph_is_invalid():
    with pytest.raises(GraphError, match="no stages"):
        Graph(stages=(), edges=(), placements={}).validate()


# ----------------------------------------------------------------------------------- serialisation
def _variety():
    yield _toy()
    yield grpo_graph(use_reference=True, async_bound=2, num_devices=8)
    ppo = default_fusion(ppo_graph(use_reference=True, critic="shared", async_bound=1, num_devices=4, minibatches=4))
    yield microbatch(place(ppo, "generate", "gen", {"data": 1, "tensor": 2}, devices=(2, 3)), "generate", 8)
    yield place(grpo_graph(use_reference=False, num_devices=4, parallel={"fsdp": 4}), "generate", "all", {"data": 2, "tensor": 2})


@pytest.mark.parametrize("graph", list(_variety()), ids=lambda g: g.name)
def test_json_round_trip_is_exact(graph):
    text = graph.to_json()
    again = Graph.from_json(text)
    assert again == graph
    assert again.to_json() == text
    assert Graph.from_json(graph.to_json(indent=None)) == graph
    assert json.loads(text)["format"] == "rpegjax-graph-1"
    assert hash(again) == hash(graph)


def test_json_errors():
    with pytest.raises(GraphError, match="does not parse"):
        Graph.from_json("{not json")
    with pytest.raises(GraphError, match="malformed"):
        Graph.from_json('{"stages": []}')
    with pytest.raises(GraphError, match="must be an object"):
        Graph.from_json("[1, 2]")
    data = json.loads(_toy().to_json())
    data["stages"][0]["microbatches"] = 0
    with pytest.raises(GraphError, match="'gen'"):
        Graph.from_dict(data)


@pytest.mark.parametrize("graph", list(_variety()), ids=lambda g: g.name)
def test_dot_and_text_show_every_stage_and_edge(graph):
    dot = graph.to_dot()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    text = graph.to_text()
    for stage in graph.stages:
        assert f'"{stage.name}" [label=' in dot
        assert f"  {stage.name}: {stage.kind.value}/{stage.role.value}" in text
    for edge in graph.edges:
        assert f'"{edge.src}" -> "{edge.dst}"' in dot
        style = "style=dashed" if edge.version_offset else ""
        line = next(line for line in dot.splitlines()
                    if line.strip().startswith(f'"{edge.src}" -> "{edge.dst}"') and f'"{edge.payload}' in line)
        assert style in line
    for placement in graph.placements:
        assert f'label="{placement}"' in dot
    for group in graph.fused_groups():
        assert f"fused: {group}" in dot
