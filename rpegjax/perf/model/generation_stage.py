"""The generation stage: the sampler's memory (slots, contiguous cache or paged pool, logits) and the time of its
prefill + decode loop (`rpegjax.perf.model.generation_cost` simulates the loop), for one stage's `Layout`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from rpegjax.options import CarryMode
from rpegjax.perf.model import collectives, costs, expert_costs
from rpegjax.perf.model import partial_rollouts as partial
from rpegjax.perf.model.costs import DecodeKernel, ModelShape
from rpegjax.perf.model.generation_cost import (
    DecodeStepCost,
    DecodeTimeline,
    ResponseLengths,
    replica_lengths,
    simulate_decode,
)
from rpegjax.perf.model.hardware import HardwareSpec
from rpegjax.perf.model.stage_costs import (
    SAMPLING_BYTES_PER_VOCAB,
    CostInputs,
    ExecutionOptions,
    Layout,
    StageCost,
    Workload,
)

# vLLM's custom all-reduce serves tensor groups of 2, 4, 6 or 8 GPUs on one NVLink node
# (vllm/distributed/device_communicators/custom_all_reduce.py, `_SUPPORTED_WORLD_SIZES`)
CUSTOM_ALL_REDUCE_DEVICES = 8


def kv_bytes_per_slot(inputs: CostInputs, layout: Layout) -> float:
    """KV cache one sequence holds on one device: the whole capacity (STATIC, or a contiguous cache), its mean
    length (PAGED serving engines), or in rpegjax's paged pool its time-averaged share (`pool_tokens_per_slot`)."""
    w, o, shape = inputs.workload, inputs.options, inputs.actor
    if o.kv_pool:
        tokens = pool_tokens_per_slot(w)
    else:
        tokens = w.prompt_tokens + (w.responses.expected_mean() if o.decode is DecodeKernel.PAGED else w.responses.max)
    return tokens * kv_bytes_per_token(shape, layout)


def kv_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """KV bytes of one cached token on one device (KV heads split over the tensor axis, replicated beyond)."""
    return shape.kv_bytes_per_token / min(layout.tensor, shape.kv_heads)


def pool_tokens_per_slot(w: Workload) -> float:
    """Tokens a busy slot holds in a paged pool on average: its prompt and, under continuous batching, the
    length-biased half of a response (a slot is found in a sequence of length L with odds ∝ L, halfway through
    it on average: E[L²] / 2E[L]); a pool of slots x this many tokens rarely runs dry."""
    lengths = w.responses.sample(4096).astype(float)
    return w.prompt_tokens + float((lengths**2).mean() / (2 * lengths.mean()))


def decode_transient_bytes(inputs: CostInputs, slots: int) -> float:
    """Per device besides the KV cache while one replica decodes `slots` sequences: float32 logits and their
    softmax (sampling)."""
    return slots * inputs.actor.vocab * 4 * 2


def decode_working_bytes(inputs: CostInputs, layout: Layout, slots: int) -> float:
    """Per device besides the KV cache while one replica decodes `slots` sequences: the logits
    (`decode_transient_bytes`) and, in rpegjax's sampler (STATIC: every slot attends over its window; LIVE: the running
    slots, and its largest bucket is every slot, when a step starts), one layer's cached values over the whole window
    (prompt + longest response), gathered from the cache and widened to float32 for the attention sum (XLA's GPU
    compiler materialises it: 1.3 GB per device for 512 slots of 7B at a 5k window, `scripts/plan.py --verify
    --verify-target cuda-h100`). The Pallas paged kernel (LIVE_PAGED) reads pages block by block into on-chip memory:
    in place of the window, one layer's float32 partial outputs of its `KERNEL_SPLITS` partitions per row,
    [16, b, h/t, e]."""
    w, shape, decode = inputs.workload, inputs.actor, inputs.options.decode
    window = 0.0
    if decode in (DecodeKernel.STATIC, DecodeKernel.LIVE):
        heads = shape.kv_heads / min(layout.tensor, shape.kv_heads)
        window = slots * (w.prompt_tokens + w.responses.max) * heads * shape.head_dim * 4
    elif decode is DecodeKernel.LIVE_PAGED:
        window = slots * KERNEL_SPLITS * shape.heads / min(layout.tensor, shape.heads) * shape.head_dim * 4
    return decode_transient_bytes(inputs, slots) + window


