"""Graph transforms: each one's effect, each refusal (GraphError naming the stage), and purity."""

import dataclasses

import pytest

from rpegjax.graph import (
    Edge,
    Graph,
    GraphError,
    Role,
    Stage,
    StageKind,
    bounded_async,
    default_fusion,
    fuse,
    grpo_graph,
    microbatch,
    place,
    ppo_graph,
    share_actor_critic,
)


def _reads(graph, stage):
    return {e.payload: (e.src, e.version_offset) for e in graph.in_edges(stage)}


def _refused(stage, *words):
    """Context manager: a GraphError naming `stage` (None: no particular stage) and containing `words`."""
    class _Check:
        def __enter__(self):
            self.raises = pytest.raises(GraphError)
            self.info = self.raises.__enter__()

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            message = str(self.info.value)
            assert self.info.value.stage == stage, message
            if stage is not None:
                assert repr(stage) in message, message
            for word in words:
                assert word in message, message
            return handled
    return _Check()


@pytest.fixture
def ppo():
    return ppo_graph(use_reference=True, num_devices=8)


def _snapshot(graph):
    return Graph.from_json(graph.to_json())


# ----------------------------------------------------------------------------------------- bounded_async
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_bounded_async_sets_generate_weight_offset(k):
    sync = grpo_graph(use_reference=True)
    before = _snapshot(sync)
    graph = bounded_async(sync, k)
    assert sync == before  # pure
    assert graph.async_bound == k
    assert _reads(graph, "generate")["params:actor:generate"] == ("weight_sync", k + 1)
    for edge in graph.edges:  # nothing else moved
        if edge.dst != "generate":
            assert edge in sync.edges
    assert bounded_async(graph, 0) == sync


def test_bounded_async_offset_beyond_bound_fails_validation():
    graph = bounded_async(grpo_graph(use_reference=False), 1)
    edges = tuple(dataclasses.replace(e, version_offset=3) if e.dst == "generate" else e for e in graph.edges)
    with _refused("generate", "async_bound=1", "at most 2"):
        dataclasses.replace(graph, edges=edges).validate()


def test_bounded_async_refusals():
    graph = grpo_graph(use_reference=False)
    with _refused(None, "k must be"):
        bounded_async(graph, -1)
    with _refused(None, "k must be"):
        bounded_async(graph, 1.5)
    no_generate = Graph(stages=(Stage(name="r", kind="reward", role="none", placement="host", host=True),), edges=(),
                        placements={})
    with _refused(None, "no generate stage"):
        bounded_async(no_generate, 1)
    # lowering the bound below an existing cross-step data edge is refused, naming the reader
    edges = tuple(dataclasses.replace(e, version_offset=2) if (e.src, e.dst) == ("reward", "advantage") else e
                  for e in graph.edges)
    stale = dataclasses.replace(bounded_async(graph, 2), edges=edges).validate()
    with _refused("advantage", "data edges may reach at most 1"):
        bounded_async(stale, 1)


def test_bounded_async_needs_generate_to_read_parameters():
    graph = grpo_graph(use_reference=False)
    edges = tuple(e for e in graph.edges if e.dst != "generate")
    stages = tuple(dataclasses.replace(s, inputs=("prompts",)) if s.name == "generate" else s for s in graph.stages)
    with _refused("generate", "reads no parameters"):
        bounded_async(dataclasses.replace(graph, stages=stages, edges=edges), 1)


# ---------------------------------------------------------------------------------- share_actor_critic
def test_share_actor_critic_merges_value_and_update(ppo):
    before = _snapshot(ppo)
    shared = share_actor_critic(ppo)
    assert ppo == before
    assert not shared.has_stage("critic_value") and not shared.has_stage("critic_update")
    old, update = shared.stage("old_logprob"), shared.stage("actor_update")
    assert old.role is Role.ACTOR and old.merged_kinds == (StageKind.CRITIC_VALUE,)
    assert set(old.outputs) == {"old_logprobs", "values"}
    assert update.role is Role.ACTOR and update.merged_kinds == (StageKind.CRITIC_UPDATE,)
    assert _reads(shared, "actor_update")["returns"] == ("advantage", 0)
    assert _reads(shared, "actor_update")["values"] == ("old_logprob", 0)
    assert _reads(shared, "advantage")["values"] == ("old_logprob", 0)
    assert not any("params:critic" in (e.payload, *shared.stage(e.dst).inputs) for e in shared.edges)
    assert shared.shares_actor_critic and not ppo.shares_actor_critic
    assert dict(update.options) == {"epochs": 1, "minibatches": 1, "critic_epochs": 1, "critic_minibatches": 1}
    assert len(shared.execution_units()) == len(ppo.execution_units()) - 2


