"""Published large-model measurements reproduced by the cost model (no fitting: default efficiencies)."""

import dataclasses
import math

import pytest

from rpegjax.graph.ir import StageKind
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import pretraining
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.pretraining import Recompute
from rpegjax.perf.reference import published_runs
from rpegjax.perf.reference.published_runs import (
    DEFAULT_EFFICIENCIES,
    FIT_RUNS,
    FITTED_EFFICIENCIES,
    HELD_OUT_RUNS,
    KORTHIKANTI_2022,
    NEMO_RL_RUNS,
    selene,
)


@pytest.mark.parametrize("run", KORTHIKANTI_2022, ids=lambda run: run.name)
def test_megatron_iteration_times_within_20_percent(run):
    hardware = selene(run.devices)
    predicted = pretraining.iteration_seconds(run, hardware)["seconds"]
    assert predicted == pytest.approx(run.measured_seconds, rel=0.20)
    # the MFU formula gives the published utilisation back from the published time
    assert pretraining.model_flops_utilisation(run, run.measured_seconds, hardware) == pytest.approx(run.measured_mfu, abs=0.002)


def test_pipeline_bubble_and_recomputation_cost_time():
    run = KORTHIKANTI_2022[1]
    hardware = selene(run.devices)
    base = pretraining.iteration_seconds(run, hardware)
    assert base["schedule"] == pytest.approx((base["micro_batches"] + run.pipeline - 1) * base["per_micro_batch"])
    full = pretraining.iteration_seconds(dataclasses.replace(run, recompute=Recompute.FULL), hardware)
    assert full["seconds"] > base["seconds"]
    with pytest.raises(ValueError, match="do not split into 7 stages"):
        pretraining.iteration_seconds(dataclasses.replace(run, pipeline=7), hardware)


# ------------------------------------------------------------------------------------------ RL step times

HELD_OUT_BOUND = 0.25  # every held-out case within 25%


def test_fit_on_the_fit_runs_gives_the_recorded_constants():
    fitted = published_runs.fit_efficiencies(FIT_RUNS)
    assert fitted.matmul == pytest.approx(FITTED_EFFICIENCIES.matmul)
    assert fitted.decode_memory == pytest.approx(FITTED_EFFICIENCIES.decode_memory)
    assert set(FIT_RUNS).isdisjoint(HELD_OUT_RUNS) and len(FIT_RUNS) + len(HELD_OUT_RUNS) == len(NEMO_RL_RUNS)


@pytest.mark.parametrize("run", HELD_OUT_RUNS, ids=lambda run: run.name)
def test_held_out_step_times_within_bound(run):
    error = published_runs.relative_errors([run], FITTED_EFFICIENCIES)[run.name]
    assert abs(error) <= HELD_OUT_BOUND, f"{run.name}: predicted {100 * error:+.1f}% off the measured {run.measured_seconds} s"


# The published mixture-of-experts runs (NeMo-RL v0.6), held out (nothing fitted on them), each with the peer's own
# plan; the 8-step-off run's generation is continuous across steps (`published_runs.continuous_generation`). Three
# mechanisms of the peer's engines make the 235B one-step-off run fit the band (docs/benchmarks.md, "Published runs"):
# vLLM's memory fraction applies to the memory CUDA reports, vLLM's one-shot all-reduce inside a node, and Megatron's
# published MoE training efficiency (`published_runs.MEGATRON_MOE_RATIO`).
@pytest.mark.parametrize("run", published_runs.MOE_RUNS, ids=lambda run: run.name)
def test_held_out_moe_step_times_within_bound(run):
    assert run.shape.experts is not None and run not in FIT_RUNS
    error = published_runs.relative_errors([run], FITTED_EFFICIENCIES)[run.name]
    assert abs(error) <= HELD_OUT_BOUND, f"{run.name}: predicted {100 * error:+.1f}% off the measured {run.measured_seconds} s"


