"""The standard GRPO/PPO graphs: the DESIGN.md picture, validated, with options changing only what they should."""

import pytest

from rpegjax.graph import (
    ALL_PLACEMENT,
    Algorithm,
    GraphError,
    Role,
    StageKind,
    grpo_graph,
    ppo_graph,
)


def _reads(graph, stage):
    """payload -> (producer, offset) for a stage's incoming edges."""
    return {e.payload: (e.src, e.version_offset) for e in graph.in_edges(stage)}


@pytest.mark.parametrize("use_reference", [False, True])
@pytest.mark.parametrize("async_bound", [0, 1, 3])
def test_grpo_graph_shape(use_reference, async_bound):
    graph = grpo_graph(use_reference=use_reference, async_bound=async_bound, num_devices=4)
    expected = ["generate", "reward", *(["ref_logprob"] if use_reference else []), "old_logprob", "advantage",
                "actor_update", "weight_sync"]
    assert list(graph.topological_order()) == expected
    assert graph.algorithm is Algorithm.GRPO and graph.async_bound == async_bound
    assert {s.kind for s in graph.stages}.isdisjoint({StageKind.CRITIC_VALUE, StageKind.CRITIC_UPDATE})
    assert _reads(graph, "generate") == {"params:actor:generate": ("weight_sync", async_bound + 1)}
    assert _reads(graph, "old_logprob")["params:actor"] == ("actor_update", 1)
    assert _reads(graph, "actor_update")["params:actor"] == ("actor_update", 1)
    assert _reads(graph, "weight_sync") == {"params:actor": ("actor_update", 0)}
    assert _reads(graph, "advantage") == {"rewards": ("reward", 0)}
    assert ("ref_logprobs" in _reads(graph, "actor_update")) == use_reference  # KL in the loss
    assert _reads(graph, "actor_update")["behaviour_logprobs"] == ("generate", 0)
    assert graph.stage("reward").host and graph.stage("reward").role is Role.NONE
    assert set(graph.external) == {"prompts", *(["params:reference"] if use_reference else [])}
    assert all(s.placement == ALL_PLACEMENT for s in graph.stages if not s.host)
    assert dict(graph.placements[ALL_PLACEMENT].parallel) == {"data": 4}
    graph.validate()


def test_grpo_options():
    in_reward = grpo_graph(use_reference=True, kl_in_reward=True)
    assert "ref_logprobs" not in _reads(in_reward, "actor_update")
    assert _reads(in_reward, "advantage")["ref_logprobs"] == ("ref_logprob", 0)
    no_recompute = grpo_graph(use_reference=False, recompute_old_logprobs=False, epochs=2, minibatches=4)
    assert not no_recompute.has_stage("old_logprob")
    assert "old_logprobs" not in _reads(no_recompute, "actor_update")
    assert dict(no_recompute.stage("actor_update").options) == {"epochs": 2, "minibatches": 4}
    custom = grpo_graph(use_reference=False, num_devices=8, parallel={"data": 2, "fsdp": 2, "tensor": 2})
    assert custom.placements["all"].size == 8


def test_ppo_separate_critic():
    graph = ppo_graph(use_reference=True, async_bound=1)
    assert graph.algorithm is Algorithm.PPO
    assert graph.stage("critic_value").role is Role.CRITIC and graph.stage("critic_update").role is Role.CRITIC
    assert _reads(graph, "critic_value")["params:critic"] == ("critic_update", 1)
    assert _reads(graph, "critic_update")["returns"] == ("advantage", 0)
    advantage = _reads(graph, "advantage")
    assert advantage["values"] == ("critic_value", 0) and advantage["ref_logprobs"] == ("ref_logprob", 0)
    assert "ref_logprobs" not in _reads(graph, "actor_update")  # PPO folds the KL into the reward by default
    assert graph.topological_order()[-1] == "weight_sync" and not graph.shares_actor_critic


def test_ppo_shared_critic():
    graph = ppo_graph(use_reference=False, critic="shared")
    assert [s.name for s in graph.stages_of_kind(StageKind.CRITIC_UPDATE)] == ["actor_update"]
    assert [s.name for s in graph.stages_of_kind(StageKind.CRITIC_VALUE)] == ["old_logprob"]
    assert {s.name for s in graph.stages} == {"generate", "reward", "old_logprob", "advantage", "actor_update", "weight_sync"}
    assert graph.stage("old_logprob").merged_kinds == (StageKind.CRITIC_VALUE,)
    assert graph.stage("actor_update").merged_kinds == (StageKind.CRITIC_UPDATE,)
    assert graph.shares_actor_critic
    assert all(not e.payload.startswith("params:critic") for e in graph.edges)


def test_builder_refusals():
    with pytest.raises(GraphError, match="critic must be one of"):
        ppo_graph(use_reference=False, critic="bogus")
    with pytest.raises(GraphError, match="recompute_old_logprobs"):
        ppo_graph(use_reference=False, critic="shared", recompute_old_logprobs=False)
    with pytest.raises(GraphError, match="epochs"):
        grpo_graph(use_reference=False, epochs=0)
    with pytest.raises(GraphError, match="num_devices"):
        ppo_graph(use_reference=False, num_devices=0)
    with pytest.raises(GraphError, match="'all' needs 2 devices"):
        grpo_graph(use_reference=False, num_devices=1, parallel={"data": 2})
    with pytest.raises(GraphError, match="k must be"):
        grpo_graph(use_reference=False, async_bound=-1)
