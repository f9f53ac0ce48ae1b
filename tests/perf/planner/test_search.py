"""The planner: exact against brute force, memory limits respected, executable graphs, reference plans."""

import dataclasses
import math
import time

import pytest

from rpegjax.graph.ir import Algorithm, Graph, StageKind
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.reference import presets

WORKLOAD = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
SPACE = planner.PlanSpace(async_bounds=(0, 1), fusion=(False, True), microbatches=(1, 2), tensor_sizes=(1, 2),
                          generation_fractions=(None, 0.5), reshard_inference=(False, True), packed_rows=(8, 1))


def _two_nodes(memory_bytes=None):
    hw = presets.gh200_quad(8)
    if memory_bytes is not None:
        hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, memory_bytes=memory_bytes))
    return hw


def _summary(plans):
    return [(p.choice.describe(), p.prediction.step_seconds) for p in plans]


# PPO's search is 22 s: slow; GRPO's runs by default
@pytest.mark.parametrize("algorithm", [pytest.param(Algorithm.PPO, marks=pytest.mark.slow), Algorithm.GRPO])
def test_planner_equals_brute_force_on_a_small_case(algorithm):
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _two_nodes())
    search = planner.Planner(evaluator, algorithm=algorithm, num_devices=8, space=SPACE)
    result = search.search(top=4)
    brute = search.brute_force(top=4)
    assert _summary((result.best, *result.alternatives)) == _summary(brute)
    assert result.evaluated < result.candidates  # the bound pruned part of the space


def test_planner_equals_brute_force_with_partial_rollouts_and_packing():
    """The search's order (generation seconds first, the full bound when popped) keeps it exact where partial
    rollouts and packing multiply the candidates (W-plan's default space has both)."""
    space = dataclasses.replace(SPACE, async_bounds=(0, 2), microbatches=(1,), generation_fractions=(None, 0.5),
                                tensor_sizes=(2,), attention=("blockwise",), remat=("dots",), partial_rollouts=(False, True),
                                inflight_batches=(2,))
    search = _small_search(space=space)
    result = search.search(top=4)
    brute = search.brute_force(top=4)
    assert _summary((result.best, *result.alternatives)) == _summary(brute)
    assert any(p.choice.execution.partial_rollouts for p in brute) and result.evaluated < result.candidates


def test_plans_never_exceed_memory_and_infeasible_ones_are_ranked_out():
    hw = _two_nodes(memory_bytes=40e9)
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), WORKLOAD, hw)
    search = planner.Planner(evaluator, algorithm=Algorithm.PPO, num_devices=8, space=dataclasses.replace(
        SPACE, async_bounds=(0,), microbatches=(1,), reshard_inference=(False,), param_dtype="bfloat16"))
    everything = [search._plan(choice) for skeleton in search.skeletons() for choice in search.variants(skeleton)]
    assert any(not p.prediction.fits for p in everything) and any(p.prediction.fits for p in everything)
    result = search.search(top=3)
    for plan in (result.best, *result.alternatives):
        assert plan.prediction.fits and plan.prediction.peak_memory_bytes <= hw.usable_memory_bytes
    # the best is the fastest plan that fits with its phase's margin (`perf.trust`): a faster one may fit only without
    trusted = [p for p in everything if p.prediction.fits and search.untrusted(p) is None]
    assert result.best.prediction.step_seconds == pytest.approx(min(p.prediction.step_seconds for p in trusted))
    tiny = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), WORKLOAD, _two_nodes(memory_bytes=4e9))
    with pytest.raises(ValueError, match="no plan .* fits in device memory"):
        planner.Planner(tiny, algorithm=Algorithm.PPO, num_devices=8, space=SPACE).search()


def test_the_best_plan_is_an_executable_graph():
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _two_nodes())
    result = planner.Planner(evaluator, algorithm=Algorithm.PPO, num_devices=8, space=SPACE).search(top=2)
    graph = result.best.graph
    assert graph.validate() is graph and graph.num_devices == 8
    again = Graph.from_json(graph.to_json())
    assert again == graph
    assert evaluator.predict(again).step_seconds == pytest.approx(result.best.prediction.step_seconds)
    for stage in graph.stages:
        if not stage.host:
            assert graph.placements[stage.placement].devices is not None  # the runtime gets explicit devices
    assert graph.async_bound == result.best.choice.async_bound


