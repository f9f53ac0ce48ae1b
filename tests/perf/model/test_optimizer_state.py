"""The performance model's optimiser state: split over the data replicas (ZeRO-1), offloaded to host memory while
generation runs (out of the generation phase's persistent set, its transfers in the update), and the planner's
search of offload. Figures are checked against the formulas written out here."""

import dataclasses

import numpy as np
import pytest

from rpegjax.graph import builders
from rpegjax.graph.ir import Execution
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import hardware, step_model
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.reference import presets

QWEN7 = ModelConfig.qwen2p5("7b")
WORKLOAD = Workload(prompts=32, group_size=8, prompt_tokens=512, responses=ResponseLengths.lognormal(1024, 4096))
BASE = Execution(attention="blockwise", remat="full", scan_layers=True, param_dtype="float32", dtype="bfloat16")


def predicted(execution: Execution, *, parallel=None, hw=None):
    graph = builders.grpo_graph(use_reference=False, num_devices=8, parallel=parallel or {"data": 2, "fsdp": 4})
    graph = dataclasses.replace(graph, execution=execution)
    evaluator = step_model.Evaluator.for_runtime(QWEN7, WORKLOAD, hw or presets.h100_node(8))
    return evaluator, graph, evaluator.predict(graph, with_trace=False)


def test_zero1_splits_the_moments_over_the_data_replicas():
    shape = ModelShape.from_config(QWEN7)
    evaluator, graph, _ = predicted(BASE)
    _, persistent, _ = evaluator.stage_costs(graph)
    _, zero1_persistent, _ = evaluator.stage_costs(
        dataclasses.replace(graph, execution=dataclasses.replace(BASE, optimizer_sharding="data")))
    weights = shape.params * 4 / 4  # float32 weights over fsdp=4
    moments = shape.params * 8 / 4  # two float32 moments, over fsdp=4 ...
    generation_copy = shape.params * 2  # the sampler's bfloat16 copy, split over tensor (1) only
    np.testing.assert_allclose(persistent.max(), weights + moments + generation_copy, rtol=1e-12)
    np.testing.assert_allclose(zero1_persistent.max(), weights + moments / 2 + generation_copy, rtol=1e-12)  # and data=2


def test_offload_moves_the_optimiser_state_out_of_generation_and_times_its_transfers():
    shape = ModelShape.from_config(QWEN7)
    _, _, plain = predicted(BASE)
    evaluator, graph, offloaded = predicted(dataclasses.replace(BASE, optimizer_offload=True))
    moments = shape.params * 8 / 4
    _, persistent, _ = evaluator.stage_costs(graph)
    generating = evaluator.generating_persistent(graph)
    np.testing.assert_allclose(persistent - generating, moments, rtol=1e-12)  # training still holds it
    # the update moves the moments in and out over PCIe (64 GB/s per direction per GPU on DGX H100)
    update = offloaded.stage("actor_update").seconds - plain.stage("actor_update").seconds
    np.testing.assert_allclose(update, 2 * moments / 64e9, rtol=1e-9)
    # generation sits beside less: its peak is lower, and its KV budget (so its slots) is no smaller
    assert offloaded.stage("generate").peak_memory_bytes < plain.stage("generate").peak_memory_bytes
    assert offloaded.stage("generate").detail["slots"] >= plain.stage("generate").detail["slots"]
    for kind in ("actor_update", "ref_logprob"):
        if graph.has_stage(kind):
            assert offloaded.stage(kind).peak_memory_bytes == pytest.approx(plain.stage(kind).peak_memory_bytes)


def test_offload_without_a_host_link_or_host_memory_is_a_problem():
    no_link = hardware.HardwareSpec(name="no-link", device=dataclasses.replace(presets.h100_node(8).device,
                                                                              host_bandwidth=0.0),
                                    num_devices=8, levels=presets.h100_node(8).levels)
    _, _, prediction = predicted(dataclasses.replace(BASE, optimizer_offload=True), hw=no_link)
    assert not prediction.fits and any("has no host link" in p for p in prediction.problems)
    small_host = dataclasses.replace(no_link, device=dataclasses.replace(no_link.device, host_bandwidth=64e9,
                                                                         host_memory_bytes=1e9))
    _, _, prediction = predicted(dataclasses.replace(BASE, optimizer_offload=True), hw=small_host)
    assert any("offloaded optimiser state needs" in p and "host memory" in p for p in prediction.problems)


def test_planner_offloads_colocated_plans_only_and_ranks_them_by_time():
    evaluator = step_model.Evaluator.for_runtime(QWEN7, WORKLOAD, presets.h100_node(8))
    space = planner.PlanSpace(async_bounds=(0,), fusion=(True,), microbatches=(1,), attention=("blockwise",),
                              remat=("full",), generation_fractions=(None, 0.5), tensor_sizes=(1, 2))
    search = planner.Planner(evaluator, algorithm="grpo", num_devices=8, use_reference=False, space=space)
    plans = search.brute_force(top=1000)
    offloaded = [p for p in plans if p.choice.execution.optimizer_offload]
    assert offloaded and all(p.choice.generation_devices == 0 for p in offloaded)
    assert any(p.choice.generation_devices for p in plans)  # disaggregated plans are there, never offloaded
    assert all(p.choice.execution.optimizer_sharding == "data" for p in plans)
    assert search.search(top=1).best.choice == plans[0].choice  # branch and bound still exact
