"""The planner's search space: the choices it enumerates (`PlanSpace`) and the device layouts and splits they
expand to.

A skeleton of the space is a critic mode, a split of the devices between generation and training (or none:
colocated), a generation layout (data x tensor, and expert for a mixture-of-experts model), a training layout
(data x fsdp [x expert] [x context] x tensor) and one execution of `PlanSpace.executions`; its variants add the
asynchrony bound, fusion and generation micro-batches (`rpegjax.perf.planner.search`).
"""

from __future__ import annotations

import dataclasses
import itertools

from rpegjax.graph.ir import CriticMode, Execution
from rpegjax.options import AttentionKind, CacheLayout, DecodeAttention, DType, OptimizerSharding, RematPolicy

# generate seconds within which slot counts count as equally fast: the partial-rollout simulation's sampling
# error is ~1% of them (`partial_rollouts.MEASURED_STEPS`), and slots that buy no time only cost memory
SLOT_TOLERANCE = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpace:
    """The choices the planner enumerates (fractions of devices given to generation; None = colocated)."""

    async_bounds: tuple[int, ...] = (0, 1, 2)
    critic_modes: tuple[CriticMode, ...] = (CriticMode.SEPARATE, CriticMode.SHARED)
    fusion: tuple[bool, ...] = (False, True)
    microbatches: tuple[int, ...] = (1, 4)
    generation_fractions: tuple[float | None, ...] = (None, 0.25, 0.375, 0.5, 0.625, 0.75)
    tensor_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_sizes: tuple[int, ...] = (1,)  # training layouts' context axis (one row's sequence over its devices)
    sequence_parallel: tuple[bool, ...] = (False,)  # the residual stream split over tensor too (Execution field)
    reshard_inference: tuple[bool, ...] = (False, True)
    # those the hardware cannot run are skipped; cuDNN first, so that GPUs with bfloat16 get the fused kernel
    attention: tuple[AttentionKind, ...] = (AttentionKind.CUDNN, AttentionKind.BLOCKWISE, AttentionKind.DENSE)
    remat: tuple[RematPolicy, ...] = (RematPolicy.FULL, RematPolicy.DOTS, RematPolicy.NONE)
    update_microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)  # the fewest that fit are taken
    # row micro-batches of every inference stage (Execution.inference_rows = rows / this): the fewest that fit
    inference_microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    param_dtype: DType = DType.FLOAT32  # master weights and optimiser moments
    dtype: DType = DType.BFLOAT16  # matmul compute
    # the sampler's KV cache: paged (a pool of what the generation phase leaves of the usable memory, as vLLM's
    # gpu_memory_utilization sizes its cache; contiguous where a replica cannot hold a whole group) or
    # contiguous (every slot reserves its capacity)
    kv_cache: CacheLayout = CacheLayout.PAGED
    # the paged sampler's decode attention (`Execution.decode_attention`): XLA's gather over the longest row's
    # window, and/or the Pallas paged kernel (each row over its own pages; GPUs only, skipped elsewhere); gather
    # only for a contiguous cache. Gather alone in the library's default space (its searches and tests stay as
    # fast), both in scripts/plan.py's
    decode_attention: tuple[DecodeAttention, ...] = (DecodeAttention.GATHER,)
    # AdamW's state split over the data replicas too (ZeRO-1: less memory, the same traffic, so always taken), and
    # offloaded to host memory while generation runs (colocated plans on devices with a host link)
    optimizer_sharding: OptimizerSharding = OptimizerSharding.DATA
    optimizer_offload: tuple[bool, ...] = (False, True)
    # sequence packing (Execution.packing): rows padded to the longest, or sequences packed into rows of a token
    # budget; the budget is fitted per plan: of these multiples of the longest sequence (rounded up to whole
    # attention blocks, and for context parallelism to 2 x context blocks), the fastest whose stages fit
    packing: tuple[bool, ...] = (False, True)
    packed_rows: tuple[int, ...] = (64, 32, 16, 8, 4, 2, 1)
    # partial rollouts (`Execution.partial_rollouts`: two batches in flight, tokens lagging at most k + 2 versions;
    # `rpegjax.perf.model.partial_rollouts` models them), for colocated plans (the runtime runs them on shared processes);
    # off in the library's default space (its searches and tests stay as fast), on and off in scripts/plan.py's
    partial_rollouts: tuple[bool, ...] = (False,)
    inflight_batches: tuple[int, ...] = (2, 3)  # of a plan with partial rollouts (more: busier slots, older tokens)
    # a mixture-of-experts model's experts (`Execution.moe_capacity_factor`): dropless (None) or in the capacity mode
    # of each factor; dense models take None only. The perf model costs memory and time, not the tokens a factor
    # drops, so the fastest factor that fits wins: list only factors whose drops the run accepts
    moe_capacity_factors: tuple[float | None, ...] = (None,)
    # the least share of the sampler's slots running on average over generation (`slot_busy`) a plan may have:
    # a constraint the user sets (0: none); the sampler's slot count is chosen among those that meet it
    min_slot_busy: float = 0.0
    # the sampler takes the fewest slots whose generation is within this share of the fastest (`Fitter._fastest_slots`);
    # the reference plans take the fastest (0), as a serving engine fills the memory it is given
    slot_tolerance: float = SLOT_TOLERANCE

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "critic_modes", tuple(CriticMode(m) for m in self.critic_modes))
        except ValueError:
            raise ValueError(f"PlanSpace.critic_modes must hold {[m.value for m in CriticMode]}, got {self.critic_modes!r}") from None
        for name in ("async_bounds", "critic_modes", "fusion", "microbatches", "generation_fractions", "tensor_sizes",
                     "context_sizes", "sequence_parallel", "reshard_inference", "attention", "remat",
                     "update_microbatches", "inference_microbatches", "optimizer_offload", "packing", "packed_rows",
                     "partial_rollouts", "inflight_batches", "moe_capacity_factors", "decode_attention"):
            if not getattr(self, name):
                raise ValueError(f"PlanSpace.{name} must list at least one choice")
        if any(k < 0 for k in self.async_bounds) or any(m < 1 for m in self.microbatches) or any(
                t < 1 for t in (*self.tensor_sizes, *self.context_sizes)):
            raise ValueError(f"PlanSpace: async bounds >= 0, micro-batches and tensor sizes >= 1, got {self}")
        if any(f is not None and not 0 < f < 1 for f in self.generation_fractions):
            raise ValueError(f"PlanSpace.generation_fractions must be None or in (0, 1), got {self.generation_fractions}")
        if not 0 <= self.min_slot_busy <= 1:
            raise ValueError(f"PlanSpace.min_slot_busy must be in [0, 1], got {self.min_slot_busy!r}")
        if self.slot_tolerance < 0:
            raise ValueError(f"PlanSpace.slot_tolerance must be >= 0, got {self.slot_tolerance!r}")
        if any(m < 1 for m in (*self.update_microbatches, *self.inference_microbatches, *self.packed_rows)):
            raise ValueError(f"PlanSpace: update and inference micro-batches and packed rows must be >= 1, got {self}")
        object.__setattr__(self, "update_microbatches", tuple(sorted(self.update_microbatches)))
        object.__setattr__(self, "inference_microbatches", tuple(sorted(self.inference_microbatches)))
        object.__setattr__(self, "packed_rows", tuple(sorted(set(self.packed_rows), reverse=True)))
        for execution in self.executions():  # validates the values (GraphError names the field)
            del execution

    def executions(self, longest: int = 1, *, experts: bool = True) -> list[Execution]:
        """Every (attention, remat, offload, sequence parallelism, packing, partial rollouts, decode attention,
        expert capacity) execution of the space, with its precision, KV cache and optimiser sharding (micro-batches
        1; packed rows of the largest multiple of the `longest` sequence, until `Fitter.fit` fits the
        budget); without `experts` (a dense model) only dropless, the one a dense model runs."""
        partial = [dict(partial_rollouts=False)] * (False in self.partial_rollouts) + [
            dict(partial_rollouts=True, inflight_batches=batches) for batches in self.inflight_batches
            if True in self.partial_rollouts]
        capacities = self.moe_capacity_factors if experts else (None,)
        decode = self.decode_attention if self.kv_cache is CacheLayout.PAGED else (DecodeAttention.GATHER,)
        return [Execution(attention=attention, remat=remat, scan_layers=True, kv_cache=self.kv_cache,
                          decode_attention=decode_attention,
                          param_dtype=self.param_dtype, dtype=self.dtype, optimizer_sharding=self.optimizer_sharding,
                          optimizer_offload=offload, sequence_parallel=sequence_parallel, packing=packing,
                          max_tokens_per_micro_batch=self.packed_rows[0] * longest if packing else None,
                          moe_capacity_factor=capacity, **rollouts)
                for attention, remat, offload, sequence_parallel, packing, rollouts, decode_attention, capacity in
                itertools.product(self.attention, self.remat, self.optimizer_offload, self.sequence_parallel,
                                  self.packing, partial, dict.fromkeys(decode), capacities)]


