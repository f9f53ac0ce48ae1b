"""Pipeline-parallel pretraining iterations (Megatron-LM style), to check the cost model against published runs.

The RL planner never pipelines, but published large-model measurements do; predicting them with the same
formulas (`costs`, `stage_costs`, `collectives`, `hardware`) checks those formulas at a scale this machine
cannot reach. One iteration of the 1F1B schedule with p stages and m micro-batches per data-parallel rank takes

    (m + p − 1) · (forward + backward of one micro-batch on the slowest stage)
    + the data-parallel gradient all-reduce + the optimiser step,

where a stage holds L/p layers (the last one also the output layer), tensor parallelism with sequence
parallelism costs 4 all-reduce-equivalents per layer and micro-batch on the node level, activations cross
stages point to point, and selective recomputation re-runs the attention scores in the backward pass.
"""

from __future__ import annotations

import dataclasses
import enum

from rpegjax.options import RematPolicy
from rpegjax.perf.model import collectives, costs
from rpegjax.perf.model.costs import AttentionKernel, ModelShape
from rpegjax.perf.model.hardware import HardwareSpec
from rpegjax.perf.model.stage_costs import ExecutionOptions, elementwise_bytes


class Recompute(enum.StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # attention scores/softmax recomputed (Korthikanti et al. 2022)
    FULL = "full"  # every layer recomputed


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineRun:
    """A pretraining configuration and, for published runs, what was measured."""

    name: str
    shape: ModelShape
    seq_len: int
    global_batch: int
    micro_batch: int
    tensor: int
    pipeline: int
    data: int
    recompute: Recompute = Recompute.SELECTIVE
    measured_seconds: float | None = None
    measured_mfu: float | None = None
    source: str = ""

    @property
    def devices(self) -> int:
        return self.tensor * self.pipeline * self.data


def iteration_seconds(run: PipelineRun, hardware: HardwareSpec) -> dict[str, float]:
    """Predicted seconds of one iteration and its parts (see the module docstring)."""
    shape, device = run.shape, hardware.device
    if run.global_batch % (run.micro_batch * run.data):
        raise ValueError(f"run {run.name!r}: global batch {run.global_batch} is not a multiple of micro batch x data")
    if shape.layers % run.pipeline:
        raise ValueError(f"run {run.name!r}: {shape.layers} layers do not split into {run.pipeline} stages")
    micro_batches = run.global_batch // (run.micro_batch * run.data)
    tokens = run.micro_batch * run.seq_len
    pairs = run.micro_batch * costs.attention_pairs(run.seq_len, AttentionKernel.DENSE)  # Megatron masks a full s x s
    stage_layers = shape.layers // run.pipeline
    layer_shape = dataclasses.replace(shape, layers=stage_layers)
    flops = costs.training_flops(layer_shape, tokens=tokens, pairs=pairs, remat=RematPolicy.NONE)
    flops -= 3 * 2 * shape.hidden * shape.vocab * tokens  # the logits are counted once, below, on the last stage
    if run.recompute is Recompute.SELECTIVE:
        flops += 4 * stage_layers * shape.heads * shape.head_dim * pairs
    elif run.recompute is Recompute.FULL:
        flops += costs.forward_flops(layer_shape, tokens=tokens, pairs=pairs, logit_tokens=0)
    flops += 3 * 2 * shape.hidden * shape.vocab * tokens  # output layer on the last stage (the slowest)
    matmul = device.matmul_seconds(flops / run.tensor, shape.compute_dtype)
    elementwise = 3 * elementwise_bytes(layer_shape, tokens=tokens, pairs=pairs, tensor=run.tensor,
                                         options=ExecutionOptions(attention=AttentionKernel.DENSE))
    activation_bytes = tokens * shape.hidden * shape.compute_bytes_each
    tensor_comm = 4 * stage_layers * collectives.all_reduce_seconds(
        activation_bytes, hardware, collectives.Group(size=run.tensor))
    # with tensor x pipeline ranks laid out tensor-fastest, neighbouring stages sit in different nodes
    p2p = 0.0
    if run.pipeline > 1:
        level = hardware.level_index(0, run.tensor)
        p2p = 2 * collectives.point_to_point_seconds(activation_bytes / run.tensor, hardware, level)
    per_micro_batch = matmul + device.memory_seconds(elementwise) + tensor_comm + p2p
    schedule = (micro_batches + run.pipeline - 1) * per_micro_batch
    params_per_device = shape.params / (run.tensor * run.pipeline)
    grads = collectives.all_reduce_seconds(params_per_device * 4, hardware,
                                           collectives.Group(size=run.data, stride=run.tensor * run.pipeline))
    optimizer = device.memory_seconds(params_per_device * (2 * 2 + 2 * 12 + 4))
    total = schedule + grads + optimizer
    return {"seconds": total, "schedule": schedule, "per_micro_batch": per_micro_batch, "matmul": matmul,
            "elementwise": device.memory_seconds(elementwise), "tensor_comm": tensor_comm, "p2p": p2p,
            "grad_all_reduce": grads, "optimizer": optimizer, "micro_batches": micro_batches}


def model_flops_utilisation(run: PipelineRun, seconds: float, hardware: HardwareSpec) -> float:
    """Korthikanti et al.'s MFU: 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) / (seconds · devices · peak)."""
    s, h, layers, vocab = run.seq_len, run.shape.hidden, run.shape.layers, run.shape.vocab
    flops = 72 * run.global_batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    return flops / (seconds * run.devices * hardware.device.flops(run.shape.compute_dtype))