def test_reference_plans_have_their_fixed_structure():
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _two_nodes())
    verl = planner.verl_like(evaluator, algorithm="ppo", num_devices=8)
    assert verl.graph.async_bound == 0 and set(verl.graph.placements) == {"all"}
    assert dict(verl.graph.parallel_of("actor_update")) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert dict(verl.graph.parallel_of("generate"))["tensor"] == 2
    assert not any(s.fused_group for s in verl.graph.stages) and not verl.graph.shares_actor_critic
    real = planner.real_like(evaluator, algorithm="ppo", num_devices=8)
    assert real.graph.async_bound == 0 and not real.graph.shares_actor_critic
    best = planner.Planner(evaluator, algorithm="ppo", num_devices=8).search(top=1).best
    assert best.prediction.step_seconds <= min(verl.prediction.step_seconds, real.prediction.step_seconds) + 1e-9


def test_bad_spaces_are_refused():
    with pytest.raises(ValueError, match="generation_fractions"):
        planner.PlanSpace(generation_fractions=(1.5,))
    with pytest.raises(ValueError, match="at least one choice"):
        planner.PlanSpace(fusion=())
    with pytest.raises(ValueError, match="critic"):
        planner.PlanSpace(critic_modes=("both",))


@pytest.mark.slow
def test_planning_256_gpus_takes_seconds():
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), Workload.w_plan(), presets.gh200_quad(256))
    start = time.perf_counter()
    result = planner.Planner(evaluator, algorithm=Algorithm.PPO, num_devices=256).search()
    assert time.perf_counter() - start < 60
    assert result.best.prediction.fits and result.best.graph.stages_of_kind(StageKind.GENERATE)



@pytest.mark.parametrize("fractions, reshard", [((None,), (False,)), ((0.5,), (True,))], ids=["colocated", "disaggregated"])
def test_a_planned_graph_survives_json_and_runs_in_the_runtime(tmp_path, fractions, reshard):
    """The planner's plan for the 8 (virtual) devices, saved as JSON, is what a run executes (`graph.plan`):
    generation on its sub-mesh, inference stages on the layouts the plan gives them."""
    import jax

    from rpegjax.data.iterator import DataIterator
    from rpegjax.graph.trace import Trace, max_staleness
    from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
    from rpegjax.runtime.controller import Runtime
    from rpegjax.train.build import build
    from rpegjax.train.config import (
        DataSection,
        GraphSection,
        ModelSection,
        RolloutSection,
        RunConfig,
        TrainSection,
        WarmStartSection,
    )
    from rpegjax.train.trainer import make_programs

    model = ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    shape = ModelConfig(vocab_size=99, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                        intermediate_size=64)
    workload = Workload(prompts=4, group_size=2, prompt_tokens=12, responses=ResponseLengths.fixed(6))
    evaluator = step_model.Evaluator.for_runtime(shape, workload, _two_nodes())
    # the run's precision (a plan with another is refused by the run); the run's 8 slots (a partial-rollout plan's
    # sampler holds both batches in flight: 16, which this run would refuse;
    # tests/perf/model/test_partial_rollout_model.py)
    space = planner.PlanSpace(async_bounds=(0, 1), fusion=(False, True), microbatches=(1, 2), tensor_sizes=(1,),
                              generation_fractions=fractions, reshard_inference=reshard, dtype="float32",
                              partial_rollouts=(False,))
    best = planner.Planner(evaluator, algorithm="grpo", num_devices=8, use_reference=True, space=space).search(top=1).best
    path = tmp_path / "plan.json"
    path.write_text(best.graph.to_json())
    cfg = RunConfig(
        model=model, data=DataSection(train_size=32, eval_size=4),
        rollout=RolloutSection(prompts_per_step=4, group_size=2, max_prompt_len=12, max_new_tokens=6, num_slots=8,
                               chunk_steps=3),
        warm_start=WarmStartSection(steps=0), graph=GraphSection(plan=str(path)), train=TrainSection(steps=2, reward_workers=1))
    cfg = cfg.replace(grpo=dataclasses.replace(cfg.grpo, kl_coef=0.04))
    parts = build(cfg, log=lambda _: None)
    assert parts.graph == best.graph
    rewards = RewardRunner(parts.task.reward, RewardRunnerConfig(timeout_s=2.0, workers=1, isolation=parts.task.isolation))
    trace = Trace()
    try:
        runtime = Runtime(parts.graph, make_programs(parts, rewards), DataIterator(parts.train_examples, batch_size=4, seed=0),
                          prompt_ids=parts.prompt_ids, key=jax.random.key(0), trace=trace)
        results = []
        runtime.run(parts.learner.init_state(), start_step=0, num_steps=2, on_step=lambda result, _: results.append(result))
    finally:
        rewards.close()
    assert [r.step for r in results] == [0, 1]
    recorded = {e.stage for e in trace.events}
    for unit in parts.graph.execution_units():  # every unit of the planned graph was executed and traced
        assert "+".join(unit) in recorded or set(unit) <= recorded, (unit, recorded)
    assert max_staleness(trace) <= parts.graph.async_bound
    generation = {d.id for d in parts.sampler.mesh.devices.flat}
    assert generation == set(parts.graph.placements[parts.graph.stage("generate").placement].device_indices)
    if fractions != (None,):
        assert generation == {0, 1, 2, 3} and parts.learner.placement.mesh.devices.size == 4
        assert runtime.stage_meshes, "the plan re-shards inference stages; the runtime must run them so"