# the runtime's `CacheConfig.prefill_chunk` (most context tokens per row in one paged prefill call)
PREFILL_CHUNK = 256
# the Pallas paged kernel's partitions of a row's pages (`generate.paged_attention.K_SPLITS`) and the query heads
# per KV head it pads to (`BLOCK_H`: its dot tiles are 16 rows)
KERNEL_SPLITS = 16
KERNEL_HEAD_BLOCK = 16


def prefill_working_bytes(inputs: CostInputs, layout: Layout, slots: int) -> float:
    """Per device besides the KV pool while one replica of rpegjax's paged sampler prefills (0 for a contiguous
    cache, whose prefill is not modelled here): the largest prefill call `PagedSampler.lower_programs` compiles.

    Rows: one per group, a replica's groups at once (min(slots, pow2(slots / group size)) rows of the prompt);
    with partial rollouts, carried sequences are one-sample requests of prompt + prefix, so up to every slot of
    the replica at once (`slots` rows) with contexts up to the capacity. Each call runs c = min(PREFILL_CHUNK,
    pow2(context)) query tokens per row over a window of W = min(pow2(context), capacity) cached keys. The
    attention and the MLP are not live together, so the larger of the two counts beside the logits:

        rows x (max(heads/t x c x W x 2b           the attention scores, twice: the GPU compiler keeps the
                                                    dot's output and a transposed copy the softmax reads
                    + 2 x kv/t x W x head_dim x b,  the window's keys and values gathered from the pages
                    2 x c x mlp/t x b)              the MLP's gate and up activations
                + 2 x vocab x 4)                    the float32 last-token logits, in and out

    (b: compute bytes). The start program that follows samples each replica's own rows (`start_rows`): its
    logits are the decode transient's (`decode_transient_bytes`). GPU compiler's temporaries against this count:
    W-plan 7B (64 carried rows, t = 4, a 17k window, bfloat16) 8.5 GB against 8.6; the README's Qwen2.5-0.5B
    float32 plan (384 rows, t = 2, a 2,304 window) 13.41 GB against 13.6, where counting the scores once at 4 bytes
    had given 9.2 (`scripts/plan.py ... --verify --verify-target cuda-h100|cuda-gh200`)."""
    w, shape, o = inputs.workload, inputs.actor, inputs.options
    if not o.kv_pool:
        return 0.0
    capacity = w.prompt_tokens + w.responses.max
    if o.partial_rollouts:
        rows, context = slots, capacity
    else:
        rows, context = min(slots, _pow2(math.ceil(slots / w.group_size))), w.prompt_tokens
    chunk, window = min(PREFILL_CHUNK, _pow2(context)), min(_pow2(context), capacity)
    t, b = layout.tensor, shape.compute_bytes_each
    heads, kv = shape.heads / min(t, shape.heads), shape.kv_heads / min(t, shape.kv_heads)
    attention = 2 * heads * chunk * window * b + 2 * kv * window * shape.head_dim * b
    per_row = max(attention, 2 * chunk * shape.mlp / t * b) + 2 * shape.vocab * 4
    return rows * per_row


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(n) - 1).bit_length()


def generation_working_bytes(inputs: CostInputs, layout: Layout, slots: int) -> float:
    """Per device besides the KV cache at the peak of the generation programs of `slots` sequences per replica: the
    larger of a decode chunk's (`decode_working_bytes`) and the largest prefill's (`prefill_working_bytes`);
    every program holds the cache."""
    return max(decode_working_bytes(inputs, layout, slots), prefill_working_bytes(inputs, layout, slots))


