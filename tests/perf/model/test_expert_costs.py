"""The perf model's mixture-of-experts terms (rpegjax.perf.model.expert_costs) against hand-computed formulas and the
compiled Qwen3-30B-A3B update memory of benchmarks/bench_moe_memory.py (docs/benchmarks.md, "W-long")."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rpegjax.graph.ir import Algorithm, Execution
from rpegjax.models.config import ModelConfig
from rpegjax.options import AttentionKind, CacheLayout, RematPolicy
from rpegjax.perf import planner
from rpegjax.perf.model import (
    collectives,
    costs,
    expert_costs,
    generation_cost,
    generation_stage,
    stage_costs,
    step_model,
)
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import CostInputs, ExecutionOptions, Layout, Workload
from rpegjax.perf.planner import trust
from rpegjax.perf.reference import presets

GIB = 1 << 30
MOE = ModelConfig.qwen3_moe("30b-a3b")


def test_total_and_active_parameters_match_the_model_config():
    shape = ModelShape.from_config(MOE)
    # ModelConfig counts the q/k norms too (2 x head_dim per layer), the perf model ignores them
    norms = MOE.num_layers * 2 * MOE.head_dim
    assert shape.params == MOE.num_params() - norms
    assert shape.active_params == pytest.approx(MOE.num_params(active=True) - norms, rel=1e-12)
    assert 30.4e9 < shape.params < 30.6e9 and 3.2e9 < shape.active_params < 3.4e9


def test_flops_follow_the_active_parameters():
    shape = ModelShape.from_config(MOE)
    d, x, k, fe, layers = 2048, 128, 8, 768, 48
    attention = 2 * d * 32 * 128 + 2 * d * 4 * 128
    per_token = 2 * layers * (attention + d * x + k * 3 * d * fe)  # router and k experts of every sparse layer
    assert costs.forward_flops(shape, tokens=1000, pairs=0, logit_tokens=0) == pytest.approx(1000 * per_token, rel=1e-12)


def test_weights_split_over_the_expert_axis():
    shape = ModelShape.from_config(MOE)
    layout = Layout.from_parallel({"data": 2, "expert": 16}, where="test")
    assert layout.replicas == 32 and layout.shards == 16
    assert stage_costs.optimizer_state_bytes(shape, layout, ExecutionOptions()) == pytest.approx(shape.params * 12 / 16)
    # a layer held at once: attention, router and 128/16 local experts
    held = 2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 2048 * 128 + 3 * 2048 * 768 * 8
    assert expert_costs.layer_params_held(shape, layout) == held


def test_capacity_and_dropless_work():
    capped = ModelShape.from_config(MOE.replace(moe_capacity_factor=1.25))
    # C = ceil(1.25 * 16384 * 8 / 128) = 1280 slots per expert and row: 128 x 1280 / (16384 x 8) = 1.25
    assert expert_costs.computed_expert_ratio(capped, ExecutionOptions(), row_tokens=16384) == pytest.approx(1.25)
    dropless = ModelShape.from_config(MOE)
    assert expert_costs.computed_expert_ratio(dropless, ExecutionOptions(), row_tokens=16384) == 1.0  # grouped GEMMs
    runtime = ExecutionOptions().executing(Execution())
    assert expert_costs.computed_expert_ratio(dropless, runtime, row_tokens=16384) == 128.0  # every local expert, dense


def test_dispatch_is_an_all_to_all_per_sparse_layer_inside_and_across_nodes():
    shape = ModelShape.from_config(MOE)
    hw = presets.h100_node(32)
    tokens = 4096
    for size in (8, 16):
        layout = Layout.from_parallel({"data": 32 // size, "expert": size}, where="test")
        one = collectives.all_to_all_seconds(tokens * 8 * 2048 * 2, hw, collectives.Group(size=size, stride=1))
        assert expert_costs.dispatch_seconds(shape, layout, hw, tokens_per_device=tokens, exchanges=4) == pytest.approx(48 * 4 * one)
    inside = expert_costs.dispatch_seconds(shape, Layout.from_parallel({"data": 4, "expert": 8}, where="t"), hw,
                                      tokens_per_device=tokens, exchanges=2)
    across = expert_costs.dispatch_seconds(shape, Layout.from_parallel({"data": 2, "expert": 16}, where="t"), hw,
                                      tokens_per_device=tokens, exchanges=2)
    assert across > 2 * inside  # half of each device's rows cross the network


def test_decode_reads_only_the_experts_hit():
    """A decode step of r rows per replica reads the dense weights and the share 1 - miss^r of its local experts:
    E[hit] = (x/p)(1 - (1 - k/x)^(p r)) of them per sparse layer (tokens routed uniformly)."""
    shape = ModelShape.from_config(MOE)
    expert = 3 * 2048 * 768 * 2  # one expert's matrices, bf16
    layout = Layout.from_parallel({"data": 4, "tensor": 2}, where="test")
    dense, local, miss = expert_costs.decode_weight_terms(shape, layout)
    assert dense == pytest.approx((shape.params - expert_costs.expert_params(shape)) * 2 / 2)
    assert local == pytest.approx(48 * 128 * expert / 2)
    hit = lambda rows: local * (1 - miss**rows) / (48 * expert / 2)  # experts read per sparse layer
    assert hit(0) == 0 and hit(1) == pytest.approx(8)  # one token: its k experts
    assert hit(4) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 4))
    assert hit(10_000) == pytest.approx(128)  # bounded by the local experts
    split = Layout.from_parallel({"data": 1, "expert": 8}, where="test")  # 16 local experts, 8 replicas' tokens
    dense, local, miss = expert_costs.decode_weight_terms(shape, split)
    assert dense == pytest.approx((shape.params - expert_costs.expert_params(shape)) * 2)
    assert local == pytest.approx(48 * 16 * expert) and miss == pytest.approx((1 - 8 / 128) ** 8)
    for rows in (1, 3, 40):
        assert local * (1 - miss**rows) == pytest.approx(48 * 16 * (1 - (1 - 8 / 128) ** (8 * rows)) * expert)
    dense_model = ModelShape.from_config(ModelConfig.qwen3("32b"))
    assert expert_costs.decode_weight_terms(dense_model, layout) == (dense_model.weight_bytes / 2, 0.0, 1.0)


def test_decode_dispatch_is_charged_per_processed_row(monkeypatch):
    """A MoE decode step's dispatch and combine (2 all-to-alls per sparse layer) cost their latency every step and
    their bytes per row the step decodes (k·d values per row, (p-1)/p of them to the other expert devices), as the
    tensor all-reduces do; an idle slot sends nothing."""
    shape = ModelShape.from_config(MOE)
    hw = presets.h100_node(8)
    layout = Layout.from_parallel({"data": 2, "expert": 4}, where="test")  # expert group of 4 inside a node
    latency = 48 * 2 * 3 * 2e-6  # 3 peers over NVLink at 2 us each, per all-to-all
    per_row = 48 * 2 * (3 / 4) * (8 * 2048 * 2) / (450 * 1e9)  # 3/4 of k·d bf16 values at 450 GB/s
    step_latency, step_per_row = expert_costs.decode_dispatch_terms(shape, layout, hw)
    assert step_latency == pytest.approx(latency, rel=1e-12) and step_per_row == pytest.approx(per_row, rel=1e-12)
    for rows in (1, 7, 64):  # the all-to-all of `rows` rows per device is latency + rows x the per-row bytes' time
        assert expert_costs.dispatch_seconds(shape, layout, hw, tokens_per_device=rows, exchanges=2) == pytest.approx(
            latency + rows * per_row, rel=1e-12)
    assert expert_costs.decode_dispatch_terms(shape, Layout.from_parallel({"data": 8}, where="t"), hw) == (0.0, 0.0)
    # the generation stage's decode step carries them: no tensor axis, so its per-row collectives are the dispatch
    steps = []
    monkeypatch.setattr(generation_stage, "DecodeStepCost",
                        lambda **fields: steps.append(generation_cost.DecodeStepCost(**fields)) or steps[-1])
    workload = Workload(prompts=4, group_size=8, prompt_tokens=64, responses=ResponseLengths.lognormal(200, 512))
    inputs = CostInputs(hardware=hw, actor=shape, critic=shape, workload=workload, options=ExecutionOptions())
    generation_stage.generation_cost(inputs, layout, kv_budget_bytes=1e12)
    assert steps[-1].comm_seconds_per_row == pytest.approx(per_row, rel=1e-12)
    assert steps[-1].fixed_seconds == pytest.approx(48 * ExecutionOptions().kernels_per_layer * 5e-6 + latency, rel=1e-12)


def _bench_update_gib(parallel: dict[str, int], capacity: float | None) -> float:
    """What the model predicts for benchmarks/bench_moe_memory.py's program: GRPO update of Qwen3-30B-A3B, one
    16384-token row per device, float32 masters, bfloat16 compute, blockwise attention, full remat."""
    shape = ModelShape.from_config(MOE.replace(param_dtype="float32", dtype="bfloat16", moe_capacity_factor=capacity))
    count = math.prod(parallel.values())
    workload = Workload(prompts=1, group_size=count, prompt_tokens=1024, responses=ResponseLengths.fixed(16384 - 1024))
    execution = Execution(attention=AttentionKind.BLOCKWISE, remat=RematPolicy.FULL, param_dtype="float32",
                          dtype="bfloat16", update_microbatches=1)
    options = ExecutionOptions().executing(execution)
    layout = Layout.from_parallel(parallel, where="bench")
    inputs = CostInputs(hardware=presets.h100_node(count), actor=shape, critic=shape, workload=workload,
                        options=options)
    update = stage_costs.model_pass_cost(inputs, shape, layout, logits=True, backward=True, optimizer_steps=1)
    state = shape.params * (shape.param_bytes_each + options.optimizer_bytes_per_param) / layout.shards
    return (state + update.transient_bytes) / GIB


@pytest.mark.parametrize("parallel, compiled", [({"expert": 16}, 45.22), ({"expert": 8}, 79.21)],
                         ids=["expert16", "expert8"])
def test_capacity_update_memory_within_the_moe_margin(parallel, compiled):
    predicted = _bench_update_gib(parallel, 1.25)
    assert predicted <= compiled <= predicted * (1 + trust.MOE_CHECKED.margins[trust.TRAINING]) + 1e-9


def test_moe_margin_is_the_largest_measured_under_prediction():
    errors = [compiled / _bench_update_gib(p, 1.25) - 1 for p, compiled in (({"expert": 16}, 45.22), ({"expert": 8}, 79.21))]
    assert trust.MOE_CHECKED.margins[trust.TRAINING] == pytest.approx(max(errors), abs=1e-3)


def _sampler_plan_gb(dtype: str) -> float:
    """The planner's generate-stage peak for the plan whose sampler benchmarks/bench_moe_sampler_margin.py compiles
    for H100: Qwen3-30B-A3B capacity 1.25 on 32 H100s, colocated, d8xt4 with
    256 slots per replica and a paged pool of 1,020,928 tokens, training f16xe2; published workload."""
    execution = Execution(attention=AttentionKind.CUDNN, remat=RematPolicy.FULL, moe_capacity_factor=1.25,
                          kv_cache=CacheLayout.PAGED, kv_pool_tokens=1_020_928, update_microbatches=2, dtype=dtype)
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=True, num_devices=32, optimizer_steps=4,
                                generation_layout=(("data", 8), ("fsdp", 1), ("tensor", 4)),
                                train_layout=(("data", 1), ("fsdp", 16), ("expert", 2)), execution=execution)
    workload = Workload(prompts=64, group_size=32, prompt_tokens=128, responses=ResponseLengths.lognormal(3203, 3968))
    evaluator = step_model.Evaluator.for_runtime(MOE.replace(moe_capacity_factor=1.25), workload, presets.h100_node(32))
    prediction = evaluator.predict(planner.build_graph(choice), with_trace=False, enforce_memory=False)
    generate = next(stage for stage in prediction.stages if stage.kind == "generate")
    assert generate.detail["slots"] == 256
    return generate.peak_memory_bytes / 1e9


# compiled GB per device of that plan's sampler programs (prefill, decode chunk), by compute dtype
_SAMPLER_COMPILED = {"bfloat16": (57.69, 55.95), "float32": (100.10, 96.57)}


def test_moe_generation_margin_is_the_largest_measured_under_prediction():
    errors = []
    for dtype, compiled in _SAMPLER_COMPILED.items():
        predicted = _sampler_plan_gb(dtype)
        assert all(gb <= predicted * (1 + trust.MOE_CHECKED.margins[trust.GENERATION]) + 1e-9 for gb in compiled)
        errors += [gb / predicted - 1 for gb in compiled]
    assert trust.MOE_CHECKED.margins[trust.GENERATION] == pytest.approx(max(errors), abs=1e-3)


def test_dropless_update_is_over_predicted_and_untrusted():
    assert _bench_update_gib({"expert": 8}, None) > 276.07  # compiled; never planned to fit
    graph = planner.build_graph(planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=False, num_devices=8,
                                                   train_layout=(("data", 1), ("expert", 8)),
                                                   generation_layout=(("data", 4), ("tensor", 2)),
                                                   execution=Execution(attention=AttentionKind.BLOCKWISE,
                                                                       remat=RematPolicy.FULL)))
    problem = trust.regime_problem(graph, ModelShape.from_config(MOE), 4096, trust.regime_for(ModelShape.from_config(MOE)))
    assert problem is not None and "dropless" in problem
    capped = ModelShape.from_config(MOE.replace(moe_capacity_factor=1.25))
    assert trust.regime_problem(graph, capped, 4096, trust.regime_for(capped)) is None
    assert "dense models only" in trust.regime_problem(graph, capped, 4096, trust.GPU_CHECKED)


def test_planner_searches_the_expert_axis_for_moe_models_only():
    moe, dense = ModelShape.from_config(MOE), ModelShape.from_config(ModelConfig.qwen3("32b"))
    assert planner.expert_axis_sizes(moe, 32) == (1, 2, 4, 8, 16, 32)
    assert planner.expert_axis_sizes(moe, 24) == (1, 2, 4, 8)
    assert planner.expert_axis_sizes(dense, 32) == (1,)
    found = planner.layouts(16, (1, 2), heads=32, kv_heads=4, node_size=8, with_fsdp=True, expert_sizes=(1, 8))
    assert (("data", 1), ("fsdp", 2), ("expert", 8), ("tensor", 1)) in found
    assert (("data", 1), ("fsdp", 1), ("expert", 8), ("tensor", 2)) in found
    assert all(math.prod(size for _, size in layout) == 16 for layout in found)


def test_generation_takes_an_expert_axis():
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=False, num_devices=8,
                                train_layout=(("data", 1), ("expert", 8)),
                                generation_layout=(("data", 1), ("expert", 8)))
    assert planner.build_graph(choice).parallel_of("generate").get("expert") == 8


def test_moe_stages_without_an_expert_axis_are_untrusted():
    """The capacity mode without an expert axis runs under GSPMD, which built the whole batch's capacity buffers on
    every device (the f32 log-prob pass of a 32-H100 plan: 140.67 GB compiled per device)."""
    capped = ModelShape.from_config(MOE.replace(moe_capacity_factor=1.25))
    execution = Execution(attention=AttentionKind.BLOCKWISE, remat=RematPolicy.FULL)
    graph = planner.build_graph(planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=False, num_devices=8,
                                                   train_layout=(("data", 1), ("fsdp", 8)),
                                                   generation_layout=(("data", 4), ("tensor", 2)), execution=execution))
    assert "without an expert axis" in trust.regime_problem(graph, capped, 4096, trust.MOE_CHECKED)


def _small_space(capacities: tuple[float | None, ...]) -> planner.PlanSpace:
    return planner.PlanSpace(async_bounds=(0,), critic_modes=("separate",), fusion=(False,), microbatches=(1,),
                             generation_fractions=(None,), tensor_sizes=(1, 2), reshard_inference=(False,),
                             attention=(AttentionKind.CUDNN,), remat=(RematPolicy.FULL,), optimizer_offload=(False,),
                             packing=(False,), moe_capacity_factors=capacities)


def test_the_capacity_factor_is_a_plan_choice_of_moe_models_only():
    """`Execution.moe_capacity_factor` decides the experts' mode the perf model costs (whatever the model config
    says), the planner searches the space's factors for a MoE model and only dropless for a dense one, and picks
    a trusted capacity plan where dropless is untrusted."""
    space = _small_space((None, 1.25))
    assert {e.moe_capacity_factor for e in space.executions(experts=True)} == {None, 1.25}
    assert {e.moe_capacity_factor for e in space.executions(experts=False)} == {None}
    workload = Workload(prompts=16, group_size=8, prompt_tokens=128, responses=ResponseLengths.lognormal(1000, 2048))
    evaluator = step_model.Evaluator.for_runtime(MOE, workload, presets.preset("h100", 16))
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=False, num_devices=16,
                                train_layout=(("data", 1), ("fsdp", 8), ("expert", 2)),
                                generation_layout=(("data", 8), ("tensor", 2)),
                                execution=Execution(attention=AttentionKind.CUDNN, remat=RematPolicy.FULL,
                                                    param_dtype="float32", dtype="bfloat16"))
    graphs = {c: planner.build_graph(dataclasses.replace(choice, execution=dataclasses.replace(
        choice.execution, moe_capacity_factor=c))) for c in (None, 1.25)}
    assert evaluator.inputs_for(graphs[1.25]).actor.experts.capacity_factor == 1.25
    assert evaluator.inputs_for(graphs[None]).actor.experts.capacity_factor is None
    update = {c: evaluator.stage_cost(graph, "actor_update") for c, graph in graphs.items()}
    assert update[1.25].transient_bytes < update[None].transient_bytes  # dropless: every local expert, dense
    best = planner.Planner(evaluator, algorithm="grpo", num_devices=16, use_reference=False, space=space).search(top=1)
    assert best.best.graph.execution.moe_capacity_factor == 1.25
    with pytest.raises(ValueError, match="no plan of .* trusts"):  # dropless only: every plan untrusted
        planner.Planner(evaluator, algorithm="grpo", num_devices=16, use_reference=False,
                        space=_small_space((None,))).search(top=1)
    dense = step_model.Evaluator.for_runtime(ModelConfig.qwen3("32b"), workload, presets.preset("h100", 16))
    assert {e.moe_capacity_factor for e in planner.Planner(dense, algorithm="grpo", num_devices=16,
                                                           space=space).executions} == {None}
    with pytest.raises(ValueError, match="moe_capacity_factor=1.25 needs a mixture-of-experts model"):
        dense.inputs_for(graphs[1.25])


def test_the_verl_like_baseline_runs_dropless_whatever_factors_are_searched():
    """verl trains MoE with Megatron's dropless dispatch: the verl-like plan takes no factor from the space, even
    one that lists a capacity factor first or only (scripts/plan.py --moe-capacity-factor 1.25 dropless)."""
    workload = Workload(prompts=16, group_size=8, prompt_tokens=128, responses=ResponseLengths.lognormal(1000, 2048))
    evaluator = step_model.Evaluator.for_runtime(MOE, workload, presets.preset("h100", 16))
    for capacities in ((1.25, None), (1.25,)):
        space = _small_space(capacities)
        assert space.executions(experts=True)[0].moe_capacity_factor == 1.25  # what it used to take
        verl = planner.verl_like(evaluator, algorithm="grpo", num_devices=16, use_reference=False, space=space)
        assert verl.graph.execution.moe_capacity_factor is None
        assert evaluator.inputs_for(verl.graph).actor.experts.capacity_factor is None
