"""Sequence and context parallelism as plan options: the execution field and job flag, the perf model's memory and
communication for them, the planner's search and the runtime's refusal of a context-split sampler."""

import dataclasses

import pytest

from rpegjax.graph import builders, transforms
from rpegjax.graph.ir import Execution, GraphError, StageKind
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import step_model
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import CostInputs, ExecutionOptions, Layout, Workload, model_pass_cost
from rpegjax.perf.planner import executable
from rpegjax.perf.reference import presets
from rpegjax.train.config import GraphSection

SEVEN_B = ModelShape.from_config(ModelConfig.qwen2p5("7b"))


def _update(parallel, *, sequence_parallel=False, tokens=16384, rows=8):
    layout = Layout.from_parallel(parallel, where="test", sequence_parallel=sequence_parallel)
    workload = Workload(prompts=rows, group_size=1, prompt_tokens=1024, responses=ResponseLengths.fixed(tokens - 1024))
    inputs = CostInputs(hardware=presets.h100_node(8), actor=SEVEN_B, critic=SEVEN_B, workload=workload,
                        options=ExecutionOptions(microbatch_tokens=tokens))
    return model_pass_cost(inputs, SEVEN_B, layout, logits=True, backward=True, optimizer_steps=1)


def test_execution_carries_sequence_parallelism_and_refuses_non_booleans():
    execution = Execution(sequence_parallel=True)
    assert Execution.from_dict(execution.to_dict()) == execution and "sequence parallel" in execution.describe()
    with pytest.raises(GraphError, match="Execution.sequence_parallel must be true or false"):
        Execution(sequence_parallel="yes")


def test_the_job_flag_and_mesh_axes():
    assert GraphSection(mesh="fsdp=2,context=4", sequence_parallel=True).mesh_axes == {"fsdp": 2, "context": 4}
    with pytest.raises(ValueError, match="sampler does not split rows over a 'context' axis"):
        GraphSection(rollout_mesh="context=2,data=-1")


def test_sequence_parallelism_cuts_the_kept_residuals_over_tensor():
    plain, split = _update({"fsdp": 4, "tensor": 2}), _update({"fsdp": 4, "tensor": 2}, sequence_parallel=True)
    kept = 16384 * SEVEN_B.layers * SEVEN_B.hidden * SEVEN_B.compute_bytes_each  # full remat: each layer's input
    assert plain.transient_bytes - split.transient_bytes == pytest.approx(kept / 2)
    assert split.seconds == pytest.approx(plain.seconds)  # reduce-scatter + all-gather move what an all-reduce does


def test_context_parallelism_splits_a_rows_activations_and_weights_and_pays_a_key_value_exchange():
    alone = _update({"fsdp": 8}, tokens=65536, rows=8)
    context = _update({"context": 8}, tokens=65536, rows=1)  # one row over 8 devices: 8k tokens each
    one_row = _update({"fsdp": 8}, tokens=8192, rows=8)  # 8k tokens per device without context parallelism
    assert context.transient_bytes < alone.transient_bytes / 2  # weights and gradients stay; activations split
    # the same per-device tokens, plus the gathered keys and values of one layer (a whole 64k row)
    gathered = 2 * 65536 * SEVEN_B.kv_heads * SEVEN_B.head_dim * SEVEN_B.compute_bytes_each
    assert context.transient_bytes == pytest.approx(one_row.transient_bytes + gathered, rel=0.02)
    assert context.detail["tensor_comm"] > 0 == one_row.detail["tensor_comm"]
    assert Layout.from_parallel({"fsdp": 2, "context": 4}, where="t").shards == 8


def test_the_planner_searches_context_and_sequence_parallel_layouts():
    candidates = planner.layouts(8, (1, 2), heads=28, kv_heads=4, node_size=8, with_fsdp=True, context_sizes=(1, 4))
    assert (("data", 1), ("fsdp", 1), ("context", 4), ("tensor", 2)) in candidates
    assert (("data", 1), ("fsdp", 2), ("context", 4), ("tensor", 1)) in candidates
    space = planner.PlanSpace(sequence_parallel=(False, True), attention=("blockwise",), remat=("full",),
                              optimizer_offload=(False,), packing=(False,))
    assert [e.sequence_parallel for e in space.executions()] == [False, True]


def test_a_context_split_sampler_is_refused_and_a_context_split_update_is_not():
    graph = builders.grpo_graph(use_reference=False, num_devices=8)
    hw = presets.h100_node(8)
    trained = transforms.place(graph, "actor_update", "all", {"fsdp": 2, "context": 4})
    assert not [p for p in executable.plan_problems(trained, hw) if "context" in p]
    generating = transforms.place(graph, "generate", "all", {"data": 2, "context": 4})
    assert any("sampler does not" in p for p in executable.plan_problems(generating, hw))
    sequence = dataclasses.replace(trained, execution=Execution(sequence_parallel=True))
    stage = sequence.stages_of_kind(StageKind.ACTOR_UPDATE)[0]
    assert step_model.stage_layout(sequence, stage).sequence_parallel