def test_the_pinned_sampler_takes_the_fewest_slots_as_fast_as_the_fastest_and_splits_whole_groups():
    """Of the slot counts tried (the most that fit and its halvings, whole groups per replica), the pinned one is
    within the space's `slot_tolerance` (2%) of the fastest and no fewer slots are; a paged pool holds no more than
    its slots at full capacity (more tokens are never used). The reference plans take the fastest (tolerance 0)."""
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _two_nodes())
    search = planner.Planner(evaluator, algorithm=Algorithm.GRPO, num_devices=8, space=SPACE)
    capacity = WORKLOAD.prompt_tokens + WORKLOAD.responses.max
    for skeleton in list(search.skeletons())[:6]:
        execution = skeleton.execution
        graph = planner.build_graph(skeleton)
        generate = graph.stages_of_kind(StageKind.GENERATE)[0]
        replicas = graph.parallel_of(generate.name).get("data", 1) * graph.parallel_of(generate.name).get("fsdp", 1)
        assert execution.decode_slots % WORKLOAD.group_size == 0 and execution.decode_slots % replicas == 0
        if execution.kv_cache == "paged":  # a replica's pool holds whole groups, at most every slot at capacity
            assert (execution.decode_slots // replicas) % WORKLOAD.group_size == 0 and execution.kv_pool_tokens
            assert execution.kv_pool_tokens <= execution.decode_slots // replicas * capacity
        unpinned = dataclasses.replace(skeleton, execution=dataclasses.replace(execution, decode_slots=None,
                                                                               kv_pool_tokens=None))
        paged = execution.kv_cache == "paged"  # whole groups per replica; a contiguous cache whole groups in all
        unit = WORKLOAD.group_size * replicas if paged else math.lcm(WORKLOAD.group_size, replicas)
        most = min(search.fitting.generation(unpinned)[0] * replicas // unit * unit,
                   -(-WORKLOAD.sequences // unit) * unit)
        seconds = {}
        for count in {max(unit, most // 2**i // unit * unit) for i in range(4)}:
            other = dataclasses.replace(skeleton, execution=dataclasses.replace(execution, decode_slots=count))
            seconds[count] = search.fitting.generation(other)[1].seconds
        fastest = min(seconds.values())
        pinned = search.fitting.generation(skeleton)[1].seconds
        assert pinned <= fastest * (1 + search.space.slot_tolerance)
        assert all(seconds[c] > fastest * (1 + search.space.slot_tolerance) for c in seconds if c < execution.decode_slots)
    reference = planner.verl_like(evaluator, algorithm=Algorithm.GRPO, num_devices=8, space=SPACE)
    execution, replicas = reference.graph.execution, 4  # verl-like generation: tensor 2 on 8 devices
    seconds = reference.prediction.stage("generate").seconds
    for count in (execution.decode_slots // 2, execution.decode_slots * 2):
        if count >= WORKLOAD.group_size * replicas:
            other = dataclasses.replace(reference.choice, execution=dataclasses.replace(execution, decode_slots=count))
            generated = search.fitting.generation(other)
            assert generated is None or seconds <= generated[1].seconds + 1e-9


def test_a_minimum_of_busy_slots_constrains_the_search():
    """`min_slot_busy`: every plan ranked keeps its generation slots at least that busy, the search stays exact
    (brute force agrees), the best is no faster than without the constraint, and one no plan can meet is refused
    with the reason."""
    space = dataclasses.replace(SPACE, async_bounds=(0,), microbatches=(1,), tensor_sizes=(2,), attention=("blockwise",),
                                remat=("dots",), reshard_inference=(False,), packing=(False,))
    free = _small_search(space=space).search(top=3)
    busy = [planner.generation_slot_busy(p.prediction) for p in (free.best, *free.alternatives)]
    floor = min(busy) + 0.5 * (1 - min(busy))  # above the least busy plan's
    search = _small_search(space=dataclasses.replace(space, min_slot_busy=floor))
    result = search.search(top=3)
    ranked = (result.best, *result.alternatives)
    assert all(planner.generation_slot_busy(p.prediction) >= floor for p in ranked)
    assert _summary(ranked) == _summary(search.brute_force(top=3))
    assert result.best.prediction.step_seconds >= free.best.prediction.step_seconds - 1e-9
    with pytest.raises(ValueError, match="min_slot_busy"):
        _small_search(space=dataclasses.replace(space, min_slot_busy=1.0)).search()


def test_re_sharded_inference_layouts_are_chosen_before_and_fitted_after_their_row_micro_batches():
    """Inference rows fitted to a training layout of 4 replicas (4 rows) do not split over an FSDP-8 layout: the
    per-stage layouts are timed without row micro-batches and the plan refitted on them (this raised before)."""
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), WORKLOAD, _two_nodes())
    search = planner.Planner(evaluator, algorithm=Algorithm.GRPO, num_devices=8, space=SPACE)
    train = (("data", 1), ("fsdp", 4), ("tensor", 2))
    choice = planner.PlanChoice(algorithm=Algorithm.GRPO, use_reference=True, num_devices=8,
                                generation_layout=(("data", 4), ("fsdp", 1), ("tensor", 2)), train_layout=train,
                                execution=dataclasses.replace(search.executions[0], inference_rows=4))
    candidates = planner.layouts(8, (1, 2), heads=14, kv_heads=2, node_size=4, with_fsdp=True)
    own = search.fitting.own_inference_layouts(choice, candidates)
    assert own and all(dict(layout)["fsdp"] * dict(layout)["data"] == 8 for _, layout in own)
    fitted = search.fitting.fit(dataclasses.replace(choice, inference_layouts=own,
                                                    execution=search.fitting.unfitted(choice.execution)))
    assert not search.fitting.batch_problems(planner.build_graph(fitted))
    plan = planner.real_like(evaluator, algorithm=Algorithm.GRPO, num_devices=8, space=SPACE)
    assert not search.fitting.batch_problems(plan.graph)


# ------------------------------------------------------------------------------ what makes the search fast, exactly
def _small_search(memory_bytes=None, workload=WORKLOAD, space=SPACE):
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), workload, _two_nodes(memory_bytes))
    return planner.Planner(evaluator, algorithm=Algorithm.GRPO, num_devices=8, space=space)


def test_the_first_bound_needs_no_fitting_and_is_below_every_fitted_variant():
    """Skeletons are ordered and pruned by a bound taken before their micro-batches are fitted: it must not exceed
    the fitted skeleton's bound nor any variant's step (a 7B model on 40 GB devices, so fitting takes
    micro-batches and some skeletons do not fit at all)."""
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), WORKLOAD, _two_nodes(memory_bytes=40e9))
    search = planner.Planner(evaluator, algorithm=Algorithm.GRPO, num_devices=8, space=dataclasses.replace(
        SPACE, param_dtype="bfloat16", reshard_inference=(False,)))
    fitted_counts, checked = set(), 0
    for pinned in search._pinned_skeletons():
        first = search._bound(pinned, fitted=False)
        generation = search.fitting.generation_seconds.get(pinned, 0.0)  # the search's first, cheaper bound (0: none)
        fitted = search.fitting.fit_passes(pinned)
        fitted_counts.add(fitted.execution.update_microbatches)
        assert first <= search._bound(fitted) + 1e-9
        for choice in search.variants(fitted):
            plan = search._plan(choice)
            if plan.prediction.fits:
                checked += 1
                assert max(first, generation) <= plan.prediction.step_seconds + 1e-9
    assert checked and len(fitted_counts) > 1


