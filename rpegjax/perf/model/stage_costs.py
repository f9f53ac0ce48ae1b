"""Time of one stage on its placement: roofline compute and memory terms, α–β communication, fixed overheads.

Every function here takes a `CostInputs` (model shapes, workload, execution options, hardware) and one
stage's `Layout`, and returns a `StageCost` for one execution of the stage (one RL step). How the terms add:

    seconds = matmul + elementwise + tensor-parallel collectives (on the critical path)
            + exposed FSDP/data-parallel collectives (hidden behind compute when overlap is on)
            + optimiser + kernel and dispatch overheads

Generation (the sampler's memory and its simulated decode loop) is `rpegjax.perf.model.generation_stage`. The mesh
order is the layout's axis order with the last axis fastest (`rpegjax.sharding.make_mesh`), which gives each collective group its stride.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from rpegjax.graph.ir import Execution
from rpegjax.options import CacheLayout, CarryMode, DecodeAttention, OptimizerSharding, RematPolicy, remat_runs
from rpegjax.perf.model import collectives, costs, expert_costs, packed_batches
from rpegjax.perf.model.costs import DecodeKernel, ModelShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.hardware import HardwareSpec

KNOWN_AXES = ("data", "fsdp", "expert", "context", "tensor", "pipeline")
# Elementwise traffic per token and layer in a forward pass (norms, RoPE, residuals, SwiGLU), in units of the
# compute dtype's bytes: 12·d + 4·(q, k heads)·e + 3·f, counted from the decoder's operations. Dense attention
# adds float32 score traffic (write, mask, max/exp/sum, normalise: ~5 passes of 4 bytes) per (query, key, head).
ELEMENTWISE_PER_D, ELEMENTWISE_PER_QK, ELEMENTWISE_PER_F = 12, 4, 3
DENSE_SCORE_BYTES = 20
SAMPLING_BYTES_PER_VOCAB = 16  # float32 logits: written, softmax read/written, sampled (per row and step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Parallel sizes of one stage: batch over data x fsdp, each row's sequence over context, parameters sharded
    over fsdp x context x tensor x pipeline; `sequence_parallel`: the residual stream split over tensor as well.

    `pipeline` (Megatron-style layer stages, 1F1B) is never searched by the planner (rpegjax does not run it);
    it exists to predict published runs of systems that do (`rpegjax.perf.reference.published_runs`).
    `expert` (expert parallelism, `rpegjax.perf.model.expert_costs`) splits a mixture-of-experts model's experts; it is
    data-like for the rest: rows split over it and the dense weights' embedding dimension too (as over fsdp).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    sequence_parallel: bool = False
    strides: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_parallel(cls, parallel: Mapping[str, int], *, where: str, sequence_parallel: bool = False) -> Layout:
        unknown = [axis for axis, size in parallel.items() if axis not in KNOWN_AXES and size > 1]
        if unknown:
            raise ValueError(f"{where}: the performance model knows parallel axes {KNOWN_AXES}, got {dict(parallel)}")
        strides, stride = {}, 1
        for axis in reversed(list(parallel)):
            strides[axis] = stride
            stride *= parallel[axis]
        return cls(data=parallel.get("data", 1), fsdp=parallel.get("fsdp", 1), tensor=parallel.get("tensor", 1),
                   pipeline=parallel.get("pipeline", 1), context=parallel.get("context", 1),
                   expert=parallel.get("expert", 1), sequence_parallel=sequence_parallel, strides=tuple(sorted(strides.items())))

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.expert * self.context * self.tensor * self.pipeline

    @property
    def replicas(self) -> int:
        """Ways the batch is split."""
        return self.data * self.fsdp * self.expert

    @property
    def shards(self) -> int:
        """Ways the parameters are split (a MoE model's experts over `expert`, the rest's embedding dim over it)."""
        return self.fsdp * self.expert * self.context * self.tensor * self.pipeline

    @property
    def residual_split(self) -> int:
        """Ways the residual stream (what full remat keeps) is split on one row: context, and tensor under
        sequence parallelism."""
        return self.context * (self.tensor if self.sequence_parallel else 1)

    def group(self, axis: str) -> collectives.Group:
        size = getattr(self, axis)
        return collectives.Group(size=size, stride=dict(self.strides).get(axis, 1))

    def weight_group(self, *, experts: bool = False) -> collectives.Group:
        """The devices that gather (and reduce-scatter) each weight shard: fsdp x expert x context for the dense
        weights, fsdp x context for a MoE model's `experts` (their expert dim stays split); the innermost of those
        axes gives the stride (mesh order data, fsdp, expert, context, tensor)."""
        strides = dict(self.strides)
        axes = [a for a in ("fsdp", "context") + (() if experts else ("expert",)) if getattr(self, a) > 1]
        stride = min((strides.get(a, 1) for a in axes), default=1)
        return collectives.Group(size=math.prod(getattr(self, a) for a in axes), stride=stride)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionOptions:
    """How stages execute, beyond what the graph says (kernels, batching, rematerialisation, precision)."""

    attention: costs.AttentionKernel = costs.AttentionKernel.FLASH
    decode: DecodeKernel = DecodeKernel.PAGED
    continuous_batching: bool = True
    sequence_packing: bool = True  # batches hold real tokens only; False pads every row to prompt + max response
    remat: RematPolicy = RematPolicy.FULL
    logprob_chunk: int = 256
    microbatch_tokens: int = 8192  # tokens per device per forward/backward pass (gradient accumulation)
    optimizer_bytes_per_param: float = 12.0  # float32 master weights + two float32 moments
    grad_bytes_per_param: float = 4.0
    overlap_collectives: bool = True  # FSDP / data-parallel collectives hide behind compute
    kernels_per_layer: int = 16  # kernels per layer and pass, for the per-kernel overhead
    backward_traffic_ratio: float = 2.0  # elementwise bytes of a backward pass relative to its forward pass
    max_decode_slots: int = 1024  # a serving engine's cap on concurrent sequences per replica
    # A serving engine's share of device memory (vLLM's gpu_memory_utilization): when set, the KV cache gets this
    # share of the memory CUDA reports (`DeviceSpec.reported_memory_bytes`) minus the generation weights, as in
    # systems that offload training state while they generate; None: whatever the plan's persistent state leaves
    # (rpegjax's runtime)
    generation_memory_fraction: float | None = None
    decode_memory_efficiency: float | None = None  # the decode kernels' share of HBM bandwidth; None: the device's
    # A serving engine's custom all-reduce for decode's tensor all-reduces (vLLM's one-shot kernel, on for a tensor
    # group of up to CUSTOM_ALL_REDUCE_DEVICES inside one node; NCCL's ring otherwise); False: the ring (XLA's runtime)
    decode_custom_all_reduce: bool = False
    # rpegjax's runtime: an update takes optimiser steps x this many passes, an inference stage one pass per
    # piece (its micro-batches); None: passes of `microbatch_tokens` tokens (systems that size them by tokens)
    update_microbatches: int | None = None
    # rpegjax's sampler: generation weights are always a copy of the training weights, split over the tensor axis
    # only (every other axis holds slots), so no weight gathers while decoding; False: FSDP-sharded generation
    # weights gathered every step, shared with training when the layouts agree
    replicated_generation_weights: bool = False
    # rpegjax's runtime: inference stages in row micro-batches of at most this many rows (None: a piece at once)
    inference_rows: int | None = None
    # rpegjax's sampler: its concurrent sequences over all replicas (None: what the KV budget holds) and its paged
    # pool (`kv_pool`: KV memory is the pool, `kv_pool_tokens` per slot replica or, None, what the budget leaves;
    # else every slot reserves its capacity)
    decode_slots: int | None = None
    kv_pool: bool = False
    kv_pool_tokens: int | None = None
    # the optimiser state split over the data replicas too (ZeRO-1: each updates its slice; the reduce-scatter of
    # the gradients and all-gather of the new weights move what the all-reduce did), and kept in host memory while
    # the sampler generates (moved over the host link before each update and back after it)
    optimizer_data_sharding: bool = False
    optimizer_offload: bool = False
    # rpegjax's runtime packing (`Execution.packing`): sequences laid first-fit-decreasing into rows of this many
    # tokens, one row per row shard per pass, whole rows computed (`rpegjax.perf.model.packed_batches`); None: not so
    packed_row_tokens: int | None = None
    # partial rollouts (`rpegjax.perf.model.partial_rollouts`): generation runs continuously over `inflight_batches`
    # batches of groups, carrying unfinished sequences into later steps; a trained token lags at most
    # `max_token_lag` weights versions (None: the asynchrony bound + 2, as the job's default); `partial_carry`:
    # carried sequences re-prefilled (recompute) or continued from kept KV pages (pages)
    partial_rollouts: bool = False
    inflight_batches: int = 2
    max_token_lag: int | None = None
    partial_carry: CarryMode = CarryMode.RECOMPUTE
    # a MoE model's expert matmuls as grouped GEMMs (Megatron, vLLM); False: as rpegjax's runtime runs its dropless
    # mode on GPU, a dense batched GEMM over every local expert of the worst-case receive buffer (`perf.expert_costs`)
    grouped_expert_gemm: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", costs.AttentionKernel(self.attention))
        object.__setattr__(self, "decode", DecodeKernel(self.decode))
        object.__setattr__(self, "remat", RematPolicy(self.remat))
        for name in ("logprob_chunk", "microbatch_tokens", "kernels_per_layer", "max_decode_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ExecutionOptions.{name} must be a positive integer, got {value!r}")
        if self.generation_memory_fraction is not None and not 0 < self.generation_memory_fraction <= 1:
            raise ValueError(f"ExecutionOptions.generation_memory_fraction must be in (0, 1] or None, "
                             f"got {self.generation_memory_fraction!r}")
        if self.decode_memory_efficiency is not None and not 0 < self.decode_memory_efficiency <= 1:
            raise ValueError(f"ExecutionOptions.decode_memory_efficiency must be in (0, 1] or None, "
                             f"got {self.decode_memory_efficiency!r}")
        for name in ("optimizer_bytes_per_param", "grad_bytes_per_param", "backward_traffic_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"ExecutionOptions.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("update_microbatches", "inference_rows", "decode_slots", "kv_pool_tokens", "packed_row_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ExecutionOptions.{name} must be a positive integer or None, got {value!r}")

    def executing(self, execution: Execution) -> ExecutionOptions:
        """These options (efficiencies, overheads) with the kernels and batching of rpegjax's runtime running
        `execution`: blockwise and cuDNN attention skip causal blocks (FLASH), dense scores every pair; the
        sampler decodes its running slots padded to a power of two each step, over a window of the longest (LIVE),
        or with the Pallas paged kernel each row over its own keys (`decode_attention=pallas`: LIVE_PAGED),
        with continuous batching (whatever its cache layout), `decode_slots` slots; its contiguous KV cache reserves
        each slot's capacity, its paged cache the pool; inference stages run in `inference_rows` row micro-batches;
        rows are padded to the longest, or packed (`Execution.packing`: rows of `max_tokens_per_micro_batch` tokens
        filled first-fit-decreasing, one per row shard per pass, `rpegjax.perf.model.packed_batches`); AdamW moments and
        gradients in the weights' dtype, split and offloaded as the execution says."""
        param_bytes = execution.param_dtype.itemsize
        attention = costs.AttentionKernel.FLASH if execution.attention.skips_causal_blocks else costs.AttentionKernel.DENSE
        return dataclasses.replace(
            self, attention=attention, remat=execution.remat, continuous_batching=True,
            decode=DecodeKernel.LIVE_PAGED if execution.decode_attention is DecodeAttention.PALLAS else DecodeKernel.LIVE,
            sequence_packing=False, update_microbatches=execution.update_microbatches,
            packed_row_tokens=execution.max_tokens_per_micro_batch, replicated_generation_weights=True,
            optimizer_bytes_per_param=2.0 * param_bytes, grad_bytes_per_param=float(param_bytes),
            inference_rows=execution.inference_rows, decode_slots=execution.decode_slots,
            kv_pool=execution.kv_cache is CacheLayout.PAGED, kv_pool_tokens=execution.kv_pool_tokens,
            optimizer_data_sharding=execution.optimizer_sharding is OptimizerSharding.DATA,
            optimizer_offload=execution.optimizer_offload, partial_rollouts=execution.partial_rollouts,
            inflight_batches=execution.inflight_batches, max_token_lag=execution.max_token_lag,
            partial_carry=execution.partial_carry, grouped_expert_gemm=False)

    @classmethod
    def rpegjax_xla(cls, **changes) -> ExecutionOptions:
        """rpegjax's own kernels as they are today: dense masked attention, a fixed-slot sampler, padded batches."""
        # XLA's cost analysis of rpegjax's decoder: a forward + backward program moves ~3.2x the bytes of the
        # forward alone (transposed copies for the weight gradients, float32 attention-score gradients), i.e. the
        # backward ~2.2x the forward (hand-written SwiGLU and log-prob backward passes); tests/perf/model/test_costs.py
        # checks this ratio on the compiled programs.
        base = dict(attention=costs.AttentionKernel.DENSE, decode=DecodeKernel.STATIC, continuous_batching=False,
                    sequence_packing=False, remat=RematPolicy.NONE, logprob_chunk=256, microbatch_tokens=1 << 30,
                    optimizer_bytes_per_param=8.0, backward_traffic_ratio=2.2)
        base.update(changes)
        return cls(**base)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One RL step's batch: `prompts` x `group_size` sequences of `prompt_tokens` + a response each."""

    prompts: int
    group_size: int
    prompt_tokens: int
    responses: ResponseLengths
    reward_seconds_per_sequence: float = 0.0  # host time to score one response
    reward_workers: int = 1

    def __post_init__(self) -> None:
        for name in ("prompts", "group_size", "prompt_tokens", "reward_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.responses, ResponseLengths):
            raise ValueError(f"Workload.responses must be a ResponseLengths, got {self.responses!r}")
        if self.reward_seconds_per_sequence < 0:
            raise ValueError(f"Workload.reward_seconds_per_sequence must be >= 0, got {self.reward_seconds_per_sequence!r}")

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size

    @classmethod
    def w_plan(cls) -> Workload:
        """W-plan (shared/WORKLOADS.md): 512 prompts x 8, prompt 1k, responses log-normal, mean 4k, max 16k."""
        return cls(prompts=512, group_size=8, prompt_tokens=1024, responses=ResponseLengths.lognormal(4096, 16384))

    @classmethod
    def w_small(cls) -> Workload:
        """W-small: 8 prompts x 4, prompt 32, exactly 64 new tokens."""
        return cls(prompts=8, group_size=4, prompt_tokens=32, responses=ResponseLengths.fixed(64))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostInputs:
    hardware: HardwareSpec
    actor: ModelShape
    critic: ModelShape
    workload: Workload
    options: ExecutionOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCost:
    """One execution of a stage on one device of its placement (all devices run in parallel)."""

    seconds: float
    compute_seconds: float = 0.0
    memory_seconds: float = 0.0
    communication_seconds: float = 0.0
    overhead_seconds: float = 0.0
    flops: float = 0.0  # executed, whole stage (all devices)
    model_flops: float = 0.0  # useful work for MFU, whole stage
    transient_bytes: float = 0.0  # per device, live only while the stage runs
    piece_fractions: tuple[float, ...] = (1.0,)  # when each of its pieces completes, as fractions of `seconds`
    detail: Mapping[str, float] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------------------ batch shape
def batch_tokens(inputs: CostInputs) -> tuple[float, float, float]:
    """(tokens, attention pairs, response tokens) of the whole batch under the options' padding and kernel."""
    return _batch_tokens(inputs.workload, inputs.options)


@functools.lru_cache(maxsize=64)
def _batch_tokens(w: Workload, o: ExecutionOptions) -> tuple[float, float, float]:
    if o.sequence_packing:
        lengths = w.prompt_tokens + w.responses.sample(w.sequences)
    else:
        lengths = np.full(w.sequences, w.prompt_tokens + w.responses.max)
    pairs = float(costs.attention_pairs(lengths, o.attention).sum())
    responses = float(w.responses.sample(w.sequences).sum())
    return float(lengths.sum()), pairs, responses


def _useful_pairs(inputs: CostInputs) -> float:
    return _flash_pairs(inputs.workload)


@functools.lru_cache(maxsize=64)
def _flash_pairs(w: Workload) -> float:
    lengths = w.prompt_tokens + w.responses.sample(w.sequences)
    return float(costs.attention_pairs(lengths, costs.AttentionKernel.FLASH).sum())


def elementwise_bytes(shape: ModelShape, *, tokens: float, pairs: float, tensor: int, options: ExecutionOptions) -> float:
    """Memory traffic of the non-matmul work of one forward pass over `tokens` tokens (see the constants above)."""
    per_token = (ELEMENTWISE_PER_D * shape.hidden
                 + ELEMENTWISE_PER_QK * (shape.heads + shape.kv_heads) * shape.head_dim / tensor
                 + ELEMENTWISE_PER_F * shape.token_mlp / tensor) * shape.compute_bytes_each
    scores = DENSE_SCORE_BYTES * shape.heads / tensor * pairs if options.attention is costs.AttentionKernel.DENSE else 0.0
    return shape.layers * (per_token * tokens + scores)


def _passes(tokens_per_replica: float, options: ExecutionOptions, *, optimizer_steps: int, backward: bool,
            pieces: int, rows: int, replicas: int) -> int:
    """Forward(/backward) passes over the batch per epoch: the runtime's micro-batching (an inference stage's
    `pieces`, each in row micro-batches), or token-sized passes."""
    if options.update_microbatches is not None:
        if backward:
            return max(1, optimizer_steps) * options.update_microbatches
        return pieces * row_micro_batches(max(1, rows // pieces), options.inference_rows, shards=replicas)
    return max(max(1, optimizer_steps), math.ceil(tokens_per_replica / options.microbatch_tokens))


def _pass_batch(inputs: CostInputs, layout: Layout, *, backward: bool, optimizer_steps: int,
                pieces: int) -> tuple[float, float, int]:
    """(tokens, attention pairs, passes) of one epoch of a stage over the whole batch: packed rows as the runtime
    packs them (`packed_batches`), else the options' padded or real-token batch in its micro-batches."""
    o = inputs.options
    if o.packed_row_tokens is not None:
        if backward:
            packed = packed_batches.update_passes(inputs.workload, o.packed_row_tokens, minibatches=max(1, optimizer_steps),
                                                  shards=layout.replicas, kernel=o.attention)
        else:
            packed = packed_batches.inference_passes(inputs.workload, o.packed_row_tokens, pieces=pieces,
                                                     shards=layout.replicas, kernel=o.attention)
        return packed.tokens, packed.pairs, packed.passes
    tokens, pairs, _ = batch_tokens(inputs)
    passes = _passes(tokens / layout.replicas, o, optimizer_steps=optimizer_steps, backward=backward, pieces=pieces,
                     rows=inputs.workload.sequences, replicas=layout.replicas)
    return tokens, pairs, passes


def row_micro_batches(rows: int, limit: int | None, *, shards: int) -> int:
    """The runtime's row micro-batches of an inference stage over `rows` rows with at most `limit` rows each
    (`rpegjax.learners.inference.InferenceMicroBatching.micro_batches`): the fewest that divide the rows with each
    micro-batch split evenly over the `shards` row shards (rows that the shards do not divide are replicated)."""
    if limit is None or limit >= rows:
        return 1
    shards = shards if rows % shards == 0 else 1
    for count in range(1, rows + 1):
        if rows % count == 0 and rows // count <= limit and (rows // count) % shards == 0:
            return count
    raise ValueError(f"no micro-batch of at most {limit} rows splits {rows} rows into equal parts over {shards} row "
                     f"shards (Execution.inference_rows)")


# ------------------------------------------------------------------------------ forward and backward passes
def model_pass_cost(inputs: CostInputs, shape: ModelShape, layout: Layout, *, logits: bool, backward: bool,
                    epochs: int = 1, optimizer_steps: int = 0, pieces: int = 1, models: int = 1) -> StageCost:
    """Forward (log-probs / values) or forward + backward + optimiser (an update) over the whole batch; an
    inference stage of `pieces` micro-batches runs one pass per piece under the runtime's micro-batching, in one
    program with the passes of `models` - 1 other models (a fused unit: its memory holds all of theirs)."""
    hw, o, device = inputs.hardware, inputs.options, inputs.hardware.device
    tokens, pairs, passes = _pass_batch(inputs, layout, backward=backward, optimizer_steps=optimizer_steps, pieces=pieces)
    passes *= epochs
    per_replica = tokens / layout.replicas
    per_device = per_replica / layout.context  # a row's tokens are split over context
    bytes_each = shape.compute_bytes_each
    if backward:
        flops = costs.training_flops(shape, tokens=tokens, pairs=pairs, remat=o.remat)
        flops += 2 * shape.hidden * shape.vocab * tokens  # chunked log-probs recompute their logits backward
        forward_equivalents = 3 + (1 if o.remat is RematPolicy.FULL else 0)
        # DOTS recomputes the elementwise work (and FULL everything) of the forward once more
        traffic_equivalents = 1 + o.backward_traffic_ratio + (0 if o.remat is RematPolicy.NONE else 1)
        # all-reduces per layer: 2 forward, 2 backward (input gradients), 2 more for a recomputed forward
        tensor_reductions = 4 + (2 if o.remat is RematPolicy.FULL else 0)
        fsdp_gathers = 2 + (1 if o.remat is RematPolicy.FULL else 0)
    else:
        flops = costs.forward_flops(shape, tokens=tokens, pairs=pairs, logit_tokens=tokens if logits else 0)
        forward_equivalents, traffic_equivalents, tensor_reductions, fsdp_gathers = 1, 1, 2, 1
    moe = _expert_pass(inputs, shape, layout, tokens=tokens, device_tokens=per_device / (passes / epochs),
                       backward=backward, forward_equivalents=forward_equivalents)
    flops = (flops + moe.flops) * epochs
    matmul = epochs * (_compute_seconds(inputs, shape, tokens=tokens, pairs=pairs, logits=logits or backward,
                                        backward=backward) + moe.matmul_seconds) / layout.size
    # a pipeline stage runs L/p layers of every micro-batch: per-layer terms shrink by p, compute by layout.size
    stage_layers = math.ceil(shape.layers / layout.pipeline)
    stage_shape = expert_costs.with_layers(shape, stage_layers)
    elementwise = traffic_equivalents * epochs * elementwise_bytes(
        stage_shape, tokens=per_device, pairs=pairs / layout.replicas / layout.context, tensor=layout.tensor, options=o)
    memory = device.memory_seconds(elementwise + passes * shape.weight_bytes / layout.shards)
    tensor_bytes = per_device / (passes / epochs) * shape.hidden * bytes_each
    # sequence parallelism turns each all-reduce into a reduce-scatter + all-gather pair: the same ring bytes
    tensor_comm = passes * stage_layers * tensor_reductions * collectives.all_reduce_seconds(
        tensor_bytes, hw, layout.group("tensor"))
    tensor_comm += passes * stage_layers * _context_exchange_seconds(inputs, shape, layout, per_device / (passes / epochs),
                                                                     backward=backward)
    tensor_comm += passes * moe.dispatch_seconds * stage_layers / shape.layers  # a pipeline stage's sparse layers
    background = passes * fsdp_gathers * _weight_gather_seconds(shape, layout, hw, shape.param_bytes_each)
    optimizer = 0.0
    if backward:
        grad_bytes = shape.params * o.grad_bytes_per_param / (layout.tensor * layout.pipeline)
        background += passes * _weight_gather_seconds(shape, layout, hw, o.grad_bytes_per_param)
        background += epochs * optimizer_steps * collectives.all_reduce_seconds(
            grad_bytes / (layout.fsdp * layout.expert), hw, layout.group("data"))
        step_bytes = costs.optimizer_step_bytes(shape, state_bytes_per_param=o.optimizer_bytes_per_param,
                                                grad_bytes_per_param=o.grad_bytes_per_param)
        optimizer = epochs * optimizer_steps * device.memory_seconds(step_bytes / optimizer_shards(layout, o))
    busy = matmul + memory
    pipeline_comm = 0.0
    if layout.pipeline > 1:
        # 1F1B: m micro-batches per optimiser step (or per inference pass) fill p stages in (m + p − 1) slots;
        # each micro-batch sends its activations forward (and their gradients back) once per stage boundary
        micro_batches = max(1.0, passes / (epochs * max(1, optimizer_steps)))
        bubble = (micro_batches + layout.pipeline - 1) / micro_batches
        tensor_comm *= bubble
        busy *= bubble
        level = hw.level_index(0, dict(layout.strides).get("pipeline", 1))  # neighbouring stages are a stride apart
        pipeline_comm = (2 if backward else 1) * passes * collectives.point_to_point_seconds(
            tensor_bytes / layout.tensor, hw, level)
    exposed = max(0.0, background - busy) if o.overlap_collectives else background
    overhead = passes * forward_equivalents * stage_layers * o.kernels_per_layer * device.kernel_overhead_s
    overhead += device.dispatch_overhead_s
    seconds = busy + tensor_comm + pipeline_comm + exposed + optimizer + overhead
    useful = costs.model_flops(shape, tokens=_real_tokens(inputs), pairs=_useful_pairs(inputs), backward=backward) * epochs
    if not logits and not backward:
        useful -= 2 * shape.hidden * shape.vocab * _real_tokens(inputs) * epochs
    return StageCost(seconds=seconds, compute_seconds=matmul, memory_seconds=memory + optimizer,
                     communication_seconds=tensor_comm + pipeline_comm + exposed, overhead_seconds=overhead, flops=flops,
                     model_flops=useful, transient_bytes=_pass_transient_bytes(
                         inputs, shape, layout, backward, passes / epochs, tokens=tokens, pairs=pairs,
                         accumulating=backward and passes / epochs > max(1, optimizer_steps), models=models,
                         pieces=pieces) + moe.transient_bytes,
                     detail={"tensor_comm": tensor_comm, "background_comm": background, "optimizer": optimizer,
                             "passes": passes, "matmul": matmul, "elementwise": device.memory_seconds(elementwise)})


class _ExpertPass(NamedTuple):
    flops: float  # forward + backward FLOPs the expert matmuls run beyond the grouped work (whole batch)
    matmul_seconds: float  # their time on one device's worth of peak
    dispatch_seconds: float  # all-to-alls of one pass over every sparse layer
    transient_bytes: float  # one sparse layer's expert buffers while it runs


def _expert_pass(inputs: CostInputs, shape: ModelShape, layout: Layout, *, tokens: float, device_tokens: float,
                 backward: bool, forward_equivalents: int) -> _ExpertPass:
    """A MoE model's expert terms of one epoch of a pass (`rpegjax.perf.model.expert_costs`; zeros for a dense
    model): the expert work as the options run it, the dispatch and combine per sparse layer (2 forward, 2 backward, 2 for a
    recomputed forward) of `device_tokens` per device and pass, and the buffers they hold."""
    o = inputs.options
    row_tokens = _row_tokens(inputs, tokens)
    extra = forward_equivalents * expert_costs.extra_expert_flops(shape, o, tokens=tokens, row_tokens=row_tokens)
    exchanges = 2 * (1 + (1 if backward else 0) + (1 if backward and o.remat is RematPolicy.FULL else 0))
    return _ExpertPass(
        flops=extra, matmul_seconds=inputs.hardware.device.matmul_seconds(extra, shape.compute_dtype),
        dispatch_seconds=expert_costs.dispatch_seconds(shape, layout, inputs.hardware, tokens_per_device=device_tokens,
                                                  exchanges=exchanges),
        transient_bytes=expert_costs.layer_transient_bytes(shape, o, layout, tokens_per_device=device_tokens,
                                                      row_tokens=row_tokens, backward=backward))


def _row_tokens(inputs: CostInputs, tokens: float) -> float:
    """Tokens of one row of a pass (what the capacity mode's slots are counted on): a packed row, or a row padded to
    the longest sequence, or (real-token passes) the mean sequence."""
    o, w = inputs.options, inputs.workload
    if o.packed_row_tokens is not None:
        return float(o.packed_row_tokens)
    return float(w.prompt_tokens + w.responses.max) if not o.sequence_packing else tokens / w.sequences


def _weight_gather_seconds(shape: ModelShape, layout: Layout, hw: HardwareSpec, bytes_per_param: float) -> float:
    """One all-gather (or reduce-scatter) of every weight shard of one tensor x pipeline rank at `bytes_per_param`:
    the dense weights over fsdp x expert x context, a MoE model's experts over fsdp x context (their expert dim
    stays split: each device gathers only its x/p experts)."""
    split = layout.tensor * layout.pipeline
    expert_bytes = expert_costs.expert_params(shape) * bytes_per_param / split
    dense_bytes = shape.params * bytes_per_param / split - expert_bytes
    seconds = collectives.all_gather_seconds(dense_bytes, hw, layout.weight_group())
    if expert_bytes:
        seconds += collectives.all_gather_seconds(expert_bytes / layout.expert, hw, layout.weight_group(experts=True))
    return seconds


def optimizer_shards(layout: Layout, options: ExecutionOptions) -> int:
    """Ways the optimiser state is split: the parameters' shards, and under ZeRO-1 the data replicas too."""
    return layout.shards * (layout.data if options.optimizer_data_sharding else 1)


def optimizer_state_bytes(shape: ModelShape, layout: Layout, options: ExecutionOptions) -> float:
    """Per device: the optimiser state of `shape`'s parameters (`optimizer_bytes_per_param`)."""
    return shape.params * options.optimizer_bytes_per_param / optimizer_shards(layout, options)


def offload_seconds(shape: ModelShape, layout: Layout, inputs: CostInputs) -> float:
    """An update's host transfers of an offloaded optimiser state: in before it and out after it, each over every
    device's own host link at once. MemoryError (a plan that cannot run) on a device without a host link."""
    device = inputs.hardware.device
    if device.host_bandwidth <= 0:
        raise MemoryError(f"optimiser offload: {device.name} has no host link in the hardware description")
    return 2 * optimizer_state_bytes(shape, layout, inputs.options) / device.host_bandwidth


def _context_exchange_seconds(inputs: CostInputs, shape: ModelShape, layout: Layout, tokens: float, *,
                              backward: bool) -> float:
    """One layer's key/value exchange under context parallelism, on the critical path: keys and values all-gathered
    over the context devices in the forward (again when full remat recomputes it), their gradients reduce-scattered
    in the backward. `tokens`: this device's tokens of the pass."""
    if layout.context == 1:
        return 0.0
    o, hw = inputs.options, inputs.hardware
    kv_bytes = 2 * tokens * layout.context * shape.kv_heads * shape.head_dim * shape.compute_bytes_each / min(
        layout.tensor, shape.kv_heads)
    group = layout.group("context")
    gathers = 1 + (1 if backward and o.remat is RematPolicy.FULL else 0)
    seconds = gathers * collectives.all_gather_seconds(kv_bytes, hw, group)
    return seconds + (collectives.reduce_scatter_seconds(kv_bytes, hw, group) if backward else 0.0)


def _compute_seconds(inputs: CostInputs, shape: ModelShape, *, tokens: float, pairs: float, logits: bool,
                     backward: bool) -> float:
    """Matmul seconds of one pass over the batch on one device's worth of peak (divide by the devices): layer and
    logit matmuls at the matmul efficiency, attention at the attention efficiency; a backward pass does twice a
    forward's FLOPs at the device's backward efficiency; full remat repeats the layers' forward; chunked
    log-probs recompute their logits in the backward pass."""
    device, dtype, o = inputs.hardware.device, shape.compute_dtype, inputs.options
    layers = device.matmul_seconds(costs.forward_flops(shape, tokens=tokens, pairs=0, logit_tokens=0), dtype)
    attention = device.attention_seconds(costs.forward_flops(shape, tokens=0, pairs=pairs, logit_tokens=0), dtype)
    output = device.matmul_seconds(costs.forward_flops(shape, tokens=0, pairs=0, logit_tokens=tokens if logits else 0), dtype)
    forward = layers + attention + output
    if not backward:
        return forward
    recompute = layers + attention if o.remat is RematPolicy.FULL else 0.0
    return forward + 2 * forward / device.backward_efficiency + recompute + output


def _real_tokens(inputs: CostInputs) -> float:
    w = inputs.workload
    return float((w.prompt_tokens + w.responses.sample(w.sequences)).sum())


def _forward_transient_bytes(shape: ModelShape, layout: Layout, *, tokens_per_pass: float, keys_per_query: float,
                             logits: float, kernel: costs.AttentionKernel, models: int, looped: bool) -> float:
    """Peak transient bytes per device of a forward pass (an inference stage) of `models` models run one after the
    other in one program (a fused reference + policy unit: 2), `logits`: one log-prob chunk's logits; `looped`: the
    program runs its rows in more than one micro-batch (`lax.map`). Read from XLA's GPU compiler's buffer
    assignment of the Llama 3.1 8B fused packed log-prob pass (fsdp8, float32 masters, bfloat16 compute; 2, 4 and 32
    layers; docs/benchmarks.md, "Memory model against XLA's GPU compiler"):

    - the residual stream of every token into and out of the layer being run (the layer scan's carry);
    - each model's layer weights stacked for the layer scan as their compute-dtype casts (`models.transformer.
      _scan_layers`: built inside the micro-batch, every model's before the first scan runs) while the layers
      run, with the layer in use and the next gathered over FSDP and one layer's working set;
    - or, once the layers are done, every model's output matrix gathered whole as its compute-dtype cast (the
      log-prob passes cast before gathering, `models.logprobs.logprobs_from_hidden`) and one chunk's logits;
    - in a micro-batch loop, XLA's transposed copies of every model's o and down projections in the weights' own
      dtype, hoisted out of the loop for the whole program (its layout for the stack)."""
    b = shape.compute_bytes_each
    residual = 2 * tokens_per_pass * shape.hidden * b
    layer = tokens_per_pass * costs.forward_layer_bytes_per_token(shape, keys_per_query=keys_per_query, kernel=kernel,
                                                                  tensor=layout.tensor)
    gathered = layout.fsdp * layout.context * layout.expert > 1  # weights are sharded over fsdp x context x expert
    copied = gathered or shape.param_bytes_each != b  # gathered, or cast to the compute dtype
    layer_weights = 2 * expert_costs.layer_params_held(shape, layout) / layout.tensor * b if copied else 0.0
    output = shape.vocab * shape.hidden / layout.tensor * b if copied else 0.0
    expert_bytes = expert_costs.expert_params(shape) * shape.param_bytes_each  # experts are stacked uncast
    stack = (shape.layers * shape.matmul_params_per_layer * b + expert_bytes) / layout.shards
    transposed = 0.0
    if looped:
        mlp_layers = shape.layers - (0 if shape.experts is None else shape.experts.sparse_layers)
        transposed = (shape.layers * shape.heads * shape.head_dim + mlp_layers * shape.mlp) * shape.hidden
        transposed *= shape.param_bytes_each / layout.shards
    layers_phase = models * stack + layer_weights + layer
    logprob_phase = models * output + logits
    return residual + models * transposed + max(layers_phase, logprob_phase)


def _pass_transient_bytes(inputs: CostInputs, shape: ModelShape, layout: Layout, backward: bool, passes: float, *,
                          tokens: float, pairs: float, accumulating: bool = False, models: int = 1,
                          pieces: int = 1) -> float:
    """Peak transient bytes per device of one pass; `accumulating`: an update that sums its gradients over more
    than one micro-batch per optimiser step (`rpegjax.learners.update.accumulate_gradients`); `models`: forward
    passes of that many models in one program, `pieces` programs (`_forward_transient_bytes`)."""
    o, w = inputs.options, inputs.workload
    tokens_per_pass = tokens / layout.replicas / passes / layout.context
    keys_per_query = pairs / tokens
    if o.packed_row_tokens is not None:  # one packed row per row shard and pass
        rows, chunk_tokens = 1.0, min(o.logprob_chunk, o.packed_row_tokens)
    else:
        rows = max(1.0, w.sequences / layout.replicas / passes)
        chunk_tokens = min(o.logprob_chunk, w.prompt_tokens + w.responses.max)
    # context parallelism: every layer all-gathers its keys and values, a whole row's [t, k, e] each
    kv_gathered = (0.0 if layout.context == 1 else 2 * tokens_per_pass * layout.context * shape.kv_heads
                   * shape.head_dim * shape.compute_bytes_each / min(layout.tensor, shape.kv_heads))
    if not backward:
        logits = rows * chunk_tokens * shape.vocab / layout.tensor * shape.compute_bytes_each
        return kv_gathered + _forward_transient_bytes(
            shape, layout, tokens_per_pass=tokens_per_pass, keys_per_query=keys_per_query, logits=logits,
            kernel=o.attention, models=models, looped=passes > pieces)
    return kv_gathered + _update_transient_bytes(inputs, shape, layout, tokens_per_pass=tokens_per_pass,
                                                 keys_per_query=keys_per_query, rows=rows, chunk_tokens=chunk_tokens,
                                                 accumulating=accumulating)


def _update_transient_bytes(inputs: CostInputs, shape: ModelShape, layout: Layout, *, tokens_per_pass: float,
                            keys_per_query: float, rows: float, chunk_tokens: int, accumulating: bool) -> float:
    """Peak transient bytes per device of an update's forward and backward pass: what the layers keep for the
    backward and the gradients, live throughout, and the larger of two phases that are never live together (read
    from XLA's GPU compiler's buffer assignment of the 7B update, fsdp8, and the Qwen3-32B one, d2 x f8 x t2;
    docs/benchmarks.md, "W-long"):

    - the log-prob head: the output matrix's compute-dtype cast gathered whole, each chunk's dW (a compute-dtype
      dot output of the whole matrix's shape) and their float32 sum, and one float32 chunk of logits. The sum is
      reduce-scattered and the gathered cast freed before the layers' backward starts (`models.logprobs.
      _ChunkLoop`'s optimization barrier);
    - the layers: the layer in use and the one being prefetched, gathered as their compute-dtype casts, one
      layer's working set while it is recomputed and differentiated, with full remat the layer scan's stacked
      compute-dtype kernels (built for the backward loop only, run by run), and in a micro-batch loop
      (without full remat) the backward scan's own stacked compute-dtype gradients beside the running sum."""
    o = inputs.options
    b = shape.compute_bytes_each
    fsdp = layout.fsdp * layout.context * layout.expert > 1  # weights sharded over fsdp x context x expert
    # one float32 chunk of logits: XLA's GPU compiler fuses the log-softmax and its gradient into it (0.5B updates,
    # XLA:CPU keeps all three)
    head = costs.logprob_chunk_bytes(shape, rows=rows, chunk=chunk_tokens, tensor=layout.tensor, copies=1)
    if fsdp:
        # FSDP gathers the output matrix whole for the update (every log-prob chunk reads it). The token lookup
        # reads its own shard of the table (never gathered whole); with tied embeddings its gradient is added to
        # the output's. Large for big vocabularies (Qwen2.5: 152k x d)
        head += shape.vocab * shape.hidden * (2 * b + 4) / layout.tensor
    layers = 2 * expert_costs.layer_params_held(shape, layout) * b / layout.tensor if fsdp else 0.0
    activations = costs.training_activation_bytes(shape, tokens=tokens_per_pass, keys_per_query=keys_per_query,
                                                  kernel=o.attention, remat=o.remat, tensor=layout.tensor)
    if o.remat is not RematPolicy.NONE:  # one layer's working set, live in the layers' phase only
        working = tokens_per_pass * costs.layer_activation_bytes_per_token(
            shape, keys_per_query=keys_per_query, kernel=o.attention, tensor=layout.tensor)
        activations -= working
        layers += working
    if layout.sequence_parallel and o.remat is not RematPolicy.NONE:  # each layer's kept input split over tensor too
        activations -= tokens_per_pass * shape.layers * shape.hidden * b * (1 - 1 / layout.tensor)
    grads = shape.params * o.grad_bytes_per_param / layout.shards
    layer_grads = shape.layers * shape.matmul_params_per_layer / layout.shards  # parameters
    shared = o.remat is RematPolicy.FULL and shape.experts is None
    if shared:
        # the layer scan's stacked compute-dtype kernels and their gradients share one buffer, built for the backward
        # loop only: the forward loop reads each layer's own arrays and the log-prob head runs with no stack live
        # (`rpegjax.models.layer_scan.remat_scan`); no float32 copy of the layers' gradients is live at either peak
        # (GPU compiler's buffer assignment of the 7B update, docs/benchmarks.md "W-long")
        grads -= layer_grads * o.grad_bytes_per_param
        # split into runs (`options.remat_runs`), whose kept inputs are freed run by run and whose stacks are built
        # run by run: the k-th backward run of n holds the kept inputs of the n-k+1 runs not done and k runs' stacks
        # (the runs done keep their gradients in theirs), largest at the first backward run or the last
        stack, runs = layer_grads * b, remat_runs(shape.layers)
        kept = tokens_per_pass * shape.layers * shape.hidden * b
        if layout.sequence_parallel:
            kept /= layout.tensor
        layers += max(stack / runs, stack - kept * (1 - 1 / runs))
    if accumulating and shared:
        # the micro-batch loop carries the float32 running sum of the layers' gradients beside that shared buffer,
        # through both phases (XLA's GPU compiler's buffer assignment of the 7B packed update, 2 and 4 layers)
        grads += layer_grads * o.grad_bytes_per_param
    elif accumulating:
        # the running sum is the gradients counted above; the pass's backward scan writes its own stacked
        # compute-dtype gradients beside it, in the layers' phase only (the Qwen3-32B DOTS update's buffer assignment)
        layers += layer_grads * b
    return activations + grads + max(head, layers)


# ------------------------------------------------------------------------------------- host and small stages
def reward_cost(inputs: CostInputs) -> StageCost:
    w = inputs.workload
    return StageCost(seconds=w.sequences * w.reward_seconds_per_sequence / w.reward_workers)


def advantage_cost(inputs: CostInputs, layout: Layout) -> StageCost:
    """Group statistics or GAE over [b, t] float32 arrays: a few streaming passes, dominated by dispatch."""
    tokens, _, _ = batch_tokens(inputs)
    device = inputs.hardware.device
    memory = device.memory_seconds(8 * 4 * tokens / layout.replicas)
    return StageCost(seconds=memory + device.dispatch_overhead_s, memory_seconds=memory,
                     overhead_seconds=device.dispatch_overhead_s)


def reshard_seconds(shape: ModelShape, source: Layout, target: Layout, hardware: HardwareSpec, *, same_devices: bool,
                    crossing_level: int, senders: int, receivers: int) -> float:
    """Moving one model's weights from the `source` layout to the `target` layout.

    Same devices and layout: a copy. Same devices: each device gathers its target shard (weights / target shards) from the source shards held
    by its group — an all-gather over the source shard group reduced by what the target still shards.
    Different devices: the weights cross level `crossing_level` split over min(senders, receivers) links, then
    the receivers all-gather their target shards among the target's replicas.
    """
    weights = float(shape.weight_bytes)
    if same_devices:
        if (source.fsdp, source.tensor) == (target.fsdp, target.tensor):
            # still a copy: the runtime never lets the generation weights alias the training buffers, which the
            # next update donates
            return hardware.device.memory_seconds(2 * weights / target.shards)
        group = max(1, source.shards // max(1, target.shards))
        return collectives.all_gather_seconds(weights / target.shards, hardware, collectives.Group(size=group, stride=source.tensor))
    level = hardware.levels[crossing_level]
    links = max(1, min(senders, receivers))
    first_hop = weights / links / level.bandwidth + level.latency
    spread = collectives.all_gather_seconds(weights / target.shards, hardware,
                                            collectives.Group(size=max(1, receivers // target.shards), stride=target.shards))
    return first_hop + spread