def test_vllm_memory_fraction_applies_to_the_memory_cuda_reports():
    """0.8 x 84.94 GB less the 235B's TP-8 weights leaves the KV cache room for all 32 of a replica's sequences at
    prompt + mean length; 0.8 x the datasheet's 80 GB held 18 (two decode waves to the cap)."""
    run = published_runs.MOE_RUNS[4]
    hw = published_runs.rl_evaluator(run, FITTED_EFFICIENCIES).inputs.hardware
    assert hw.device.reported_memory_bytes == 84_942_979_072 and hw.device.memory_bytes == 80e9
    generate = published_runs.predict_rl_run(run, FITTED_EFFICIENCIES).stage("generate").detail
    assert generate["slots"] == 32 and generate["decode_steps"] == run.response_max
    datasheet = dataclasses.replace(hw.device, cuda_memory_bytes=None)
    assert datasheet.reported_memory_bytes == 80e9


def test_moe_training_efficiency_is_megatrons_published_ratio():
    """Scaled from the published MFUs (Megatron Core's dense 47%; 200 TFLOP/s of 989 and 30% for the two MoE
    models), never fitted: the dense runs keep the fit, and a MoE run's passes take 1/ratio of the time at most."""
    assert published_runs.MEGATRON_MOE_RATIO["qwen3-30b-a3b"] == pytest.approx(200 / 989 / 0.47)
    assert published_runs.MEGATRON_MOE_RATIO["qwen3-235b-a22b"] == pytest.approx(0.30 / 0.47)
    assert all(run.train_efficiency_ratio == 1.0 for run in NEMO_RL_RUNS + published_runs.GB200_RUNS)
    run = published_runs.MOE_RUNS[0]
    scaled = published_runs.predict_rl_run(run, FITTED_EFFICIENCIES).stage_seconds()
    dense_rate = published_runs.predict_rl_run(dataclasses.replace(run, train_efficiency_ratio=1.0),
                                           FITTED_EFFICIENCIES).stage_seconds()
    for stage in ("actor_update", "ref_logprob"):
        assert dense_rate[stage] < scaled[stage] <= dense_rate[stage] / run.train_efficiency_ratio
    with pytest.raises(ValueError, match="train_efficiency_ratio"):
        dataclasses.replace(run, train_efficiency_ratio=0.0)


def test_moe_runs_use_the_peers_expert_layouts():
    on_policy = published_runs.rl_plan(published_runs.MOE_RUNS[0])
    assert dict(on_policy.train_layout) == {"data": 4, "pipeline": 1, "expert": 8, "tensor": 1}
    assert dict(on_policy.generation_layout)["tensor"] == 2
    large = published_runs.rl_plan(published_runs.MOE_RUNS[3])
    assert dict(large.train_layout) == {"data": 1, "pipeline": 8, "expert": 8, "context": 2, "tensor": 2}
    assert large.execution.sequence_parallel


def test_in_flight_weight_updates_plan_continuous_generation_with_the_peers_values():
    """NeMo RL's 8-step-off recipe (max_trajectory_age_steps 8, in-flight weight updates): 8 batches of groups in
    flight, a trained token lagging at most 8 versions, running requests keeping their KV caches; the one-step-off
    recipes keep one batch in flight, costed as a whole batch per step."""
    eight = published_runs.MOE_RUNS[2]
    assert eight.async_bound == 8 and eight.in_flight_weight_updates and published_runs.continuous_generation(eight)
    choice = published_runs.rl_plan(eight)
    execution = choice.execution
    assert choice.async_bound == 1 and execution.partial_rollouts
    assert (execution.inflight_batches, execution.max_token_lag, execution.partial_carry) == (8, 8, "pages")
    prediction = published_runs.predict_rl_run(eight, FITTED_EFFICIENCIES)
    generate = prediction.stage("generate").detail
    assert generate["inflight_batches"] == 8 and generate["reprefill_tokens"] == 0
    assert 0 < generate["carry_lag_max"] <= 8 and generate["carried_sequences"] > 0
    # the same plan decoding each step's batch to its longest response is the 2.6x over-prediction it replaces
    batch = dataclasses.replace(eight, in_flight_weight_updates=False)
    assert published_runs.predict_rl_run(batch, FITTED_EFFICIENCIES).step_seconds > 2 * prediction.step_seconds
    for run in (published_runs.MOE_RUNS[1], published_runs.MOE_RUNS[4]):
        assert run.in_flight_weight_updates and not published_runs.continuous_generation(run)
        assert not published_runs.rl_plan(run).execution.partial_rollouts
    with pytest.raises(ValueError, match="in-flight weight updates need asynchronous generation"):
        dataclasses.replace(published_runs.MOE_RUNS[0], in_flight_weight_updates=True)


