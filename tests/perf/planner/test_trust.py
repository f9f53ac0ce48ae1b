"""Trusted plans: the planner ranks only plans in the regime its memory formulas were checked in, fitting with the
margins measured there, and says in one line why it does not trust the others."""

import dataclasses

import pytest

from rpegjax.graph.ir import Algorithm, Execution
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import step_model
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.planner import trust
from rpegjax.perf.reference import presets

WORKLOAD = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
LAYOUT = (("data", 1), ("fsdp", 8), ("tensor", 1))
SPACE = planner.PlanSpace(async_bounds=(0,), fusion=(False,), microbatches=(1,), tensor_sizes=(1, 2),
                          generation_fractions=(None,), reshard_inference=(False,), attention=("blockwise", "dense"),
                          remat=("full",), optimizer_offload=(False,))


def _evaluator(model: str = "0.5b", workload: Workload = WORKLOAD) -> step_model.Evaluator:
    return step_model.Evaluator.for_runtime(ModelConfig.qwen2p5(model), workload, presets.h100_node(8))


def _prediction(execution: Execution, layout=LAYOUT, evaluator=None) -> step_model.Prediction:
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=True, num_devices=8,
                                generation_layout=(("data", 8), ("fsdp", 1), ("tensor", 1)), train_layout=layout,
                                execution=execution)
    return (evaluator or _evaluator()).predict(planner.build_graph(choice), with_trace=False)


def test_plans_outside_the_checked_regime_are_untrusted_with_one_line_each():
    flash = Execution(attention="blockwise", remat="full", scan_layers=True)
    shape = ModelShape.from_config(ModelConfig.qwen2p5("0.5b"))
    assert trust.untrusted(_prediction(flash), shape, 2304) is None
    big = ModelShape.from_config(ModelConfig.qwen2p5("72b"))
    sequence_parallel = _prediction(dataclasses.replace(flash, sequence_parallel=True),
                                    (("data", 1), ("fsdp", 4), ("tensor", 2)))
    cases = {
        "72.": (_prediction(flash), big, 2304),
        "rows of 32768 tokens: memory checked up to 17408": (_prediction(flash), shape, 32768),
        "dense attention": (_prediction(dataclasses.replace(flash, attention="dense")), shape, 2304),
        "context parallelism": (_prediction(flash, (("data", 1), ("fsdp", 4), ("context", 2), ("tensor", 1))), shape, 2304),
        "rows of 40000 tokens: memory checked up to 32768 with sequence parallelism": (sequence_parallel, shape, 40000),
    }
    for expected, (prediction, model, row) in cases.items():
        line = trust.untrusted(prediction, model, row)
        assert line is not None and line.startswith("untrusted: ") and expected in line and "\n" not in line, line


def test_sequence_parallel_plans_are_trusted_up_to_the_rows_checked_on_the_gpu_compiler():
    """Sequence parallelism was checked on XLA's GPU compiler up to 32k-token rows (docs/benchmarks.md, "W-long"):
    inside, trusted at any row length the checks covered; a regime without such checks refuses it."""
    shape = ModelShape.from_config(ModelConfig.qwen2p5("0.5b"))
    prediction = _prediction(Execution(attention="blockwise", remat="full", scan_layers=True, sequence_parallel=True),
                             (("data", 1), ("fsdp", 4), ("tensor", 2)))
    assert trust.regime_problem(prediction.graph, shape, 32768) is None
    assert trust.regime_problem(prediction.graph, shape, 17409) is None
    unchecked = trust.CheckedRegime(**{**_fields(trust.GPU_CHECKED), "longest_sequence_parallel_row": 0})
    problem = trust.regime_problem(prediction.graph, shape, 2304, unchecked)
    assert problem == "sequence parallelism: its memory was not checked against the GPU compiler"
    with pytest.raises(ValueError, match="longest_sequence_parallel_row"):
        trust.CheckedRegime(**{**_fields(trust.GPU_CHECKED), "longest_sequence_parallel_row": -1})


def test_a_stage_within_the_usable_memory_but_not_its_margin_is_untrusted():
    prediction = _prediction(Execution(attention="blockwise", remat="full", scan_layers=True))
    shape = ModelShape.from_config(ModelConfig.qwen2p5("0.5b"))
    update = prediction.stage("actor_update").peak_memory_bytes
    assert prediction.fits
    room = prediction.memory_limit_bytes / update - 1  # the margin the update has left
    margins = {trust.GENERATION: 0.0, trust.INFERENCE: 0.0}
    inside = trust.CheckedRegime(**{**_fields(trust.GPU_CHECKED), "margins": {**margins, trust.TRAINING: 0.99 * room}})
    outside = trust.CheckedRegime(**{**_fields(trust.GPU_CHECKED), "margins": {**margins, trust.TRAINING: 1.01 * room}})
    assert trust.untrusted(prediction, shape, 2304, inside) is None
    line = trust.untrusted(prediction, shape, 2304, outside)
    assert line.startswith("untrusted: training (actor_update) predicted") and "its phase's programs compiled" in line


def _fields(regime: trust.CheckedRegime) -> dict:
    return {field.name: getattr(regime, field.name) for field in dataclasses.fields(regime)}


def test_the_planner_ranks_out_untrusted_plans_as_brute_force_does():
    space = dataclasses.replace(SPACE, context_sizes=(1, 2))
    search = planner.Planner(_evaluator(), algorithm="grpo", num_devices=8, space=space)
    result = search.search(top=3)
    for plan in (result.best, *result.alternatives):
        assert search.untrusted(plan) is None
        assert plan.graph.execution.attention == "blockwise" and "c2" not in plan.choice.describe()
    assert [p.choice for p in (result.best, *result.alternatives)] == [p.choice for p in search.brute_force(top=3)]


def test_when_no_plan_is_trusted_the_planner_says_why_per_family():
    evaluator = _evaluator(workload=dataclasses.replace(WORKLOAD, responses=ResponseLengths.lognormal(512, 32768)))
    with pytest.raises(ValueError, match="trusts; the closest of each family") as error:
        planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=SPACE).search()
    lines = str(error.value).split("\n")[1:]
    assert lines and all("untrusted: rows of 33024 tokens: memory checked up to 17408" in line for line in lines)


def test_the_kv_pool_leaves_the_generation_margin():
    hw = presets.h100_node(8)
    hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, memory_bytes=14e9))  # the pool binds
    longer = Workload(prompts=64, group_size=8, prompt_tokens=256, responses=ResponseLengths.lognormal(1024, 4096))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("1.5b"), longer, hw)
    space = dataclasses.replace(SPACE, attention=("blockwise",), tensor_sizes=(2,))
    plain = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space)
    best = plain.search(top=1).best
    regime = trust.CheckedRegime(**{**_fields(trust.GPU_CHECKED),
                                    "margins": {**trust.GPU_CHECKED.margins, trust.GENERATION: 0.1}})
    careful = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space, regime=regime)
    choice = careful.fitting.fit(dataclasses.replace(best.choice,
                                                    execution=careful.fitting.unfitted(best.choice.execution)))
    again = careful._plan(choice)
    usable = evaluator.inputs.hardware.usable_memory_bytes
    assert best.prediction.stage("generate").peak_memory_bytes > usable / 1.1  # the pool fills what generation leaves
    assert again.prediction.stage("generate").peak_memory_bytes <= usable / 1.1
    assert again.graph.execution.kv_pool_tokens < best.graph.execution.kv_pool_tokens
    assert careful.untrusted(again) is None and careful.untrusted(best) is not None
