"""The job's graph from its config (`rpegjax.train.build.build_graph`): which stages it has, and what it refuses.
The runtime's execution of such graphs is tested on the runtime's own setup (tests/runtime)."""

import dataclasses

import pytest

from rpegjax.train.build import build, build_graph
from rpegjax.train.config import (
    DataSection,
    GraphSection,
    ModelSection,
    RolloutSection,
    RunConfig,
    TrainSection,
    WarmStartSection,
)


def tiny_config(**graph) -> RunConfig:
    return RunConfig(
        model=ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64),
        data=DataSection(train_size=64, eval_size=4),
        rollout=RolloutSection(prompts_per_step=4, group_size=2, max_prompt_len=12, max_new_tokens=6, num_slots=8,
                               chunk_steps=3),
        warm_start=WarmStartSection(steps=0),
        graph=GraphSection(**{"async_bound": 0, **graph}),
        train=TrainSection(steps=4, reward_workers=1),
    ).replace(grpo=dataclasses.replace(RunConfig().grpo, kl_coef=0.04))


def test_an_impossible_mesh_is_refused_clearly():
    with pytest.raises(ValueError, match="3 devices but 8 are available"):
        build(tiny_config(mesh="data=3"), log=lambda _: None)


def test_single_step_graphs_without_decoupled_correction_skip_the_old_logprob_pass():
    on_policy = tiny_config(async_bound=0)
    on_policy = on_policy.replace(grpo=dataclasses.replace(on_policy.grpo, decoupled=False, importance_cap=None))
    assert not build_graph(on_policy, num_devices=1).has_stage("old_logprob")
    # bounded staleness needs the proximal policy for the decoupled correction; without it one step's ratio is 1
    assert build_graph(tiny_config(async_bound=1), num_devices=1).has_stage("old_logprob")
    stale = on_policy.replace(graph=dataclasses.replace(on_policy.graph, async_bound=1))
    assert not build_graph(stale, num_devices=1).has_stage("old_logprob")
    two_steps = on_policy.replace(grpo=dataclasses.replace(on_policy.grpo, num_minibatches=2))
    assert build_graph(two_steps, num_devices=1).has_stage("old_logprob")


def test_optimizer_flags_reach_the_graph_the_learner_and_the_programs(tmp_path):
    import jax

    from rpegjax.train.trainer import make_programs

    config = tiny_config(mesh="data=8", optimizer_sharding="data", optimizer_offload=True)
    graph = build_graph(config, num_devices=8)
    assert (graph.execution.optimizer_sharding, graph.execution.optimizer_offload) == ("data", True)
    parts = build(config, log=lambda _: None)
    specs = [sharding.spec for sharding in jax.tree.leaves(parts.learner.state_shardings.opt_state) if sharding.spec]
    assert specs and all("data" in str(spec) for spec in specs)  # the moments of every matrix over the 8 replicas
    assert make_programs(parts, None).training.offload is not None
    plan = tmp_path / "plan.json"
    plan.write_text(build_graph(tiny_config(mesh="data=8"), num_devices=8).to_json())
    asked = tiny_config(mesh="data=8", plan=str(plan), optimizer_offload=True)
    with pytest.raises(ValueError, match="the plan's optimiser state is {'optimizer_offload': False}, this run asks "
                                         "for {'optimizer_offload': True}"):
        build_graph(asked, num_devices=8)
    with pytest.raises(ValueError, match="GraphSection.optimizer_sharding must be one of \\['params', 'data'\\]"):
        GraphSection(optimizer_sharding="zero3")