def test_one_batch_in_flight_is_a_whole_batch_per_step_for_these_responses():
    """`continuous_generation`: at age 1 NeMo RL's next batch's groups enter the places finished groups free; with
    the modelled responses nearly every group of 32 holds one at the length cap, so every group lasts the cap's
    decode steps and no place frees before the whole batch ends (what whole-batch costing gives)."""
    for run in (published_runs.MOE_RUNS[1], published_runs.MOE_RUNS[4]):
        assert run.async_bound == 1 and not published_runs.continuous_generation(run)
        lengths = ResponseLengths.lognormal(run.response_mean, run.response_max).sample(4096)
        capped = float((lengths == run.response_max).mean())
        assert capped > 0.4 and (1 - capped) ** run.group_size < 1e-6


# NeMo-RL's dense GB200 rows (v0.5, GB200-NVL72; v0.6 publishes no dense rows), held out. One is not met.
_GB200_NOT_MET = {"NeMo-RL v0.5 GB200 Llama-3.1-8B on-policy": (
    "-34% (60 s vs 91.0 s): the H100-fitted efficiencies on GB200's peaks (2.5x H100's BF16, 2.4x its HBM bandwidth) "
    "give 2.9x H100's per-GPU throughput on this workload where the runs measured 2.0x (92.8 s on 16 H100); "
    "Qwen3-32B on the same GPUs is within 11%, and efficiencies fitted on the four GB200 rows alone leave this one "
    "at -20% (Qwen3-32B on-policy then +21%): not one efficiency pair")}


@pytest.mark.parametrize("run", [pytest.param(run, marks=pytest.mark.xfail(strict=True, reason=_GB200_NOT_MET[run.name]))
                                 if run.name in _GB200_NOT_MET else run for run in published_runs.GB200_RUNS],
                         ids=lambda run: run.name)
def test_held_out_gb200_step_times_within_bound(run):
    assert run.hardware == "gb200-nvl72" and run not in FIT_RUNS
    error = published_runs.relative_errors([run], FITTED_EFFICIENCIES)[run.name]
    assert abs(error) <= HELD_OUT_BOUND, f"{run.name}: predicted {100 * error:+.1f}% off the measured {run.measured_seconds} s"


def test_gb200_runs_use_their_recipes_plans():
    """grpo-llama3.1-8b-instruct-2n4g{,-async-1off} and grpo-qwen3-32b-{4n4g,8n4g-async-1off} (r0.5.0): TP1 PP1 and
    TP2 PP1 (sequence parallel) training, vLLM TP1, the one-step-off runs on half the GPUs each."""
    llama_on, llama_off, qwen_on, qwen_off = published_runs.GB200_RUNS
    assert dict(published_runs.rl_plan(llama_on).train_layout) == {"data": 8, "pipeline": 1, "tensor": 1}
    off = published_runs.rl_plan(llama_off)
    assert off.generation_devices == 4 and dict(off.train_layout)["data"] == 4 and off.async_bound == 1
    assert dict(published_runs.rl_plan(qwen_on).train_layout) == {"data": 8, "pipeline": 1, "tensor": 2}
    assert qwen_on.sequence_parallel and published_runs.rl_plan(qwen_on).execution.sequence_parallel
    off = published_runs.rl_plan(qwen_off)
    assert off.generation_devices == 16 and dict(off.generation_layout) == {"data": 16, "fsdp": 1, "tensor": 1}
    for run in published_runs.GB200_RUNS:
        hw = published_runs.rl_evaluator(run, FITTED_EFFICIENCIES).inputs.hardware
        assert hw.device.flops("bfloat16") == 2500e12 and hw.node_size == 72 and hw.num_devices == run.gpus


def test_fitting_improves_on_the_unfitted_assumptions():
    fitted = published_runs.relative_errors(HELD_OUT_RUNS, FITTED_EFFICIENCIES)
    unfitted = published_runs.relative_errors(HELD_OUT_RUNS, DEFAULT_EFFICIENCIES)
    assert max(map(abs, fitted.values())) < max(map(abs, unfitted.values()))


