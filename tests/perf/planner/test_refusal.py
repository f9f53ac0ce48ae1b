"""Refusals: the binding stage, its phase and what would make the plan fit, in one line."""

import dataclasses

import pytest

from rpegjax.graph.ir import Algorithm, Execution
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.planner import refusal
from rpegjax.perf.reference import presets

WORKLOAD = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(1024, 8192))
LAYOUT = (("data", 1), ("fsdp", 8), ("tensor", 1))
LIMITS = dict(most_update_microbatches=8, most_inference_microbatches=8, sequences=WORKLOAD.sequences)


def _line(execution: Execution, memory_gb: float, workload: Workload = WORKLOAD) -> tuple[str, step_model.Prediction]:
    hw = presets.h100_node(8)
    hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, memory_bytes=memory_gb * 1e9))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("1.5b"), workload, hw)
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=True, num_devices=8,
                                generation_layout=(("data", 8), ("fsdp", 1), ("tensor", 1)), train_layout=LAYOUT,
                                execution=execution)
    prediction = evaluator.predict(planner.build_graph(choice), with_trace=False)
    return refusal.refusal_line(prediction, batch_problems=[], **LIMITS), prediction


def test_an_update_that_does_not_fit_names_the_training_phase_and_more_micro_batches():
    line, prediction = _line(Execution(attention="blockwise", remat="none", param_dtype="float32", dtype="bfloat16"), 20)
    assert not prediction.fits
    assert line.startswith("training (actor_update): needs ") and "of 18.0 GB per GPU" in line
    assert line.endswith("fits with more update micro-batches (it has 1)")
    at_most, _ = _line(Execution(attention="blockwise", remat="none", update_microbatches=8, param_dtype="float32", dtype="bfloat16"), 20)
    assert at_most.startswith("training (actor_update)") and at_most.endswith("full remat, more GPUs or shorter responses")


def test_a_log_prob_pass_that_does_not_fit_names_the_inference_phase():
    # responses long enough that the whole batch's log-prob pass outgrows the update in 8 micro-batches
    longer = dataclasses.replace(WORKLOAD, responses=ResponseLengths.lognormal(4096, 32768))
    line, _ = _line(Execution(attention="blockwise", remat="full", update_microbatches=8, param_dtype="float32",
                              dtype="bfloat16"), 15, longer)
    assert line.startswith("inference (ref_logprob): needs ") and "of 13.5 GB per GPU" in line
    assert line.endswith(f"fits with more inference micro-batches (rows {WORKLOAD.sequences} each)")
    split = planner.build_graph(planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=True, num_devices=8,
                                                   generation_layout=LAYOUT, train_layout=LAYOUT,
                                                   execution=Execution(inference_rows=8)))
    assert refusal.remedy("inference", split, **LIMITS) == ("more GPUs or shorter responses (already 8 rows per "
                                                            "inference micro-batch)")


def test_generation_without_room_for_one_sequence_names_the_generation_phase():
    line, prediction = _line(Execution(attention="blockwise", remat="full", update_microbatches=8, inference_rows=8, param_dtype="bfloat16",
                                       dtype="bfloat16"), 5.2)
    assert refusal.binding_stage(prediction)[0] == "generate"
    assert line.startswith("generation (generate): the KV cache of one sequence") and "tensor parallelism" in line


def test_the_planner_refuses_with_one_line_per_family():
    hw = presets.h100_node(8)
    hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, memory_bytes=6e9))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("1.5b"), WORKLOAD, hw)
    space = planner.PlanSpace(async_bounds=(0,), fusion=(False,), microbatches=(1,), tensor_sizes=(1, 2),
                              generation_fractions=(None, 0.5), reshard_inference=(False,), attention=("blockwise",),
                              remat=("full",))
    with pytest.raises(ValueError, match="no plan of .* the closest of each family") as error:
        planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space).search()
    lines = str(error.value).split("\n")[1:]
    assert [line.split(" (")[0].strip() for line in lines] == sorted(
        {line.split(" (")[0].strip() for line in lines}, key=[line.split(" (")[0].strip() for line in lines].index)
    assert {line.split(" (")[0].strip() for line in lines} == {"colocated", "disaggregated 4+4"}
    assert all("fits with" in line for line in lines)
