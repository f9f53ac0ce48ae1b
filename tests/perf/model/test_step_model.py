"""The performance model: decode simulation, stage costs, memory, timeline composition and plan round trips."""

import dataclasses
import json
import math

import numpy as np
import pytest

from rpegjax.graph import builders, transforms
from rpegjax.graph.ir import Execution, Graph
from rpegjax.graph.trace import Trace
from rpegjax.models import ModelConfig
from rpegjax.perf.model import generation_stage, step_model
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.generation_cost import (
    KERNEL_BLOCK_TOKENS,
    DecodeStepCost,
    ResponseLengths,
    simulate_decode,
)
from rpegjax.perf.model.stage_costs import (
    CostInputs,
    ExecutionOptions,
    Layout,
    Workload,
    model_pass_cost,
)
from rpegjax.perf.reference import presets

SMALL = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
QWEN05 = ModelConfig.qwen2p5("0.5b")


def _naive_decode(lengths, slots, prompt, cost: DecodeStepCost, kernel: str, capacity: int):
    """A step-by-step reference with explicit slots (continuous batching)."""
    queue, active, elapsed, finish = list(enumerate(lengths)), [], 0.0, {}
    heap_free = slots
    while queue or active:
        step_prefill = 0.0
        while queue and heap_free:
            index, length = queue.pop(0)
            active.append([index, length, 0])
            heap_free -= 1
            step_prefill += cost.prefill_seconds
        if kernel == "paged":
            rows, keys = len(active), sum(prompt + done + 1 for _, _, done in active)
        elif kernel == "live":  # the running rows padded to a power of two, each over the longest's window
            rows = min(min(slots, len(lengths)), 2 ** math.ceil(math.log2(len(active))))
            keys = rows * min(capacity, 2 ** math.ceil(math.log2(max(prompt + done + 1 for _, _, done in active))))
        else:
            rows = min(slots, len(lengths))
            keys = rows * capacity
        compute = cost.seconds_per_row * rows + cost.seconds_per_key * keys
        memory = cost.memory_seconds_fixed + cost.memory_seconds_per_row * rows + cost.memory_seconds_per_key * keys
        memory += cost.expert_memory_seconds * (1 - cost.expert_miss**rows)  # the experts this step's rows hit
        elapsed += max(compute, memory) + cost.fixed_seconds + cost.comm_seconds_per_row * rows + step_prefill
        for entry in active:
            entry[2] += 1
        for entry in [e for e in active if e[2] == e[1]]:
            finish[entry[0]] = elapsed
            active.remove(entry)
            heap_free += 1
    return elapsed, [finish[i] for i in range(len(lengths))]


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
@pytest.mark.parametrize("kernel", ["paged", "static", "live"])
def test_decode_simulation_matches_a_step_by_step_reference(kernel, experts):
    cost = DecodeStepCost(seconds_per_row=1e-4, seconds_per_key=2e-7, memory_seconds_fixed=3e-3,
                          memory_seconds_per_row=1e-5, memory_seconds_per_key=1e-6, fixed_seconds=1e-4, prefill_seconds=5e-3,
                          comm_seconds_per_row=3e-5)
    if experts:  # a MoE model's expert weights, read by the share of experts each step's rows pick
        cost = dataclasses.replace(cost, expert_memory_seconds=2e-2, expert_miss=(1 - 8 / 128) ** 2)
    lengths = np.array([5, 17, 3, 9, 12, 1, 30, 8, 8, 2])
    seconds, finish = _naive_decode(list(lengths), 3, 7, cost, kernel, capacity=37)
    timeline = simulate_decode(lengths, slots=3, prompt=7, capacity=37, kernel=kernel, continuous=True, cost=cost)
    assert timeline.seconds == pytest.approx(seconds, rel=1e-9)
    assert np.allclose(timeline.finish_seconds, finish, rtol=1e-9)


def test_lognormal_lengths_have_the_mean_and_a_clipped_tail():
    lengths = ResponseLengths.lognormal(4096, 16384).sample(4096)
    assert lengths.mean() == pytest.approx(4096, rel=1e-3)
    assert lengths.max() == 16384 and np.all(np.diff(lengths) >= 0)
    assert np.median(lengths) < 4096  # long right tail
    assert np.all(ResponseLengths.fixed(64).sample(5) == 64)
    with pytest.raises(ValueError, match="ResponseLengths.mean"):
        ResponseLengths.lognormal(20000, 16384)


def _inputs(hw=None, options=None, workload=SMALL):
    shape = ModelShape.from_config(QWEN05)
    return CostInputs(hardware=hw or presets.h100_node(8), actor=shape, critic=shape, workload=workload,
                      options=options or ExecutionOptions())


