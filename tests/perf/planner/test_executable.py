"""Execution options: one record in the graph that the runtime applies, the cost model reads and the planner
searches within what the runtime supports."""

import dataclasses
import json

import pytest
from flax import nnx

from rpegjax.graph import builders
from rpegjax.graph.ir import Execution, Graph, GraphError
from rpegjax.learners import GRPOConfig
from rpegjax.models import ModelConfig
from rpegjax.models.transformer import Decoder
from rpegjax.options import CacheLayout
from rpegjax.perf import planner
from rpegjax.perf.model import stage_costs, step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.planner import executable
from rpegjax.perf.reference import presets
from rpegjax.runtime.assembly import RolloutShape, place_models

WORKLOAD = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
SMALL_SPACE = planner.PlanSpace(async_bounds=(0,), fusion=(False,), microbatches=(1,), tensor_sizes=(1, 2),
                                generation_fractions=(None,), reshard_inference=(False,))
PLANNED = Execution(attention="blockwise", attention_block_size=64, remat="dots", scan_layers=True, kv_cache="paged",
                    page_size=8, param_dtype="float32", dtype="float32", update_microbatches=2)


def test_execution_round_trips_through_json_and_is_part_of_the_graph():
    graph = dataclasses.replace(builders.grpo_graph(use_reference=True), execution=PLANNED)
    again = Graph.from_json(graph.to_json())
    assert again == graph and again.execution == PLANNED and hash(again) == hash(graph)
    assert again != builders.grpo_graph(use_reference=True)  # the options distinguish plans
    # a graph written before execution options existed runs with the defaults
    data = graph.to_dict()
    del data["execution"]
    assert Graph.from_dict(data).execution == Execution()


def test_bad_execution_options_are_refused_by_name():
    data = builders.grpo_graph(use_reference=True).to_dict()
    data["execution"] = {**Execution().to_dict(), "attention": "flash"}
    with pytest.raises(GraphError, match="Execution.attention .* got 'flash'"):
        Graph.from_dict(data)
    data["execution"] = {"bin_packing": True}
    with pytest.raises(GraphError, match=r"unknown execution options \['bin_packing'\]"):
        Graph.from_dict(data)
    with pytest.raises(GraphError, match="update_microbatches"):
        Execution(update_microbatches=0)


def test_the_plan_options_reach_the_built_model_sampler_and_learner():
    """What a plan file says is what runs: model config, sampler cache, learner micro-batches."""
    graph = Graph.from_json(dataclasses.replace(builders.grpo_graph(use_reference=True), execution=PLANNED).to_json())
    model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))  # dense, no remat, unrolled
    learner, sampler = place_models(graph, model, GRPOConfig(group_size=2),
                                    RolloutShape(num_slots=4, max_prompt_len=8, max_new_tokens=8, chunk_steps=4))
    for cfg in (learner.placement.merge(learner.params).cfg, sampler.cfg):
        assert (cfg.attention, cfg.attention_block_size, cfg.remat, cfg.scan_layers) == ("blockwise", 64, "dots", True)
    assert sampler.cache.layout == CacheLayout.PAGED and sampler.cache.page_size == 8
    assert learner.cfg.num_microbatches == 2
    bf16 = dataclasses.replace(graph, execution=dataclasses.replace(PLANNED, dtype="bfloat16"))
    with pytest.raises(ValueError, match="bfloat16 compute, the model has float32 / float32"):
        place_models(bf16, model, GRPOConfig(group_size=2), RolloutShape(num_slots=4, max_prompt_len=8,
                                                                         max_new_tokens=8, chunk_steps=4))


