"""Packed batches in the performance model: passes, tokens and pairs as the runtime's packer lays the rows out;
the planner searches packing and fits its token budget; a packed plan runs in the job and its dry run."""

import dataclasses

import numpy as np
import pytest

from rpegjax.graph import builders
from rpegjax.graph.ir import Execution, Graph
from rpegjax.learners.packing import plan_packing
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import costs, packed_batches, stage_costs, step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.planner import executable
from rpegjax.perf.reference import presets

TAIL = Workload(prompts=32, group_size=4, prompt_tokens=64, responses=ResponseLengths.lognormal(256, 2048))
FLASH = costs.AttentionKernel.FLASH


def _runtime_pairs(plan) -> float:
    """Causal pairs of every run of one segment id in the runtime's packed rows (padding runs included)."""
    total = 0.0
    for row in plan.segment_ids():
        edges = np.flatnonzero(np.diff(row)) + 1
        runs = np.diff(np.concatenate([[0], edges, [row.size]]))
        total += float((runs * (runs + 1) // 2).sum())
    return total


@pytest.mark.parametrize("minibatches, shards, budget", [(1, 1, 2112), (1, 8, 4096), (4, 2, 2560), (2, 4, 8192)])
def test_update_passes_are_the_runtime_packers_rows(minibatches, shards, budget):
    lengths = TAIL.prompt_tokens + TAIL.responses.sample(TAIL.sequences)
    plan = plan_packing(lengths, budget, minibatches=minibatches, shards=shards)
    packed = packed_batches.update_passes(TAIL, budget, minibatches=minibatches, shards=shards, kernel=FLASH)
    assert packed.passes * shards == plan.num_rows  # micro-batches of one packed row per row shard
    assert packed.tokens == plan.num_rows * budget
    assert packed.rows == len(set(plan.rows.tolist()))
    assert packed.pairs == _runtime_pairs(plan)
    dense = packed_batches.update_passes(TAIL, budget, minibatches=minibatches, shards=shards,
                                         kernel=costs.AttentionKernel.DENSE)
    assert dense.pairs == plan.num_rows * budget**2


def test_inference_passes_pack_each_piece_on_its_own():
    lengths = TAIL.prompt_tokens + TAIL.responses.sample(TAIL.sequences)
    packed = packed_batches.inference_passes(TAIL, 4096, pieces=4, shards=4, kernel=FLASH)
    plans = [plan_packing(lengths[j::4], 4096, shards=4) for j in range(4)]
    assert packed.passes == sum(plan.num_rows for plan in plans) // 4
    assert packed.pairs == sum(_runtime_pairs(plan) for plan in plans)
    with pytest.raises(ValueError, match="does not fit packed rows of 1024 tokens"):
        packed_batches.inference_passes(TAIL, 1024, pieces=1, shards=1, kernel=FLASH)


def test_packed_rows_of_full_sequences_cost_what_padded_rows_do():
    """Every sequence at the maximum and a budget of one sequence: a packed pass is one padded row per replica."""
    full = Workload(prompts=16, group_size=4, prompt_tokens=512, responses=ResponseLengths.fixed(1536))
    shape = costs.ModelShape.from_config(ModelConfig.qwen2p5("7b"))
    layout = stage_costs.Layout.from_parallel({"data": 2, "fsdp": 4}, where="test")
    base = stage_costs.ExecutionOptions()

    def update(execution):
        inputs = stage_costs.CostInputs(hardware=presets.h100_node(8), actor=shape, critic=shape, workload=full,
                                        options=base.executing(execution))
        return stage_costs.model_pass_cost(inputs, shape, layout, logits=True, backward=True, optimizer_steps=2)

    # 64 rows / 2 mini-batches / 4 micro-batches / 8 replicas: one row per replica and pass
    padded = update(Execution(attention="blockwise", remat="full", update_microbatches=4))
    packed = update(Execution(attention="blockwise", remat="full", packing=True, max_tokens_per_micro_batch=2048))
    assert packed.detail["passes"] == padded.detail["passes"] == 8
    assert packed.flops == pytest.approx(padded.flops)
    assert packed.transient_bytes == pytest.approx(padded.transient_bytes)
    assert packed.seconds == pytest.approx(padded.seconds)


def test_the_planner_packs_a_long_tail_with_the_fastest_budget_that_fits():
    hw = presets.gh200_quad(8)
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), TAIL, hw)
    space = planner.PlanSpace(async_bounds=(0,), fusion=(True,), microbatches=(1,), tensor_sizes=(1, 2),
                              generation_fractions=(None,), reshard_inference=(False,), remat=("full",),
                              optimizer_offload=(False,), context_sizes=(1, 2))
    search = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space)
    best = search.search(top=1).best
    execution = best.graph.execution
    assert execution.packing and execution.attention == "blockwise"  # cuDNN cannot run packed rows
    padded = planner.Planner(evaluator, algorithm="grpo", num_devices=8,
                             space=dataclasses.replace(space, packing=(False,))).search(top=1).best
    assert not padded.graph.execution.packing
    assert best.prediction.step_seconds < padded.prediction.step_seconds
    budgets = search.fitting.budgets(best.choice)
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] >= TAIL.prompt_tokens + TAIL.responses.max
    assert budgets[-1] % 512 == 0 and execution.max_tokens_per_micro_batch in budgets
    # the budget is the fastest for the update and log-prob stages: every other budget that fits is slower
    def passes_seconds(budget):
        choice = dataclasses.replace(best.choice, execution=dataclasses.replace(execution, max_tokens_per_micro_batch=budget))
        prediction = evaluator.predict(planner.build_graph(choice), with_trace=False)
        stages = [s for s in prediction.stages if "logprob" in s.name or "update" in s.name]
        return prediction.fits, sum(s.seconds for s in stages)

    chosen = passes_seconds(execution.max_tokens_per_micro_batch)
    others = [passes_seconds(b) for b in budgets if b != execution.max_tokens_per_micro_batch]
    assert chosen[0] and all(seconds >= chosen[1] for fits, seconds in others if fits)
    assert any(seconds > 1.5 * chosen[1] for _, seconds in others)  # too large computes padding, too small pays passes
    assert not executable.plan_problems(best.graph, hw)
    assert Graph.from_json(best.graph.to_json()).execution == execution