def test_share_actor_critic_keeps_fusion_and_rewires_other_critic_readers(ppo):
    probe = Stage(name="value_probe", kind=StageKind.ADVANTAGE, role=Role.CRITIC, placement="all",
                  inputs=("responses", "params:critic"), outputs=("probe",))
    graph = dataclasses.replace(
        ppo, stages=ppo.stages + (probe,),
        edges=ppo.edges + (Edge(src="generate", dst="value_probe", payload="responses"),
                           Edge(src="critic_update", dst="value_probe", payload="params:critic", version_offset=1)))
    shared = share_actor_critic(default_fusion(graph.validate()))
    assert _reads(shared, "value_probe")["params:actor"] == ("actor_update", 1)
    assert "params:critic" not in shared.stage("value_probe").inputs
    assert shared.fused_groups() == {"ref_logprob+old_logprob+critic_value": ("ref_logprob", "old_logprob")}
    # a group left with one member dissolves
    pair = share_actor_critic(fuse(ppo, ["old_logprob", "critic_value"]))
    assert pair.fused_groups() == {} and pair.stage("old_logprob").fused_group is None


def test_share_actor_critic_refusals(ppo):
    with _refused(None, "critic_value", "none"):
        share_actor_critic(grpo_graph(use_reference=True))
    with _refused(None, "already shares"):
        share_actor_critic(share_actor_critic(ppo))
    with _refused(None, "old_logprob", "'critic_value'"):
        share_actor_critic(ppo_graph(use_reference=False, recompute_old_logprobs=False))
    # the two halves read the same payload from different producers: merging would be ambiguous
    stages = tuple(dataclasses.replace(s, outputs=("rewards", "responses")) if s.name == "reward" else s for s in ppo.stages)
    edges = tuple(dataclasses.replace(e, src="reward") if (e.dst, e.payload) == ("critic_value", "responses") else e
                  for e in ppo.edges)
    conflicting = dataclasses.replace(ppo, stages=stages, edges=edges).validate()
    with _refused("critic_value", "'responses'"):
        share_actor_critic(conflicting)


# ------------------------------------------------------------------------------------------------ fuse
def test_fuse_groups_stages_and_cuts_dispatches(ppo):
    fused = fuse(ppo, ["critic_value", "ref_logprob", "old_logprob"])
    group = "ref_logprob+old_logprob+critic_value"
    assert fused.fused_groups() == {group: ("ref_logprob", "old_logprob", "critic_value")}
    assert len(fused.execution_units()) == len(ppo.execution_units()) - 2
    assert (("ref_logprob", "old_logprob", "critic_value")) in fused.execution_units()
    assert fuse(ppo, ["ref_logprob", "old_logprob"], group="inference").stage("old_logprob").fused_group == "inference"
    assert ppo.fused_groups() == {}


def test_fuse_refusals(ppo):
    with _refused("ref_logprob", "at least two"):
        fuse(ppo, ["ref_logprob", "ref_logprob"])
    with _refused("nope"):
        fuse(ppo, ["ref_logprob", "nope"])
    with _refused("reward", "host"):
        fuse(ppo, ["reward", "ref_logprob"])
    apart = place(ppo, "ref_logprob", "ref", {"data": 2})
    with _refused("old_logprob", "placement 'ref'"):
        fuse(apart, ["old_logprob", "ref_logprob"])
    with _refused("critic_value", "micro-batches"):
        fuse(microbatch(ppo, "critic_value", 2), ["old_logprob", "critic_value"])
    with _refused("advantage", "depends on 'critic_value'"):
        fuse(ppo, ["critic_value", "advantage"])
    with _refused("weight_sync", "no common batch"):
        fuse(ppo, ["old_logprob", "weight_sync"])
    once = fuse(ppo, ["ref_logprob", "old_logprob"])
    with _refused("old_logprob", "already in fused group"):
        fuse(once, ["old_logprob", "critic_value"])
    with _refused(None, "already used"):
        fuse(once, ["critic_value", "critic_update"], group="ref_logprob+old_logprob")