def test_the_cost_model_reads_the_graph_options():
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, presets.h100_node(8))
    base = builders.grpo_graph(use_reference=True, num_devices=8, parallel={"fsdp": 8})

    def update_peak(**changes):
        graph = dataclasses.replace(base, execution=Execution(scan_layers=True, dtype="bfloat16", **changes))
        return evaluator.predict(graph, enforce_memory=False, with_trace=False).stage("actor_update").peak_memory_bytes

    none, dots, full = (update_peak(attention="blockwise", remat=r) for r in ("none", "dots", "full"))
    assert none > dots > full
    assert update_peak(attention="dense", remat="none") > none  # dense keeps [t, t] scores
    assert update_peak(attention="blockwise", remat="none", update_microbatches=4) < none
    # the runtime pads every row to the longest (no packing): options from the graph say so
    graph = dataclasses.replace(base, execution=Execution())
    assert not evaluator.inputs_for(graph).options.sequence_packing


def _hardware(platform):
    hw = presets.gh200_quad(8)
    return dataclasses.replace(hw, device=dataclasses.replace(hw.device, platform=platform))


@pytest.mark.parametrize("platform, dtype, kernels", [("gpu", "bfloat16", {"cudnn"}), ("cpu", "bfloat16", {"blockwise"}),
                                                      ("gpu", "float32", {"blockwise"})])
def test_the_planner_emits_only_what_the_runtime_runs(platform, dtype, kernels):
    hw = _hardware(platform)
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, hw)
    space = dataclasses.replace(SMALL_SPACE, attention=("cudnn", "blockwise"), dtype=dtype)
    search = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space)
    plans = search.brute_force(top=1000)
    unpacked = [p for p in plans if not p.graph.execution.packing]
    assert unpacked and {p.graph.execution.attention for p in unpacked} == kernels
    # cuDNN's kernel takes no segment ids: packed plans run blockwise
    assert {p.graph.execution.attention for p in plans if p.graph.execution.packing} <= {"blockwise"}
    for plan in plans:
        assert not executable.plan_problems(plan.graph, hw)
        assert plan.graph.execution.dtype == dtype and not evaluator.inputs_for(plan.graph).options.sequence_packing


def test_a_space_the_runtime_cannot_run_is_refused():
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _hardware("cpu"))
    with pytest.raises(ValueError, match="'cudnn' needs a CUDA GPU"):
        planner.Planner(evaluator, algorithm="grpo", num_devices=8,
                        space=dataclasses.replace(SMALL_SPACE, attention=("cudnn",)))
    other_system = step_model.Evaluator(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _hardware("gpu"))
    with pytest.raises(ValueError, match="Evaluator.for_runtime"):
        planner.Planner(other_system, algorithm="grpo", num_devices=8, space=SMALL_SPACE)


def test_the_pallas_decode_is_searched_on_gpus_and_refused_elsewhere():
    """The space's decode attention: on a GPU the planner's best plan reads each row's own pages (its generation
    is faster on the long tail); on a CPU the kernel is not executable and the planner keeps to the gather."""
    space = dataclasses.replace(SMALL_SPACE, attention=("blockwise",), remat=("full",), packing=(False,),
                                optimizer_offload=(False,), decode_attention=("pallas", "gather"))
    best = {}
    for platform in ("gpu", "cpu"):
        evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _hardware(platform))
        best[platform] = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space).search(top=1).best
    assert best["gpu"].graph.execution.decode_attention == "pallas"
    assert best["cpu"].graph.execution.decode_attention == "gather"
    problems = executable.execution_problems(Execution(kv_cache="paged", decode_attention="pallas"), _hardware("cpu"))
    assert problems == ["decode attention 'pallas' (a Triton kernel) needs a CUDA GPU; GH200-96GB is a cpu device (use "
                        "'gather')"]


def test_unexecutable_plans_are_named():
    hw = _hardware("cpu")
    graph = builders.grpo_graph(use_reference=True, num_devices=8, parallel={"pipeline": 2, "fsdp": 4})
    graph = dataclasses.replace(graph, execution=Execution(attention="cudnn", dtype="float32"))
    problems = " | ".join(executable.plan_problems(graph, hw, follows_runtime=False))
    for expected in ("CUDA GPU", "computes in bfloat16 or float16", "'pipeline': 2", "another system's"):
        assert expected in problems
    with pytest.raises(ValueError, match="cannot be executed by rpegjax's runtime"):
        executable.require_executable(graph, hw)