def test_context_parallel_packed_rows_cut_into_whole_blocks():
    assert executable.packed_row_problem(18432, 2, 512) is None  # 4 chunks of 4608 = 9 blocks
    assert "multiple of 2048" in executable.packed_row_problem(17408, 2, 512)
    assert executable.packed_row_problem(17408, 1, 512) is None
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), TAIL, presets.gh200_quad(8))
    search = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=planner.PlanSpace(
        context_sizes=(1, 4), attention=("blockwise",)))
    choice = planner.PlanChoice(algorithm="grpo", use_reference=False, num_devices=8,
                                train_layout=(("data", 1), ("fsdp", 2), ("context", 4), ("tensor", 1)),
                                execution=Execution(attention="blockwise", packing=True, max_tokens_per_micro_batch=1))
    assert all(b % (2 * 4 * 512) == 0 and not executable.packed_row_problem(b, 4, 512)
               for b in search.fitting.budgets(choice))


def test_a_packed_plan_reaches_the_learner_and_its_dry_run_compiles_packed_programs():
    """The planner's packed execution through the job's set-up path (`place_models`) and the dry run (4 virtual
    CPU devices, a tiny model): the update and log-prob programs take packed rows and compile."""
    import jax

    from rpegjax.learners import GRPOConfig
    from rpegjax.train.dry_run import Batch, compile_programs, lower_plan

    assert jax.device_count() >= 4
    packed = Execution(attention="blockwise", attention_block_size=16, remat="full", scan_layers=True, packing=True,
                       max_tokens_per_micro_batch=128)
    graph = dataclasses.replace(builders.grpo_graph(use_reference=False, num_devices=4, parallel={"fsdp": 4}),
                                execution=packed)
    batch = Batch(rows=8, prompt=16, new=48, slots=8, group_size=4)
    programs = [p for p in lower_plan(graph, ModelConfig.tiny(vocab_size=256), GRPOConfig(group_size=4), batch)
                if p.program in ("inference", "update")]
    assert {p.program for p in programs} == {"inference", "update"}
    for program in programs:
        # 8 rows of 64 tokens packed two to a 128-token row: 4 rows, one per fsdp shard
        assert "tensor<4x128xi32>" in program.lowered.as_text()
    update = next(p for p in programs if p.program == "update")
    assert "tensor<8x64xi32>" not in update.lowered.as_text()  # no unpacked rows (inference unpacks its outputs)
    report = compile_programs(programs, capacity_bytes=1e9)
    assert report.fits and all(p.temporaries > 0 for p in report.programs)