def generation_memory(inputs: CostInputs, layout: Layout, kv_budget_bytes: float) -> tuple[int, float]:
    """(concurrent sequences per replica, KV bytes per device) of the sampler in `kv_budget_bytes` per device.

    The options' `decode_slots` (all replicas) when given, else what fits the budget (capped by the replica's
    share of the batch and `max_decode_slots`). A contiguous cache reserves every slot's capacity; rpegjax's
    paged pool holds `kv_pool_tokens` per replica (default: the budget, at most every slot at capacity) and
    admits the slots whose time-averaged footprint fits it. Raises MemoryError when not one sequence fits."""
    w, o = inputs.workload, inputs.options
    per_token = kv_bytes_per_token(inputs.actor, layout)
    capacity = w.prompt_tokens + w.responses.max
    # a replica's share of the sequences in flight (partial rollouts keep inflight_batches batches)
    share = math.ceil(w.sequences * (o.inflight_batches if o.partial_rollouts else 1) / layout.replicas)
    transient = functools.partial(generation_working_bytes, inputs, layout)  # bytes beside the cache, by slots
    per_slot = kv_bytes_per_slot(inputs, layout) + transient(1)
    if o.kv_pool:
        pool_bytes = (o.kv_pool_tokens * per_token if o.kv_pool_tokens is not None
                      else max(0.0, kv_budget_bytes - transient(min(share, o.max_decode_slots))))
        fitting = int(pool_bytes // (pool_tokens_per_slot(w) * per_token))
        if pool_bytes < capacity * per_token:  # the runtime refuses a pool that cannot hold one sequence whole
            fitting = 0
    else:
        fitting = int(max(kv_budget_bytes, 0) // per_slot)
    slots = min(share, o.max_decode_slots, fitting)
    if o.decode_slots is not None:
        slots = math.ceil(o.decode_slots / layout.replicas)
    if slots < 1 or (o.decode_slots is not None and o.kv_pool and fitting < 1):
        raise MemoryError(f"the KV cache of one sequence ({capacity * per_token / 1e9:.2f} GB per device at its "
                          f"{capacity}-token capacity) does not fit the {max(kv_budget_bytes, 0) / 1e9:.2f} GB left for it")
    if o.kv_pool and o.kv_pool_tokens is None:  # never more than every admitted slot at capacity
        pool_bytes = min(pool_bytes, slots * capacity * per_token)
    kv = pool_bytes if o.kv_pool else slots * kv_bytes_per_slot(inputs, layout)
    return slots, kv + transient(slots)


def generation_cost(inputs: CostInputs, layout: Layout, *, kv_budget_bytes: float, pieces: int = 1,
                    async_bound: int = 0) -> StageCost:
    """Prefill + decode of the whole batch on `layout.replicas` replicas of `layout.tensor`-way tensor parallelism.

    The number of concurrent sequences per replica is what the KV budget (bytes per device) holds, capped by
    the options' `max_decode_slots` and the replica's share of the batch. FSDP in generation all-gathers the
    weights every step (costed, never hidden: decode has no compute to hide it behind). With the options'
    `partial_rollouts` generation runs continuously over more groups than a step trains
    (`rpegjax.perf.model.partial_rollouts`; `async_bound`: the graph's, which bounds how long a group may be carried).
    """
    hw, o, w, shape, device = inputs.hardware, inputs.options, inputs.workload, inputs.actor, inputs.hardware.device
    if layout.pipeline > 1:
        raise ValueError(f"generation with pipeline parallelism ({layout.pipeline} stages) is not modelled")
    t = layout.tensor
    replicas = layout.replicas
    slots, memory = generation_memory(inputs, layout, kv_budget_bytes)
    peak = device.flops(shape.compute_dtype) * device.matmul_efficiency
    attention_peak = device.flops(shape.compute_dtype) * (
        device.matmul_efficiency if device.attention_efficiency is None else device.attention_efficiency)
    bandwidth = device.memory_bandwidth * (device.memory_efficiency if o.decode_memory_efficiency is None
                                           else o.decode_memory_efficiency)
    row_flops = 2 * (shape.layers * shape.matmul_params_per_layer + shape.hidden * shape.vocab) / t
    key_flops = 4 * shape.layers * _kernel_heads(shape, o.decode) * shape.head_dim / t
    kv_per_token = shape.kv_bytes_per_token / min(t, shape.kv_heads)
    row_bytes = (shape.layers * (6 * shape.hidden + 3 * shape.token_mlp / t) * shape.compute_bytes_each
                 + kv_per_token + SAMPLING_BYTES_PER_VOCAB * shape.vocab)
    # two all-reduces per layer of the processed rows' activations: their latency every step, their bytes per row
    # (a live bucket or a serving engine's batch decodes the running rows, not every slot)
    reduce_seconds, reduce_latency = _decode_all_reduce(o, hw, layout.group("tensor"))
    tensor_latency = 2 * shape.layers * reduce_latency
    tensor_per_row = 2 * shape.layers * reduce_seconds(shape.hidden * shape.compute_bytes_each) - tensor_latency
    fsdp_comm = 0.0 if o.replicated_generation_weights else collectives.all_gather_seconds(
        shape.weight_bytes / t, hw, layout.group("fsdp"))
    capacity = w.prompt_tokens + w.responses.max
    prompt_pairs = w.prompt_tokens * (capacity if o.attention is costs.AttentionKernel.DENSE else (w.prompt_tokens + 1) / 2)
    prefill_seconds = (costs.forward_flops(shape, tokens=w.prompt_tokens, pairs=0, logit_tokens=1) / peak
                       + costs.forward_flops(shape, tokens=0, pairs=prompt_pairs, logit_tokens=0) / attention_peak)
    dense_bytes, expert_bytes, miss = expert_costs.decode_weight_terms(shape, layout)  # experts read by each step's rows
    dispatch_latency, dispatch_per_row = expert_costs.decode_dispatch_terms(shape, layout, hw)
    step = DecodeStepCost(
        seconds_per_row=row_flops / peak, seconds_per_key=key_flops / attention_peak,
        memory_seconds_fixed=dense_bytes / bandwidth, expert_memory_seconds=expert_bytes / bandwidth, expert_miss=miss,
        memory_seconds_per_row=row_bytes / bandwidth, memory_seconds_per_key=kv_per_token / bandwidth,
        fixed_seconds=shape.layers * o.kernels_per_layer * device.kernel_overhead_s + tensor_latency + fsdp_comm
        + dispatch_latency,
        prefill_seconds=prefill_seconds / t, comm_seconds_per_row=tensor_per_row + dispatch_per_row)
    if o.partial_rollouts:
        timeline, extra = _partial_timeline(inputs, layout, slots, step, async_bound, peak, attention_peak)
    else:
        timeline = _replica_timeline(w.responses, w.sequences, replicas, slots=slots, prompt=w.prompt_tokens,
                                     capacity=capacity, kernel=DecodeKernel(o.decode), continuous=o.continuous_batching,
                                     cost=step)
        extra = {}
    seconds = timeline.seconds + device.dispatch_overhead_s
    finished = np.sort(timeline.finish_seconds)
    fractions = tuple(float(finished[min(len(finished) - 1, math.ceil((j + 1) * len(finished) / pieces) - 1)]) / seconds
                      for j in range(pieces - 1)) + (1.0,)
    generated = float(w.responses.sample(w.sequences).sum())
    useful = (w.sequences * costs.forward_flops(shape, tokens=w.prompt_tokens, pairs=w.prompt_tokens * (w.prompt_tokens + 1) / 2,
                                                logit_tokens=1)
              + costs.decode_step_flops(shape, sequences=generated, keys=generated * (w.prompt_tokens + generated / w.sequences / 2)))
    return StageCost(
        seconds=seconds, compute_seconds=timeline.seconds * timeline.compute_bound_fraction,
        memory_seconds=timeline.seconds * (1 - timeline.compute_bound_fraction),
        communication_seconds=timeline.steps * (tensor_latency + fsdp_comm + tensor_per_row * timeline.mean_rows),
        overhead_seconds=timeline.steps * shape.layers * o.kernels_per_layer * device.kernel_overhead_s + device.dispatch_overhead_s,
        flops=useful, model_flops=useful, transient_bytes=memory,
        piece_fractions=fractions,
        detail={"slots": slots, "decode_steps": timeline.steps, "mean_active": timeline.mean_active,
                "mean_decoded_rows": timeline.mean_rows, "slot_busy": timeline.mean_active / timeline.slots,
                # the decode work spent on running sequences: rows (matmuls) and cached keys read (KV traffic)
                "live_row_share": timeline.mean_active / timeline.mean_rows if timeline.mean_rows else 1.0,
                "live_key_share": timeline.mean_live_keys / timeline.mean_keys if timeline.mean_keys else 1.0,
                "generated_tokens": generated, **extra})


def _decode_all_reduce(options: ExecutionOptions, hw: HardwareSpec,
                       group: collectives.Group) -> tuple[Callable[[float], float], float]:
    """(seconds of one all-reduce of n bytes, its latency) for decode's tensor group: the serving engine's one-shot
    kernel where `decode_custom_all_reduce` and the group fits it (vLLM: 2 to 8 devices inside one NVLink node),
    else the hierarchical ring."""
    if (options.decode_custom_all_reduce and group.size <= CUSTOM_ALL_REDUCE_DEVICES
            and collectives.inside_first_level(hw, group)):
        return (lambda n: collectives.one_shot_all_reduce_seconds(n, hw, group),
                collectives.one_shot_all_reduce_latency(hw, group))
    return lambda n: collectives.all_reduce_seconds(n, hw, group), collectives.all_reduce_latency(hw, group)


@functools.lru_cache(maxsize=1024)
def _replica_timeline(lengths: ResponseLengths, sequences: int, replicas: int, *, slots: int, prompt: int,
                      capacity: int, kernel: DecodeKernel, continuous: bool, cost: DecodeStepCost) -> DecodeTimeline:
    """`simulate_decode` of the slowest replica's queue (`replica_lengths`), remembered: deterministic in its
    arguments, and the planner prices the same sampler under many training layouts. Its finish times are
    read-only (the timeline is shared)."""
    timeline = simulate_decode(replica_lengths(lengths, sequences, replicas), slots=slots, prompt=prompt,
                               capacity=capacity, kernel=kernel, continuous=continuous, cost=cost)
    timeline.finish_seconds.setflags(write=False)
    return timeline


def _partial_timeline(inputs: CostInputs, layout: Layout, slots: int, step: DecodeStepCost, async_bound: int,
                      peak: float, attention_peak: float) -> tuple[DecodeTimeline, dict[str, float]]:
    """One replica's steady-state step of partial rollouts (`rpegjax.perf.model.partial_rollouts`) as a
    `DecodeTimeline` (finish times: of the trained groups), and its partial-rollout figures."""
    w, o, shape, t = inputs.workload, inputs.options, inputs.actor, layout.tensor
    if slots < w.group_size:
        raise MemoryError(f"partial rollouts: a group of {w.group_size} starts in as many slots at once; a replica "
                          f"holds {slots}")
    # simulated with k = 0 and the versions a group may be carried over: its time does not depend on k (the lags
    # it reports are beyond k), so plans that differ only in k share it
    schedule = partial.PartialSchedule(
        group_size=w.group_size, groups_per_step=math.ceil(w.prompts / layout.replicas),
        inflight_batches=o.inflight_batches, max_token_lag=partial_carries(o.max_token_lag, async_bound),
        async_bound=0, slots=slots, prompt=w.prompt_tokens, capacity=w.prompt_tokens + w.responses.max,
        carry_pages=o.partial_carry == CarryMode.PAGES)
    prefill = partial.PrefillCost(
        seconds_fixed=costs.forward_flops(shape, tokens=0, pairs=0, logit_tokens=1) / peak / t,
        seconds_per_token=costs.forward_flops(shape, tokens=1, pairs=0, logit_tokens=0) / peak / t,
        seconds_per_pair=costs.forward_flops(shape, tokens=0, pairs=1, logit_tokens=0) / attention_peak / t,
        dense_width=schedule.capacity if o.attention is costs.AttentionKernel.DENSE else None)
    state = partial.drawn_steady_state(schedule, w.responses, kernel=DecodeKernel(o.decode), cost=step, prefill=prefill)
    timeline = DecodeTimeline(seconds=state.seconds, finish_seconds=np.asarray(state.finish_fractions) * state.seconds,
                              steps=round(state.decode_steps), mean_active=state.mean_active,
                              mean_rows=state.mean_rows, mean_keys=state.mean_keys,
                              mean_live_keys=state.mean_live_keys, slots=slots,
                              compute_bound_fraction=state.compute_bound_fraction)
    extra = {"carried_sequences": state.carried_sequences * layout.replicas,
             "reprefill_tokens": state.reprefill_tokens * layout.replicas,
             "decoded_tokens": state.decoded_tokens * layout.replicas, "carry_lag_mean": state.lag_mean,
             "carry_lag_max": float(state.lag_max), "dropped_groups": state.dropped_groups * layout.replicas,
             "inflight_batches": float(o.inflight_batches)}
    return timeline, extra


def _kernel_heads(shape: ModelShape, decode: DecodeKernel) -> float:
    """Query heads the decode kernel scores per key: the Pallas paged kernel pads each KV head's group of query
    heads to a multiple of `KERNEL_HEAD_BLOCK` (Llama-3.1-8B's 4 to 16: 4x the scoring FLOPs, still memory-bound)."""
    if decode is not DecodeKernel.LIVE_PAGED:
        return float(shape.heads)
    group = shape.heads // shape.kv_heads
    return float(shape.kv_heads * -(-group // KERNEL_HEAD_BLOCK) * KERNEL_HEAD_BLOCK)


def partial_carries(max_token_lag: int | None, async_bound: int) -> int:
    """Weights versions a trained token may lag beyond the asynchrony bound under partial rollouts: how many
    steps after its first a group may still be generated (`max_token_lag` None: the job's default, k + 2)."""
    return 2 if max_token_lag is None else max_token_lag - async_bound


__all__ = ["PREFILL_CHUNK", "decode_transient_bytes", "decode_working_bytes", "generation_cost", "generation_memory",
           "generation_working_bytes", "kv_bytes_per_slot", "kv_bytes_per_token", "partial_carries",
           "pool_tokens_per_slot", "prefill_working_bytes"]