def test_plan_cli_refuses_a_space_the_hardware_cannot_run(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[3] / "scripts" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_script", path)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    with pytest.raises(SystemExit, match="'cudnn' computes in bfloat16 or float16"):
        plan.main(["--model", "qwen2.5-0.5b", "--hardware", "h100", "--gpus", "8", "--prompts", "8",
                   "--prompt-tokens", "64", "--response-mean", "64", "--response-max", "256", "--attention", "cudnn",
                   "--dtype", "float32", "--json"])
    plan.main(["--model", "qwen2.5-0.5b", "--hardware", "h100", "--gpus", "8", "--prompts", "8", "--prompt-tokens", "64",
               "--response-mean", "64", "--response-max", "256", "--json", "--top", "0"])
    document = json.loads(capsys.readouterr().out)
    for entry in document["plans"]:
        execution = Execution.from_dict(entry["graph"]["execution"])
        assert not executable.execution_problems(execution, presets.preset("h100", 8))


def test_batches_must_split_over_every_program_replicas():
    graph = builders.grpo_graph(use_reference=True, num_devices=8, parallel={"data": 2, "fsdp": 4})
    assert not executable.batch_problems(dataclasses.replace(graph, execution=Execution(update_microbatches=4)), 64)
    uneven = dataclasses.replace(graph, execution=Execution(update_microbatches=16))  # 4 rows over 8 replicas
    assert "64 sequences in 16 update micro-batches do not split over its 8" in executable.batch_problems(uneven, 64)[0]
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _hardware("gpu"))
    search = planner.Planner(evaluator, algorithm="grpo", num_devices=8,
                             space=dataclasses.replace(SMALL_SPACE, update_microbatches=(1, 2, 4, 8, 16, 32)))
    for plan in search.brute_force(top=1000):
        assert not executable.batch_problems(plan.graph, WORKLOAD.sequences)


def test_a_packing_plan_reaches_the_learner_and_the_cost_model_counts_real_tokens():
    packed = Execution(packing=True, max_tokens_per_micro_batch=4096)
    graph = Graph.from_json(dataclasses.replace(builders.grpo_graph(use_reference=True), execution=packed).to_json())
    model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    learner, _ = place_models(graph, model, GRPOConfig(group_size=2),
                              RolloutShape(num_slots=4, max_prompt_len=8, max_new_tokens=8, chunk_steps=4))
    assert (learner.cfg.packing, learner.cfg.max_tokens_per_micro_batch) == (True, 4096)
    with pytest.raises(ValueError, match="the algorithm asks for packing=True, max_tokens_per_micro_batch=64"):
        place_models(graph, model, GRPOConfig(group_size=2, packing=True, max_tokens_per_micro_batch=64),
                     RolloutShape(num_slots=4, max_prompt_len=8, max_new_tokens=8, chunk_steps=4))
    options = stage_costs.ExecutionOptions().executing(packed)
    assert options.packed_row_tokens == 4096 and not options.sequence_packing  # not another system's token passes
    assert stage_costs.ExecutionOptions().executing(Execution()).packed_row_tokens is None
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, presets.h100_node(8))
    passes = {}
    for name, execution in (("padded", Execution(attention="blockwise")),
                            ("packed", Execution(attention="blockwise", packing=True, max_tokens_per_micro_batch=4096))):
        graph = dataclasses.replace(builders.grpo_graph(use_reference=True, num_devices=8, parallel={"fsdp": 8}),
                                    execution=execution)
        passes[name] = evaluator.stage_costs(graph)[0]["actor_update"]
    assert passes["packed"].flops < passes["padded"].flops / 2  # a long tail: packed rows compute far fewer tokens