def test_kv_capacity_caps_concurrency_and_the_long_tail_costs_time():
    from rpegjax.perf.model.generation_stage import decode_transient_bytes, generation_cost, kv_bytes_per_slot

    inputs = _inputs()
    layout = Layout.from_parallel({"data": 1, "tensor": 1}, where="test")
    per_slot = kv_bytes_per_slot(inputs, layout) + decode_transient_bytes(inputs, 1)  # its KV and its logits
    small = generation_cost(inputs, layout, kv_budget_bytes=10.5 * per_slot)
    large = generation_cost(inputs, layout, kv_budget_bytes=1e12)
    assert small.detail["slots"] == 10 and large.detail["slots"] == SMALL.sequences
    assert small.seconds > large.seconds
    with pytest.raises(MemoryError, match="KV cache of one sequence"):
        generation_cost(inputs, layout, kv_budget_bytes=0.5 * per_slot)
    fixed = dataclasses.replace(SMALL, responses=ResponseLengths.fixed(512))
    tail = generation_cost(inputs, layout, kv_budget_bytes=1e12)
    flat = generation_cost(_inputs(workload=fixed), layout, kv_budget_bytes=1e12)
    assert tail.seconds > 2 * flat.seconds  # same mean length; the tail decodes alone for most of its steps


def test_the_generation_peak_covers_the_carried_sequences_prefill():
    """W-plan 7B's best partial plan (gen d64xt4, 64 slots per replica, the pool of its plan): carried sequences are
    prefilled one row per slot over windows up to the capacity, so the generation peak is the pool plus that
    prefill's float32 scores, gathered keys and values, MLP activations and logits (a hand count below), not the
    decode chunk's logits. The GPU compiler's peaks of the same plan's generation programs (`scripts/plan.py
    --verify --verify-target cuda-gh200`, docs/benchmarks.md, "W-plan") are covered, the largest within 15%."""
    from rpegjax.perf.model.generation_stage import (
        decode_working_bytes,
        generation_memory,
        kv_bytes_per_token,
        prefill_working_bytes,
    )

    shape = ModelShape.from_config(ModelConfig.qwen2p5("7b"))
    layout = Layout.from_parallel({"data": 64, "tensor": 4}, where="test")
    options = dict(kv_pool=True, decode_slots=4096, kv_pool_tokens=3_342_336)
    partial, whole = (CostInputs(hardware=presets.preset("gh200", 256), actor=shape, critic=shape,
                                 workload=Workload.w_plan(),
                                 options=ExecutionOptions(**options, partial_rollouts=on, inflight_batches=3))
                      for on in (True, False))
    capacity, b = 1024 + 16384, 2  # bfloat16
    # the scores twice in the compute dtype and the gathered window, or the MLP's activations if larger; the logits
    per_row = (max(2 * 28 / 4 * 256 * capacity * b + 2 * 1 * capacity * 128 * b, 2 * 256 * 18944 / 4 * b)
               + 2 * 152064 * 4)
    assert prefill_working_bytes(partial, layout, 64) == pytest.approx(64 * per_row)
    # without carried sequences: one row per group (8 for 64 slots) over the prompt's 1,024 tokens
    groups = 8 * (max(2 * 28 / 4 * 256 * 1024 * b + 2 * 1 * 1024 * 128 * b, 2 * 256 * 18944 / 4 * b)
                  + 2 * 152064 * 4)
    assert prefill_working_bytes(whole, layout, 64) == pytest.approx(groups)
    slots, memory = generation_memory(partial, layout, 1e12)
    pool = 3_342_336 * kv_bytes_per_token(shape, layout)
    assert slots == 64 and memory == pytest.approx(pool + 64 * per_row)
    assert memory > pool + decode_working_bytes(partial, layout, 64)
    # the stage's peak: + the generation copy of the weights (bfloat16 over tensor 4) + the 2.26 GB of training state
    # the dry run counts beside it
    peak = memory + shape.weight_bytes / 4 + 2.26e9
    compiled = {"prefill (carried sequences)": 62.61e9, "decode": 54.07e9, "start (carried sequences)": 50.24e9}
    assert max(compiled.values()) <= peak <= 1.15 * max(compiled.values())