def layouts(num_devices: int, tensor_sizes: tuple[int, ...], *, heads: int, kv_heads: int, node_size: int,
            with_fsdp: bool, context_sizes: tuple[int, ...] = (1,),
            expert_sizes: tuple[int, ...] = (1,)) -> list[tuple[tuple[str, int], ...]]:
    """(data, fsdp, tensor) layouts of `num_devices`: tensor inside a node dividing the head count; fsdp powers of 2;
    with `context_sizes` other than 1, (data, fsdp, context, tensor) layouts too; with `expert_sizes` other than 1
    (a mixture-of-experts model's, `expert_axis_sizes`), (data, fsdp, expert, [context,] tensor) layouts too."""
    out = []
    for tensor, context, expert in itertools.product(tensor_sizes, context_sizes, expert_sizes):
        if tensor > node_size or heads % tensor or num_devices % (tensor * context * expert):
            continue
        rest = num_devices // (tensor * context * expert)
        fsdp_sizes = [f for f in (2**i for i in range(rest.bit_length())) if rest % f == 0] if with_fsdp else [1]
        for fsdp in fsdp_sizes:
            middle = (("expert", expert),) if expert > 1 else ()
            middle += (("context", context),) if context > 1 else ()
            out.append((("data", rest // fsdp), ("fsdp", fsdp), *middle, ("tensor", tensor)))
    return out


def stage_layouts(space: PlanSpace, shape, hardware, generation_devices: int, train_devices: int) -> tuple[list, list]:
    """(generation layouts, training layouts) of the space, both with the model's expert axis sizes (the sampler
    splits experts over `expert` as training does)."""
    kwargs = dict(heads=shape.heads, kv_heads=shape.kv_heads, node_size=hardware.node_size)
    return (layouts(generation_devices, space.tensor_sizes, with_fsdp=False,
                    expert_sizes=expert_axis_sizes(shape, generation_devices), **kwargs),
            layouts(train_devices, space.tensor_sizes, with_fsdp=True, context_sizes=space.context_sizes,
                    expert_sizes=expert_axis_sizes(shape, train_devices), **kwargs))


def expert_axis_sizes(shape, num_devices: int) -> tuple[int, ...]:
    """The expert axis sizes a model's layouts take on `num_devices` devices: 1 for a dense model; for a
    mixture-of-experts one every size dividing both its expert count and the devices (the runtime splits the
    experts evenly, `rpegjax.models.expert_parallel`)."""
    if shape.experts is None:
        return (1,)
    count = shape.experts.experts
    return tuple(p for p in range(1, min(count, num_devices) + 1) if count % p == 0 and num_devices % p == 0)


def generation_splits(num_devices: int, fractions: tuple[float | None, ...], node_size: int) -> list[int]:
    splits = []
    for fraction in fractions:
        if fraction is None:
            splits.append(0)
            continue
        unit = node_size if num_devices >= 2 * node_size else 1
        g = int(round(num_devices * fraction / unit)) * unit
        if 0 < g < num_devices:
            splits.append(g)
    return sorted(set(splits))


def within_staleness(execution: Execution, async_bound: int, staleness: int) -> bool:
    """Whether a plan of this execution at `async_bound` trains no token older than `staleness` versions: a
    partial-rollout plan's tokens lag up to its `max_token_lag` (k + 2 by default), not only k."""
    if not execution.partial_rollouts:
        return True
    return (async_bound + 2 if execution.max_token_lag is None else execution.max_token_lag) <= staleness