def test_default_fusion(ppo):
    assert default_fusion(ppo).fused_groups() == {"ref_logprob+old_logprob+critic_value": ("ref_logprob", "old_logprob", "critic_value")}
    grpo = grpo_graph(use_reference=True)
    assert default_fusion(grpo).fused_groups() == {"ref_logprob+old_logprob": ("ref_logprob", "old_logprob")}
    alone = grpo_graph(use_reference=False)
    assert default_fusion(alone) == alone  # a single inference stage has nothing to fuse with
    split = place(ppo, "ref_logprob", "ref", {"data": 4})
    assert default_fusion(split).fused_groups() == {"old_logprob+critic_value": ("old_logprob", "critic_value")}
    mixed = microbatch(ppo, "old_logprob", 4)
    assert default_fusion(mixed).fused_groups() == {"ref_logprob+critic_value": ("ref_logprob", "critic_value")}
    shared = share_actor_critic(ppo)
    assert default_fusion(shared).fused_groups() == {"ref_logprob+old_logprob": ("ref_logprob", "old_logprob")}
    assert default_fusion(default_fusion(ppo)) == default_fusion(ppo)


# ------------------------------------------------------------------------------------------ microbatch
def test_microbatch(ppo):
    graph = microbatch(ppo, "generate", 8)
    assert graph.stage("generate").microbatches == 8 and ppo.stage("generate").microbatches == 1
    assert microbatch(graph, "generate", 1) == ppo
    fused = default_fusion(ppo)
    split = microbatch(fused, "old_logprob", 4)
    assert {split.stage(n).microbatches for n in ("ref_logprob", "old_logprob", "critic_value")} == {4}
    assert microbatch(ppo, "reward", 3).stage("reward").microbatches == 3


def test_microbatch_refusals(ppo):
    with _refused("generate", ">= 1"):
        microbatch(ppo, "generate", 0)
    with _refused("generate", ">= 1"):
        microbatch(ppo, "generate", 2.0)
    with _refused("weight_sync", "weight sync"):
        microbatch(ppo, "weight_sync", 2)
    with _refused("ghost"):
        microbatch(ppo, "ghost", 2)


# ----------------------------------------------------------------------------------------------- place
def test_place_disaggregates_generation(ppo):
    graph = place(ppo, "generate", "rollout", {"data": 2, "tensor": 2}, devices=(4, 5, 6, 7))
    graph = place(graph, "weight_sync", "rollout")
    assert graph.stage("generate").placement == "rollout" and graph.stage("generate").parallel is None
    assert graph.placements["rollout"].devices == (4, 5, 6, 7)
    assert dict(graph.parallel_of("weight_sync")) == {"data": 2, "tensor": 2}
    assert "rollout" not in ppo.placements
    # an existing sub-mesh with its own layout for this stage
    relaid = place(graph, "generate", "rollout", {"tensor": 4})
    assert dict(relaid.stage("generate").parallel) == {"tensor": 4}
    assert place(relaid, "generate", "rollout", {"data": 2, "tensor": 2}).stage("generate").parallel is None


def test_place_moves_a_fused_group_together(ppo):
    fused = default_fusion(ppo)
    moved = place(fused, "old_logprob", "infer", {"data": 4})
    assert {moved.stage(n).placement for n in ("ref_logprob", "old_logprob", "critic_value")} == {"infer"}
    assert moved.fused_groups() == fused.fused_groups()


def test_place_refusals(ppo):
    with _refused("generate", "needs 16 devices"):
        place(ppo, "generate", "big", {"data": 16})
    with _refused("generate", "multiply to 4", "8 devices"):
        place(ppo, "generate", "all", {"data": 2, "tensor": 2})
    with _refused("generate", "needs parallel sizes"):
        place(ppo, "generate", "new")
    with _refused("generate", "uses device 9"):
        place(ppo, "generate", "new", {"data": 2}, devices=(8, 9))
    with _refused("generate", "multiply to 2"):
        place(ppo, "generate", "new", {"data": 2}, devices=(0, 1, 2))
    with _refused("generate", "'tensor'"):
        place(ppo, "generate", "new", {"tensor": 0})
    with _refused("reward", "host"):
        place(ppo, "reward", "all")
    with _refused("generate", "'host'"):
        place(ppo, "generate", "host", {"data": 1})
    pinned = place(ppo, "generate", "gen", {"data": 2}, devices=(0, 1))
    with _refused("weight_sync", "already has devices"):
        place(pinned, "weight_sync", "gen", devices=(2, 3))