def test_a_float32_carried_prefill_holds_its_scores_twice():
    """The README's Qwen2.5-0.5B float32 plan on 8 H100 (gen d4xt2, 384 slots per replica, partial rollouts, prompt
    256 + up to 2,048 new tokens): the GPU compiler's carried-sequence prefill holds the float32 scores
    [384, 2304, 7 x 256] twice (the dot's output and a transposed copy, 6.34 GB each; 13.41 GB of temporaries in
    all: `XLA_FLAGS=--xla_dump_to=... plan.py ... --verify --verify-target cuda-h100` of the README's
    0.5B plan). Counting them once at 4 bytes gave 9.2 GB (-31%)."""
    from rpegjax.perf.model.generation_cost import ResponseLengths
    from rpegjax.perf.model.generation_stage import prefill_working_bytes

    shape = dataclasses.replace(ModelShape.from_config(ModelConfig.qwen2p5("0.5b")), param_dtype="float32",
                                compute_dtype="float32")
    workload = Workload(prompts=64, group_size=8, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
    inputs = CostInputs(hardware=presets.preset("h100", 8), actor=shape, critic=shape, workload=workload,
                        options=ExecutionOptions(kv_pool=True, partial_rollouts=True, inflight_batches=3))
    layout = Layout.from_parallel({"data": 4, "tensor": 2}, where="test")
    scores = 384 * 2 * (14 / 2 * 256 * 2304 * 4)
    assert scores < prefill_working_bytes(inputs, layout, 384) == pytest.approx(13.41e9, rel=0.03)


def test_a_paged_pool_admits_more_sequences_than_a_contiguous_cache_and_fewer_slots_decode_longer():
    from rpegjax.perf.model.generation_stage import (
        generation_cost,
        generation_memory,
        kv_bytes_per_token,
        pool_tokens_per_slot,
    )

    layout = Layout.from_parallel({"data": 1, "tensor": 1}, where="test")
    contiguous = _inputs(options=ExecutionOptions(decode="static"))  # rpegjax's contiguous cache: capacity a slot
    paged = _inputs(options=ExecutionOptions(decode="static", kv_pool=True))
    per_token = kv_bytes_per_token(contiguous.actor, layout)
    # 16 sequences at capacity (the pool's budget also keeps every admissible slot's decode working set: logits
    # and a float32 window of one layer's values, ~8% of a slot at capacity here)
    budget = 16 * (SMALL.prompt_tokens + SMALL.responses.max) * per_token
    slots_contiguous, _ = generation_memory(contiguous, layout, budget)
    slots_paged, memory = generation_memory(paged, layout, budget)
    # the pool admits what its time-averaged footprint allows: prompt + E[L²] / 2E[L] tokens a slot
    lengths = SMALL.responses.sample(4096).astype(float)
    assert pool_tokens_per_slot(SMALL) == pytest.approx(SMALL.prompt_tokens + (lengths**2).mean() / (2 * lengths.mean()))
    assert slots_contiguous < 16 and slots_paged > 16 and memory <= budget
    # pinned slots and pool: the plan's own, whatever the budget (the runtime runs what the plan says)
    pinned = _inputs(options=ExecutionOptions(kv_pool=True, decode_slots=4, kv_pool_tokens=10_000))
    slots, memory = generation_memory(pinned, layout, 1e12)
    # beside the pool: the larger of the decode chunk's logits and the prefill of one group's 256-token prompt (the
    # larger of its scores, twice, with keys and values, and its MLP activations; and its logits: larger here)
    prefill = max(2 * 14 * 256 * 256 * 2 + 2 * 2 * 256 * 64 * 2, 2 * 256 * 4864 * 2) + 2 * pinned.actor.vocab * 4
    assert prefill > 4 * pinned.actor.vocab * 8
    assert slots == 4 and memory == pytest.approx(10_000 * per_token + prefill)
    with pytest.raises(MemoryError, match="KV cache of one sequence"):  # a pool that cannot hold one sequence
        generation_memory(_inputs(options=ExecutionOptions(kv_pool=True, decode_slots=4, kv_pool_tokens=100)), layout, 1e12)
    # fewer concurrent sequences decode for more steps
    few = generation_cost(_inputs(options=ExecutionOptions(decode_slots=4)), layout, kv_budget_bytes=1e12)
    many = generation_cost(_inputs(options=ExecutionOptions(decode_slots=32)), layout, kv_budget_bytes=1e12)
    assert few.detail["decode_steps"] > many.detail["decode_steps"] and few.seconds > many.seconds


def test_inference_row_micro_batches_cut_memory_and_add_passes_as_the_runtime_splits_rows():
    from rpegjax.learners.inference import InferenceMicroBatching
    from rpegjax.perf.model.stage_costs import row_micro_batches

    for rows, limit, shards in [(64, 16, 8), (64, 24, 8), (48, 20, 4), (12, 5, 1), (64, 64, 8), (64, 8, 3)]:
        expected = InferenceMicroBatching(rows=limit).micro_batches(rows, 10, QWEN05, logprob_chunk=8,
                                                                    shards=shards if rows % shards == 0 else 1)
        assert row_micro_batches(rows, limit, shards=shards) == expected
    layout = Layout.from_parallel({"data": 8}, where="t")
    runtime = lambda rows: ExecutionOptions(update_microbatches=1, inference_rows=rows)  # noqa: E731
    whole, half, split = (model_pass_cost(_inputs(options=runtime(rows)), _inputs().actor, layout, logits=True,
                                          backward=False) for rows in (None, 32, 16))
    assert split.detail["passes"] == 4 and half.detail["passes"] == 2 and whole.detail["passes"] == 1
    # a micro-batch loop holds the same weight copies whatever its rows (stage_costs._forward_transient_bytes); the
    # rows' activations shrink with them
    assert split.transient_bytes < half.transient_bytes and split.seconds > whole.seconds


def test_the_generation_copy_is_counted_in_the_compute_dtype_it_is_cast_to():
    graph = builders.grpo_graph(use_reference=False, num_devices=8, parallel={"data": 8})
    evaluator = step_model.Evaluator.for_runtime(QWEN05, SMALL, presets.h100_node(8))
    graph = dataclasses.replace(graph, execution=Execution(param_dtype="float32", dtype="bfloat16"))
    copy = next(r for r in step_model.resident_state(graph, evaluator.inputs_for(graph)) if r.what == "generation weights")
    assert copy.bytes_per_device == ModelShape.from_config(QWEN05).params * 2  # bfloat16, not the float32 masters


def test_more_devices_never_slow_a_compute_stage_and_fsdp_cuts_memory():
    inputs = _inputs(presets.h100_node(64))
    shape = inputs.actor
    times = [model_pass_cost(inputs, shape, Layout.from_parallel({"data": n}, where="t"), logits=True, backward=True,
                             optimizer_steps=1).seconds for n in (1, 2, 4, 8, 16, 64)]
    assert all(later <= earlier for earlier, later in zip(times, times[1:]))
    forward = [model_pass_cost(inputs, shape, Layout.from_parallel({"data": n // t, "tensor": t}, where="t"),
                               logits=True, backward=False).seconds for n, t in ((8, 1), (16, 2), (32, 4))]
    assert all(later <= earlier for earlier, later in zip(forward, forward[1:]))
    graph = builders.grpo_graph(use_reference=True, num_devices=8)
    memory = []
    for fsdp in (1, 2, 8):
        sharded = transforms.place(graph, "actor_update", "all", {"data": 8 // fsdp, "fsdp": fsdp})
        residents = step_model.resident_state(sharded, inputs)
        memory.append(sum(r.bytes_per_device for r in residents if "actor" in r.what and "generation" not in r.what))
    assert memory[0] > memory[1] > memory[2] and memory[0] == pytest.approx(8 * memory[2])


def test_colocated_stages_add_and_disaggregated_async_stages_overlap():
    hw = presets.h100_node(8)
    evaluator = step_model.Evaluator(QWEN05, SMALL, hw)
    colocated = builders.grpo_graph(use_reference=True, num_devices=8)
    prediction = evaluator.predict(colocated)
    device_total = sum(s.seconds for s in prediction.stages if s.kind != "reward")
    assert prediction.step_seconds == pytest.approx(device_total, rel=1e-9)
    split = colocated
    split = transforms.place(split, "generate", "rollout", {"data": 4}, devices=range(4))
    for name in ("ref_logprob", "old_logprob", "advantage", "actor_update", "weight_sync"):
        split = transforms.place(split, name, "train", {"data": 4}, devices=range(4, 8))
    synchronous = evaluator.predict(split)
    asynchronous = evaluator.predict(transforms.bounded_async(split, 1))
    generate = synchronous.stage("generate").seconds
    train = sum(synchronous.stage(n).seconds for n in ("ref_logprob", "old_logprob", "advantage", "actor_update"))
    sync_seconds = synchronous.stage("weight_sync").seconds
    assert synchronous.step_seconds == pytest.approx(generate + train + sync_seconds, rel=1e-6)
    assert asynchronous.step_seconds == pytest.approx(max(generate, train) + sync_seconds, rel=0.02)
    assert asynchronous.step_seconds < synchronous.step_seconds
    versions = {(e.step, e.version) for e in asynchronous.trace.events if e.stage == "generate"}
    assert all(step - version <= 1 for step, version in versions)  # staleness never above k = 1


def test_predicted_trace_is_a_chrome_trace_of_predicted_events(tmp_path):
    prediction = step_model.predict(builders.grpo_graph(use_reference=False, num_devices=8), QWEN05, SMALL,
                                   presets.h100_node(8))
    assert prediction.trace is not None and all(e.predicted for e in prediction.trace.events)
    path = tmp_path / "predicted.json"
    prediction.trace.to_chrome_json(path)
    document = json.loads(path.read_text())
    assert any(e["ph"] == "X" for e in document["traceEvents"])
    assert len(Trace.from_chrome_json(path).events) == len(prediction.trace.events)
    assert json.loads(json.dumps(prediction.to_dict()))["step_seconds"] == pytest.approx(prediction.step_seconds)


def test_plan_survives_json_round_trip_with_the_same_prediction():
    graph = transforms.default_fusion(transforms.bounded_async(
        builders.ppo_graph(use_reference=True, num_devices=8, parallel={"data": 2, "fsdp": 2, "tensor": 2}), 1))
    graph = transforms.place(graph, "generate", "all", {"data": 4, "tensor": 2})
    again = Graph.from_json(graph.to_json())
    assert again == graph
    evaluator = step_model.Evaluator(QWEN05, SMALL, presets.h100_node(8))
    assert evaluator.predict(again).step_seconds == evaluator.predict(graph).step_seconds


def test_a_plan_that_exceeds_memory_is_reported_not_timed():
    small_memory = presets.h100_node(8)
    small_memory = dataclasses.replace(small_memory, device=dataclasses.replace(small_memory.device, memory_bytes=16e9))
    graph = builders.ppo_graph(use_reference=True, num_devices=8)  # every model replicated on every device
    prediction = step_model.predict(graph, ModelConfig.qwen2p5("1.5b"), SMALL, small_memory)
    assert not prediction.fits and prediction.step_seconds == float("inf")
    assert any("device 0" in p or "stage" in p for p in prediction.problems)
    sharded = step_model.predict(builders.ppo_graph(use_reference=True, num_devices=8, parallel={"fsdp": 8}),
                                ModelConfig.qwen2p5("1.5b"), SMALL, small_memory)
    assert sharded.fits and sharded.peak_memory_bytes <= small_memory.usable_memory_bytes


def test_unknown_parallel_axes_are_refused():
    graph = builders.grpo_graph(use_reference=False, num_devices=8, parallel={"stage": 2, "data": 4})
    with pytest.raises(ValueError, match="knows parallel axes"):
        step_model.predict(graph, QWEN05, SMALL, presets.h100_node(8))
    # pipeline stages are modelled for training passes only (published Megatron runs), never for generation
    graph = builders.grpo_graph(use_reference=False, num_devices=8, parallel={"pipeline": 2, "data": 4})
    with pytest.raises(ValueError, match="generation with pipeline parallelism"):
        step_model.predict(graph, QWEN05, SMALL, presets.h100_node(8))


def test_pipeline_stages_split_the_work_and_add_a_bubble():
    """p stages run L/p layers each: per-device work as p-way sharding, times (m + p − 1)/m for m micro-batches."""
    from rpegjax.perf.model import stage_costs
    from rpegjax.perf.model.stage_costs import CostInputs, ExecutionOptions, Layout

    shape = ModelShape.from_config(QWEN05)
    hw = presets.h100_node(8)

    def update(layout, microbatch_tokens):
        options = ExecutionOptions(microbatch_tokens=microbatch_tokens, overlap_collectives=True)
        inputs = CostInputs(hardware=hw, actor=shape, critic=shape, workload=SMALL, options=options)
        return stage_costs.model_pass_cost(inputs, shape, layout, logits=True, backward=True, optimizer_steps=1)

    one = Layout.from_parallel({"data": 2}, where="test")
    staged = Layout.from_parallel({"data": 2, "pipeline": 4}, where="test")
    assert staged.shards == 4 and staged.size == 8 and staged.replicas == 2
    tokens = stage_costs.batch_tokens(CostInputs(hardware=hw, actor=shape, critic=shape, workload=SMALL,
                                                 options=ExecutionOptions()))[0]
    few = tokens / 2 / 2  # 2 micro-batches per replica: a (2 + 3)/2 bubble
    ratio_few = update(staged, math.ceil(few)).detail["matmul"] / update(one, math.ceil(few)).detail["matmul"]
    assert ratio_few == pytest.approx(1 / 4)  # the matmul FLOPs split over the 4 stages
    bubble = lambda m: (m + 3) / m
    slow = update(staged, math.ceil(few))
    assert slow.seconds / (slow.detail["matmul"] + slow.memory_seconds - slow.detail["optimizer"]) > bubble(2) * 0.99


def test_colocated_weight_sync_costs_a_copy_of_the_weights():
    """Same devices and layout: the runtime still copies (the update donates the training buffers)."""
    hw = presets.h100_node(8)
    graph = builders.grpo_graph(use_reference=True, num_devices=8)
    sync = step_model.Evaluator(QWEN05, SMALL, hw).predict(graph).stage("weight_sync").seconds
    copy = 2 * ModelShape.from_config(QWEN05).weight_bytes / (hw.device.memory_bandwidth * hw.device.memory_efficiency)
    assert sync == pytest.approx(copy + hw.device.dispatch_overhead_s, rel=1e-6)


@pytest.mark.parametrize("stage, inference_rows, compiled_gb", [
    ("old_logprob", 512, 18.64), ("old_logprob", 1024, 33.49), ("actor_update", 1024, 46.31)])
def test_programs_at_real_shapes_are_within_15_percent_of_xlas_gpu_compiler(stage, inference_rows, compiled_gb):
    """XLA's GPU compiler's figures (arguments + outputs + temporaries - aliases, per device; compile-only H100s,
    `scripts/plan.py ... --verify --verify-target cuda-h100`) for the planner's best
    7B plan on 16 H100 (512 x 8, responses up to 4096 after a 1024-token prompt; fsdp=16, float32 weights,
    bfloat16 compute, blockwise attention, remat dots, 128 update micro-batches): its old log-prob pass in row
    micro-batches of 512 and 1024 rows (compiled with the output matrix gathered as its bfloat16 cast; 19.39
    and 34.24 GB with the float32 gather), and its update. The program's
    arguments are the weights (inference) or the training state (update); the model's transient is the rest."""
    execution = Execution(attention="blockwise", remat="dots", scan_layers=True, param_dtype="float32", dtype="bfloat16",
                          inference_rows=inference_rows, update_microbatches=128)
    graph = dataclasses.replace(builders.grpo_graph(use_reference=False, num_devices=16, parallel={"fsdp": 16}),
                                execution=execution)
    workload = Workload(prompts=512, group_size=8, prompt_tokens=1024, responses=ResponseLengths.fixed(4096))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), workload, presets.h100_node(16))
    costs, _, _ = evaluator.stage_costs(graph)
    weights = evaluator.inputs_for(graph).actor.weight_bytes / 16
    arguments = 3 * weights if stage == "actor_update" else weights  # float32 weights (+ two AdamW moments)
    program = costs[stage].transient_bytes + arguments
    assert abs(program / (compiled_gb * 1e9) - 1) <= 0.15, program / 1e9


def test_live_buckets_follow_the_running_sequences_on_a_long_tail():
    """Static batching of a long tail: after the short rows end, LIVE decodes the few running rows (padded to a power
    of two, never fewer than run), STATIC every slot; both take the same steps."""
    cost = DecodeStepCost(seconds_per_row=1e-4, seconds_per_key=2e-7, memory_seconds_fixed=3e-3,
                          memory_seconds_per_row=1e-5, memory_seconds_per_key=1e-6, fixed_seconds=1e-4, prefill_seconds=0.0)
    lengths = ResponseLengths.lognormal(64, 512).sample(32)
    kwargs = dict(slots=16, prompt=16, capacity=528, continuous=False, cost=cost)
    static, live = (simulate_decode(lengths, kernel=kernel, **kwargs) for kernel in ("static", "live"))
    assert static.steps == live.steps and static.mean_active == live.mean_active
    assert static.mean_rows == 16 and live.mean_active <= live.mean_rows < 2 * live.mean_active
    assert live.seconds < 0.5 * static.seconds


def test_the_paged_kernel_reads_each_live_rows_own_keys():
    """LIVE_PAGED (the Pallas paged decode): LIVE's padded rows, but the keys of a step are the active rows' own
    lengths (each rounded up to the kernel's block: half a block on average), not rows x the longest one's window."""
    cost = DecodeStepCost(seconds_per_row=0.0, seconds_per_key=0.0, memory_seconds_fixed=0.0, memory_seconds_per_row=0.0,
                          memory_seconds_per_key=1.0, fixed_seconds=0.0, prefill_seconds=0.0)
    lengths = np.array([3, 1, 10, 2])
    kwargs = dict(slots=4, prompt=5, capacity=64, continuous=False, cost=cost)
    paged, live = (simulate_decode(lengths, kernel=kernel, **kwargs) for kernel in ("live-paged", "live"))
    # step s: every row still running (length > s) attends to its prompt and the s + 1 tokens so far
    expected = sum(int((lengths > s).sum()) * (5 + s + 1 + KERNEL_BLOCK_TOKENS / 2) for s in range(10))
    assert paged.seconds == pytest.approx(expected)
    assert (paged.steps, paged.mean_rows) == (live.steps, live.mean_rows)  # the same padded buckets run
    own = sum(int((lengths > s).sum()) * (5 + s + 1) for s in range(10))  # the running rows' own keys
    assert paged.mean_live_keys * paged.steps == live.mean_live_keys * live.steps == pytest.approx(own)
    assert paged.mean_keys * paged.steps == pytest.approx(expected) and live.mean_keys * live.steps == pytest.approx(live.seconds)
    # LIVE: the running rows (4, 3, 2, then 1) padded to a power of two, each over the longest one's window (the
    # power of two at least 5 + s + 1, at most 64)
    rows = [4, 4, 2] + [1] * 7
    assert live.seconds == pytest.approx(sum(r * min(64, 2 ** math.ceil(math.log2(6 + s))) for s, r in enumerate(rows)))


def test_the_runtime_with_the_pallas_decode_is_costed_per_row():
    """A plan with `decode_attention=pallas` is costed as LIVE_PAGED: on a long tail its generation is faster than
    the gathered decode's, with the same slots, and its working set holds no window (7B, 512 sequences of a 4k
    mean and 16k max response on 8 replicas: the KV reads dominate the step)."""
    graph = builders.grpo_graph(use_reference=False, num_devices=8, parallel={"fsdp": 8})
    workload = Workload(prompts=64, group_size=8, prompt_tokens=1024, responses=ResponseLengths.lognormal(4096, 16384))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), workload, presets.h100_node(8))
    generate, working = {}, {}
    for attention in ("gather", "pallas"):
        execution = Execution(attention="blockwise", scan_layers=True, dtype="bfloat16", kv_cache="paged",
                              decode_attention=attention, decode_slots=512)
        planned = dataclasses.replace(graph, execution=execution)
        inputs = evaluator.inputs_for(planned)
        assert inputs.options.decode == {"gather": "live", "pallas": "live-paged"}[attention]
        generate[attention] = evaluator.predict(planned, enforce_memory=False, with_trace=False).stage("generate")
        working[attention] = generation_stage.decode_working_bytes(inputs, Layout(fsdp=8), 64)
    assert generate["pallas"].seconds < 0.95 * generate["gather"].seconds
    # gather: 64 rows' float32 values over a 17k window (2.3 GB); the kernel: its 16 partial outputs per row
    assert working["gather"] - working["pallas"] > 2e9


def test_remembered_stage_costs_are_those_of_each_plans_own_execution():
    """The evaluator remembers stage costs across graphs by what each reads of the execution: after a padded plan,
    its packed and sequence-parallel variants are predicted as a fresh evaluator predicts them (packing changes
    the inference passes too, not only the update)."""
    graph = builders.grpo_graph(use_reference=True, num_devices=8, parallel={"fsdp": 4, "tensor": 2})
    base = Execution(attention="blockwise", remat="full", scan_layers=True, param_dtype="float32", dtype="bfloat16")
    variants = [dataclasses.replace(base, update_microbatches=4),
                dataclasses.replace(base, packing=True, max_tokens_per_micro_batch=4096),
                dataclasses.replace(base, update_microbatches=4, sequence_parallel=True)]
    shared = step_model.Evaluator.for_runtime(QWEN05, SMALL, presets.h100_node(8))
    seconds = []
    for execution in variants:
        planned = dataclasses.replace(graph, execution=execution)
        fresh = step_model.Evaluator.for_runtime(QWEN05, SMALL, presets.h100_node(8)).predict(planned, with_trace=False)
        remembered = shared.predict(planned, with_trace=False)
        assert remembered.stage_seconds() == fresh.stage_seconds()
        assert [s.peak_memory_bytes for s in remembered.stages] == [s.peak_memory_bytes for s in fresh.stages]
        seconds.append((fresh.stage("ref_logprob").seconds, fresh.stage("ref_logprob").peak_memory_bytes))
    assert seconds[0] != seconds[1]  # packed rows cost the reference pass less than padded ones


def test_the_perf_models_pallas_kernel_blocks_are_the_runtimes():
    """The perf model may not import the sampler (tests/test_layout.py), so it restates the Pallas paged kernel's
    blocks; they must be the ones `rpegjax.models.paged_attention` runs (at the default 16-token page)."""
    from rpegjax.models import paged_attention
    from rpegjax.perf.model import generation_cost, generation_stage

    assert generation_stage.KERNEL_SPLITS == paged_attention.K_SPLITS
    assert generation_stage.KERNEL_HEAD_BLOCK == paged_attention.BLOCK_H
    assert generation_cost.KERNEL_BLOCK_TOKENS == paged_attention.PAGES_PER_BLOCK * 16


# one valid change of each update-only field
UPDATE_ONLY_CHANGES = [dict(remat="full"), dict(update_microbatches=4), dict(optimizer_sharding="data"),
                       dict(optimizer_offload=True)]


def _sentinel(execution: Execution, name: str) -> Execution:
    """`execution` with field `name` replaced by a value no other execution has (validation bypassed: the key only
    reads the fields)."""
    changed = dataclasses.replace(execution)
    object.__setattr__(changed, name, object())
    return changed


def test_a_non_update_stages_cost_key_holds_every_execution_field_but_the_update_only_ones():
    graph = builders.ppo_graph(use_reference=True, num_devices=8, parallel={"data": 2, "fsdp": 2, "tensor": 2})
    names = {f.name for f in dataclasses.fields(Execution)}
    assert step_model.UPDATE_ONLY_FIELDS < names
    assert {name for change in UPDATE_ONLY_CHANGES for name in change} == step_model.UPDATE_ONLY_FIELDS
    base = Execution()
    for stage in graph.stages:
        if stage.host:
            continue
        for name in names:
            changed = step_model._execution_key(stage, _sentinel(base, name)) != step_model._execution_key(stage, base)
            updates = bool(set(stage.kinds) & {"actor_update", "critic_update"})
            assert changed == (updates or name not in step_model.UPDATE_ONLY_FIELDS), (stage.name, name)


@pytest.mark.parametrize("change", UPDATE_ONLY_CHANGES, ids=lambda change: next(iter(change)))
def test_update_only_execution_fields_change_no_other_stages_cost(change):
    """What the cost key leaves out of a non-update stage's key is not read by its cost: beside the same
    persistent bytes, generation, log-prob, value, advantage and weight-sync costs (seconds, memory) are those of
    the base execution, while the updates or the persistent state do change."""
    assert set(change) <= step_model.UPDATE_ONLY_FIELDS
    graph = builders.ppo_graph(use_reference=True, num_devices=8, parallel={"data": 2, "fsdp": 2, "tensor": 2})
    base = Execution(attention="blockwise", scan_layers=True, dtype="bfloat16", kv_cache="paged", decode_slots=64)
    evaluator = step_model.Evaluator.for_runtime(QWEN05, SMALL, presets.gh200_nvl32(8))
    beside = np.full(8, 20e9)
    costs, persistent = {}, {}
    for execution in (base, dataclasses.replace(base, **change)):
        planned = dataclasses.replace(graph, execution=execution)
        inputs = evaluator.inputs_for(planned)
        costs[execution] = {s.name: step_model.stage_cost(planned, s, inputs, beside) for s in planned.stages}
        persistent[execution] = evaluator.stage_costs(planned)[1]
    before, after = costs.values()
    updates = {"actor_update", "critic_update"}
    for name in before.keys() - updates:
        assert after[name] == before[name], name
    assert any(after[name] != before[name] for name in updates) or not np.array_equal(*persistent.values())


@pytest.mark.parametrize("kernel", ["live-paged", "paged"])
def test_decode_tensor_all_reduces_carry_the_processed_rows_not_every_slot(kernel):
    """Tensor-parallel decode all-reduces the activations of the rows a step processes (a live bucket, or a serving
    engine's running batch), twice per layer: the ring formula's latency every step and its bytes per row
    (Qwen2.5-0.5B on one replica of 4 H100s over NVLink: 450 GB/s, 2 µs a hop)."""
    from rpegjax.perf.model.generation_stage import generation_cost

    inputs = _inputs(options=ExecutionOptions(decode=kernel))
    shape = inputs.actor
    layout = Layout.from_parallel({"data": 1, "tensor": 4}, where="test")
    cost = generation_cost(inputs, layout, kv_budget_bytes=1e12)
    steps, rows = cost.detail["decode_steps"], cost.detail["mean_decoded_rows"]
    assert rows < 0.5 * cost.detail["slots"]  # the long tail: most steps process few rows
    row_bytes = shape.hidden * shape.compute_bytes_each
    per_all_reduce = 2 * 3 * 2e-6 + 2 * 3 / 4 * row_bytes * rows / (450 * 1e9)  # at the mean rows: it is linear
    expected = steps * 2 * shape.layers * per_all_reduce
    assert cost.communication_seconds == pytest.approx(expected, rel=1e-9)


def test_a_serving_engines_custom_all_reduce_costs_decode_inside_a_node_only():
    """`decode_custom_all_reduce` (vLLM's one-shot kernel): 3 hops and the n - 1 peers' bytes per all-reduce for a
    tensor group of up to 8 inside a node; the ring for 16 GPUs over two nodes, as vLLM falls back to NCCL."""
    from rpegjax.perf.model.generation_stage import generation_cost

    for tensor, custom_expected in ((4, True), (16, False)):
        inputs = _inputs(presets.h100_node(16), options=ExecutionOptions(decode="paged", decode_custom_all_reduce=True))
        layout = Layout.from_parallel({"data": 1, "tensor": tensor}, where="test")
        cost = generation_cost(inputs, layout, kv_budget_bytes=1e12)
        ring = generation_cost(dataclasses.replace(inputs, options=ExecutionOptions(decode="paged")), layout,
                               kv_budget_bytes=1e12)
        shape, steps, rows = inputs.actor, cost.detail["decode_steps"], cost.detail["mean_decoded_rows"]
        if custom_expected:
            row_bytes = shape.hidden * shape.compute_bytes_each
            expected = steps * 2 * shape.layers * (3 * 2e-6 + 3 * row_bytes * rows / (450 * 1e9))
            assert cost.communication_seconds == pytest.approx(expected, rel=1e-9)
            assert cost.communication_seconds < ring.communication_seconds
        else:
            assert cost.communication_seconds == ring.communication_seconds


@pytest.mark.parametrize("remat, tokens", [("full", 16384), ("full", 32768), ("dots", 4096)])
def test_the_updates_head_and_layers_phases_are_maxed_not_added(remat, tokens):
    """An update's peak (fsdp8, one row per device, one micro-batch): what the layers keep for the backward and the
    gradients, plus the larger of the log-prob head's phase (the gathered bfloat16 output matrix, one chunk's
    bfloat16 dW and their float32 sum, one float32 chunk of logits) and the layers' phase (two gathered bfloat16
    layers, one layer's working set and, with full remat, the layer scan's bfloat16 stack, built for the backward
    loop only, run by run):
    `models.logprobs._ChunkLoop` frees the head's buffers before the layers'
    backward starts (the GPU compiler's buffer assignment). Written out from the formula."""
    from rpegjax.perf.model import costs

    config = ModelConfig.qwen2p5("7b").replace(param_dtype="float32", dtype="bfloat16")
    shape = ModelShape.from_config(config)
    layout = Layout.from_parallel({"fsdp": 8}, where="test")
    workload = Workload(prompts=8, group_size=1, prompt_tokens=512, responses=ResponseLengths.fixed(tokens - 512))
    execution = Execution(attention="blockwise", remat=remat, scan_layers=True, param_dtype="float32",
                          dtype="bfloat16", update_microbatches=1)
    options = ExecutionOptions().executing(execution)
    inputs = CostInputs(hardware=presets.h100_node(8), actor=shape, critic=shape, workload=workload, options=options)
    update = model_pass_cost(inputs, shape, layout, logits=True, backward=True, optimizer_steps=1)

    b, d, v, L = 2, shape.hidden, shape.vocab, shape.layers
    layer_params = shape.matmul_params_per_layer
    per_token = costs.layer_activation_bytes_per_token(shape, keys_per_query=1.0, kernel="flash")  # flash: no scores
    working = tokens * per_token
    kept = tokens * L * d * b
    grads = shape.params * 4 / 8
    head = v * d * (b + b + 4) + 256 * v * 4
    layers = 2 * layer_params * b + working
    if remat == "full":  # the stacked bf16 kernels and their gradients share one buffer, built for the backward only,
        grads -= L * layer_params * 4 / 8  # run by run: 5 runs of the 28 layers, whose kept inputs free run by run
        stack, runs = L * layer_params * b / 8, 5
        layers += max(stack / runs, stack - kept * (1 - 1 / runs))
    else:  # DOTS keeps the matmul outputs too
        kept += tokens * L * costs.layer_matmul_output_bytes_per_token(shape, keys_per_query=1.0, kernel="flash")
    assert update.transient_bytes == pytest.approx(kept + grads + max(head, layers), rel=1e-9)
    assert update.transient_bytes < kept + grads + head + layers  # never both phases at once
    # the head's phase binds at 4k tokens a row, the layers' (with full remat's stack) from 16k: both sides of the
    # max are checked
    assert (head > layers) == (tokens < 16384)