def test_generation_and_micro_batches_are_fitted_apart_with_the_same_result():
    """`Fitter.fit` pins the sampler first, then fits the passes; the reverse order gives the same plan."""
    search = _small_search(memory_bytes=24e9)
    for pinned in list(search._pinned_skeletons())[:12]:
        bare = dataclasses.replace(pinned, execution=search.fitting.unfitted(pinned.execution))
        assert search.fitting.fit(bare) == search.fitting.pin_generation(search.fitting.fit_passes(bare))


def test_dense_attention_is_left_out_only_where_its_flash_twin_dominates_it():
    """With 256-token prompts dense attention costs at least the flash kernel's time and memory in every plan of
    the space (checked here plan by plan), so the planner leaves it out; with 8-token prompts on a model whose
    attention phase outweighs its MLP, a query's scores are smaller than the flash kernel's accumulator and it
    stays."""
    long = _small_search()
    assert long.executions and all(e.attention.skips_causal_blocks for e in long.executions)
    tiny = step_model.Evaluator.for_runtime(ModelConfig.tiny(), dataclasses.replace(WORKLOAD, prompt_tokens=8),
                                            _two_nodes())
    # unpacked: packed rows cannot run on cuDNN, so blockwise stays beside dense there
    short = planner.Planner(tiny, algorithm=Algorithm.GRPO, num_devices=8, space=dataclasses.replace(SPACE, packing=(False,)))
    assert {e.attention for e in short.executions} == {"cudnn", "dense"}
    dense = _small_search(space=dataclasses.replace(SPACE, attention=("dense",), reshard_inference=(False,)))
    compared = 0
    for skeleton in dense.skeletons():
        for choice in dense.variants(skeleton):
            plan = dense._plan(choice)
            twin = dense._plan(dataclasses.replace(choice, execution=dataclasses.replace(choice.execution,
                                                                                         attention="blockwise")))
            assert twin.prediction.peak_memory_bytes <= plan.prediction.peak_memory_bytes + 1
            if plan.prediction.fits:
                compared += 1
                assert twin.prediction.fits and twin.prediction.step_seconds <= plan.prediction.step_seconds + 1e-9
    assert compared


def test_partial_rollout_plans_keep_their_token_lag_within_the_largest_asynchrony_bound():
    """A partial-rollout plan at bound k trains tokens up to k + 2 versions old: it is offered only where k + 2 is
    within the staleness the space allows (its largest bound), and never when the user asks for on-policy only."""
    def offered_bounds(bounds):
        search = _small_search(space=dataclasses.replace(SPACE, async_bounds=bounds, partial_rollouts=(True, False)))
        skeleton = next(s for s in search.skeletons() if s.execution.partial_rollouts)
        plain = dataclasses.replace(skeleton, execution=dataclasses.replace(skeleton.execution, partial_rollouts=False))
        assert {c.async_bound for c in search.variants(plain)} == set(bounds)
        return {c.async_bound for c in search.variants(skeleton)}

    assert offered_bounds((0, 1, 2)) == {0}
    assert offered_bounds((0, 1, 2, 3)) == {0, 1}
    assert offered_bounds((0,)) == set()