@pytest.mark.parametrize("run", NEMO_RL_RUNS[:4], ids=lambda run: run.name)
def test_each_run_is_predicted_with_its_own_plan(run):
    graph = planner.build_graph(published_runs.rl_plan(run))
    assert graph.num_devices == run.gpus and graph.async_bound == run.async_bound
    generate = graph.stages_of_kind(StageKind.GENERATE)[0]
    update = graph.stages_of_kind(StageKind.ACTOR_UPDATE)[0]
    assert graph.parallel_of(generate.name)["tensor"] == run.generation_tensor
    train = graph.parallel_of(update.name)
    assert (train["tensor"], train["pipeline"]) == (run.train_tensor, run.train_pipeline)
    assert math.prod(train.values()) == run.gpus - run.generation_gpus
    assert update.options["minibatches"] == run.optimizer_steps
    colocated = graph.placements[generate.placement] == graph.placements[update.placement]
    assert colocated == (run.generation_gpus == 0)


def test_asynchrony_overlaps_generation_with_training():
    on_policy, off_policy = NEMO_RL_RUNS[2], NEMO_RL_RUNS[3]  # Qwen3-32B: 32 colocated GPUs vs 32 + 32
    on = published_runs.predict_rl_run(on_policy, FITTED_EFFICIENCIES)
    off = published_runs.predict_rl_run(off_policy, FITTED_EFFICIENCIES)
    busy = off.stage_seconds()
    assert on.step_seconds == pytest.approx(sum(on.stage_seconds().values()), rel=0.02)  # colocated: stages add
    training = sum(t for name, t in busy.items() if name != "generate")
    assert off.step_seconds == pytest.approx(max(busy["generate"], training), rel=0.05)  # one-step off: they overlap


def test_memory_is_reported_not_enforced_for_published_runs():
    run = NEMO_RL_RUNS[0]  # the accounting keeps training state resident; NeMo RL offloads it to generate
    prediction = published_runs.predict_rl_run(run, FITTED_EFFICIENCIES)
    assert not prediction.fits and prediction.problems and math.isfinite(prediction.step_seconds)
    evaluator = published_runs.rl_evaluator(run, FITTED_EFFICIENCIES)
    enforced = evaluator.predict(planner.build_graph(published_runs.rl_plan(run)), with_trace=False)
    assert math.isinf(enforced.step_seconds)


def test_runs_reject_impossible_plans():
    with pytest.raises(ValueError, match="do not split into TP 4 x PP 3"):
        dataclasses.replace(NEMO_RL_RUNS[2], train_pipeline=3)
    with pytest.raises(ValueError, match="Efficiencies.matmul"):
        published_runs.Efficiencies(matmul=1.5, decode_memory=0.5)


def test_the_planner_presets_are_the_published_runs_models():
    """plan.py's llama3.1-8b and qwen3-32b (`ModelConfig.llama3`, `ModelConfig.qwen3`) have the shapes the runs are
    predicted with, and the model cards' parameter counts (Llama 3.1 8B: 8.03B; Qwen3-32B: 32.8B, 31.2B without
    embeddings)."""
    llama, qwen = ModelConfig.llama3("8b"), ModelConfig.qwen3("32b")
    assert ModelShape.from_config(llama) == published_runs.LLAMA31_8B
    assert ModelShape.from_config(qwen) == published_runs.QWEN3_32B
    assert llama.num_params() == pytest.approx(8.03e9, rel=0.005)
    assert qwen.num_params() == pytest.approx(32.8e9, rel=0.005)
    assert qwen.num_params(include_embeddings=False) == pytest.approx(31.2e9, rel=0.005)
    assert llama.rope_scaling is not None and qwen.qk_norm and not qwen.attention_bias
    for cfg in (llama, qwen):  # the config.json a user would give instead reads back as the same model
        read = ModelConfig.from_hf_dict(cfg.to_hf_dict())
        assert read.replace(attention=cfg.attention, remat=cfg.remat, scan_layers=cfg.scan_layers) == cfg
