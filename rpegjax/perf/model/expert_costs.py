"""Cost terms of mixture-of-experts layers (Qwen3-MoE) with expert parallelism over an `expert` mesh axis.

A sparse layer routes each token to k of x experts (each a SwiGLU MLP of width f_e) through a router (d x x);
the other layers keep a dense MLP of width f. Per token the layer stack computes the *active* parameters (k
experts), while memory holds *all* of them. With an `expert` axis of size p (`rpegjax.sharding.rules`), each
device holds x/p experts, and the expert axis is data-like for everything else: rows split over it and the dense
weights' embedding dimension too (as over fsdp). Per sparse layer and pass the tokens cross the expert devices
twice (dispatch, combine): an all-to-all of n·k·d values per device (n tokens of the device); the backward pass
exchanges the gradients of both, a fully rematerialised forward both again.

How the expert matmuls run decides their work and memory (per device, sparse layer, pass of n tokens):
* grouped GEMMs (Megatron's grouped GEMM, vLLM's fused MoE): n·k·3·d·f_e multiply-adds, nothing padded;
* rpegjax's capacity mode (`moe_capacity_factor` c): batched GEMMs over [x/p, p·rows·C, d] buffers,
  C = min(t, ceil(c·t·k/x)) slots per expert and row of t tokens: x·C/(t·k) ≈ c times the grouped work, and the
  buffers (sent, received, returned, and the f_e-wide gate, up and product) live while the layer runs;
* rpegjax's dropless mode on GPU: XLA rewrites `jax.lax.ragged_dot` as a dense batched GEMM over all x/p local
  experts of the worst-case receive buffer of p·n·k rows (`docs/benchmarks.md`, "W-long"): x times the grouped
  work, and that buffer times every local expert's width in memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from rpegjax.perf.model import collectives

if TYPE_CHECKING:  # costs and stage_costs import this module
    from rpegjax.perf.model.costs import ModelShape
    from rpegjax.perf.model.hardware import HardwareSpec
    from rpegjax.perf.model.stage_costs import ExecutionOptions, Layout


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """The sparse layers of a mixture-of-experts decoder: `sparse_layers` of the model's layers route each token to
    `top_k` of `experts` experts of width `mlp`; `capacity_factor` None runs them dropless, c > 0 in rpegjax's
    capacity mode (`ModelConfig.moe_capacity_factor`)."""

    experts: int
    top_k: int
    mlp: int
    sparse_layers: int
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "mlp", "sparse_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ExpertShape.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"ExpertShape.top_k ({self.top_k}) exceeds experts ({self.experts})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"ExpertShape.capacity_factor must be None (dropless) or > 0, got {self.capacity_factor!r}")

    def capacity_slots(self, row_tokens: float) -> int:
        """C: slots per expert and row of `row_tokens` tokens (`rpegjax.models.expert_parallel.capacity`)."""
        t = max(1, math.ceil(row_tokens))
        return min(t, math.ceil(self.capacity_factor * t * self.top_k / self.experts))


# ------------------------------------------------------------------------------------------ parameter counts
def with_layers(shape: ModelShape, layers: int) -> ModelShape:
    """`shape` cut to `layers` layers (a pipeline stage's), its sparse layers in proportion (at least one)."""
    e = shape.experts
    if e is not None:
        e = dataclasses.replace(e, sparse_layers=max(1, min(layers, round(e.sparse_layers * layers / shape.layers))))
    return dataclasses.replace(shape, layers=layers, experts=e)


def expert_params(shape: ModelShape) -> int:
    """All experts' matrices (3·d·f_e each, x per sparse layer); 0 for a dense model."""
    e = shape.experts
    return 0 if e is None else e.sparse_layers * e.experts * 3 * shape.hidden * e.mlp


def layer_params_held(shape: ModelShape, layout: Layout) -> float:
    """Matmul parameters of the largest layer one device holds at once when it runs that layer, before any
    tensor split: the whole layer for a dense model (`ModelShape.matmul_params_per_layer`); for a MoE model the
    attention, the router and its x/p local experts (a sparse layer), or the dense MLP, whichever is larger."""
    e = shape.experts
    if e is None:
        return shape.matmul_params_per_layer
    d = shape.hidden
    sparse = d * e.experts + 3 * d * e.mlp * e.experts / layout.expert
    dense = 3 * d * shape.mlp if e.sparse_layers < shape.layers else 0
    return shape.attention_params_per_layer + max(sparse, dense)


# ------------------------------------------------------------------------------------- work of the experts
def computed_expert_ratio(shape: ModelShape, options: ExecutionOptions, *, row_tokens: float) -> float:
    """Expert matmul work as run / the grouped work (n·k·3·d·f_e per sparse layer): 1 with grouped GEMMs, x·C/(t·k)
    in the capacity mode, x in rpegjax's dropless mode without grouped GEMMs (see the module docstring)."""
    e = shape.experts
    if e is None:
        return 1.0
    if e.capacity_factor is not None:
        return e.experts * e.capacity_slots(row_tokens) / (max(1.0, row_tokens) * e.top_k)
    return 1.0 if options.grouped_expert_gemm else float(e.experts)


def extra_expert_flops(shape: ModelShape, options: ExecutionOptions, *, tokens: float, row_tokens: float) -> float:
    """Forward FLOPs the expert matmuls run beyond the grouped work, over `tokens` tokens (whole batch)."""
    e = shape.experts
    if e is None:
        return 0.0
    grouped = 2 * tokens * e.sparse_layers * e.top_k * 3 * shape.hidden * e.mlp
    return grouped * (computed_expert_ratio(shape, options, row_tokens=row_tokens) - 1.0)


def exchanged_rows_per_token(shape: ModelShape) -> float:
    """Rows one token sends to the expert devices per sparse layer: k (dropless sends the real assignments), or
    the capacity buffers' x·C/t per token, sent whole (empty slots too)."""
    e = shape.experts
    return float(e.top_k) if e.capacity_factor is None else e.top_k * max(1.0, e.capacity_factor)


def dispatch_seconds(shape: ModelShape, layout: Layout, hardware: HardwareSpec, *, tokens_per_device: float,
                     exchanges: int) -> float:
    """`exchanges` all-to-alls per sparse layer (2 forward: dispatch and combine; 2 more backward, 2 more for a
    recomputed forward) of one pass with `tokens_per_device` tokens on each device of the expert group: each
    device sends tokens·(rows per token)·d values, (p−1)/p of them to other devices, inside and across nodes
    (`collectives.all_to_all_seconds` on the expert axis's devices)."""
    e = shape.experts
    if e is None or layout.expert == 1:
        return 0.0
    num_bytes = tokens_per_device * exchanged_rows_per_token(shape) * shape.hidden * shape.compute_bytes_each
    return e.sparse_layers * exchanges * collectives.all_to_all_seconds(num_bytes, hardware, layout.group("expert"))


def layer_transient_bytes(shape: ModelShape, options: ExecutionOptions, layout: Layout, *, tokens_per_device: float,
                          row_tokens: float, backward: bool) -> float:
    """Bytes one sparse layer's expert computation holds on a device while it runs, beyond the dense layer's
    working set (`rpegjax.perf.model.costs`), for a pass of `tokens_per_device` tokens:
    * grouped GEMMs: the dispatched rows (n·k·d, sent and received) and the f_e-wide gate, up and product;
    * the capacity mode: the same over the capacity buffers (x·C/t rows per token instead of k);
    * rpegjax's dropless mode without grouped GEMMs: the p·n·k-row receive buffer (received, regrouped and
      returned, d wide), its gate, up and product over every local expert (3·x/p·f_e wide) and the down
      projection's dense product over the local experts (x/p·d wide).
    A backward pass holds the gradients of the same buffers beside them (twice the forward set)."""
    e = shape.experts
    if e is None:
        return 0.0
    b, d, t = shape.compute_bytes_each, shape.hidden, layout.tensor
    if e.capacity_factor is None and not options.grouped_expert_gemm:
        rows = layout.expert * tokens_per_device * e.top_k
        local = e.experts / layout.expert
        per_row = 3 * d + 3 * local * e.mlp / t + local * d
    else:
        rows = tokens_per_device * (e.top_k if e.capacity_factor is None else
                                    e.experts * e.capacity_slots(row_tokens) / max(1.0, row_tokens))
        per_row = 4 * d + 3 * e.mlp / t
    return (2 if backward else 1) * rows * per_row * b


# ------------------------------------------------------------------------------------------------ decoding
def decode_weight_terms(shape: ModelShape, layout: Layout) -> tuple[float, float, float]:
    """(dense bytes, all local experts' bytes, miss) that one device reads in decode steps. A step of r rows per
    replica reads its tensor share of the dense weights and of the experts some token of the p replicas of its
    expert group picked: E[hit] = (x/p)·(1 − (1 − k/x)^(p·r)) of its x/p local ones (tokens routed uniformly: a
    fair bound for balanced routers), i.e. the share 1 − miss^r with miss = (1 − k/x)^p; the step model costs
    each step's experts by the rows it decodes (`DecodeStepCost.memory_seconds`)."""
    e = shape.experts
    if e is None:
        return shape.weight_bytes / layout.tensor, 0.0, 1.0
    dense = (shape.params - expert_params(shape)) * shape.param_bytes_each / layout.tensor
    local = e.sparse_layers * e.experts / layout.expert * 3 * shape.hidden * e.mlp * shape.param_bytes_each / layout.tensor
    return dense, local, (1.0 - e.top_k / e.experts) ** layout.expert


def generation_copy_params(shape: ModelShape, layout: Layout) -> float:
    """Parameters of the sampler's weights on one device: split over tensor, a MoE model's experts over the
    generation layout's expert axis too (the other axes hold slots)."""
    experts = expert_params(shape)
    return (shape.params - experts) / layout.tensor + experts / (layout.tensor * layout.expert)


def decode_dispatch_terms(shape: ModelShape, layout: Layout, hardware: HardwareSpec) -> tuple[float, float]:
    """(seconds per step, seconds per processed row) of a decode step's dispatch and combine over the expert axis:
    2 all-to-alls per sparse layer, their latency every step and their bytes (k·d per row) for the rows the step
    decodes, as the tensor all-reduces (`DecodeStepCost.comm_seconds_per_row`): a live bucket or a serving
    engine's batch sends the running rows, not every slot."""
    e = shape.experts
    if e is None or layout.expert == 1:
        return 0.0, 0.0
    latency = e.sparse_layers * 2 * collectives.all_to_all_latency(hardware, layout.group("expert"))
    return latency, dispatch_seconds(shape, layout, hardware, tokens_per_device=1.0, exchanges=2) - latency


__all__ = ["ExpertShape", "with_layers", "computed_expert_ratio", "decode_dispatch_terms",
           "decode_weight_terms", "dispatch_seconds", "exchanged_rows_per_token", "expert_params",
           "extra_expert_flops", "generation_copy_params", "layer_params_held", "layer_transient_bytes"]
