"""The execution options: how a program runs, never what it computes (the parameters and the maths stay).

One definition of each choice, read by every layer that names it: the model (`rpegjax.models.config`), the
sampler's KV cache (`rpegjax.generate.paged_cache`), the RPEG's execution record (`rpegjax.graph.ir.Execution`),
the performance model (`rpegjax.perf`) and the job's config (`rpegjax.train.config`). The values are the
strings that plan files, run configs and checkpoints' config.json hold, so they must not change.
Plain Python: no JAX (the models map `DType` onto `jax.numpy` dtypes themselves).
"""

from __future__ import annotations

import enum
import math
from typing import TypeVar


class AttentionKind(enum.StrEnum):
    """Full-sequence attention kernel (training, log-probs, prefill); see `rpegjax.models.attention`."""

    DENSE = "dense"  # materialises [b, h, t, t] scores: fastest for short sequences, memory O(t^2)
    BLOCKWISE = "blockwise"  # flash attention in plain JAX, any backend and dtype: memory O(t * block)
    CUDNN = "cudnn"  # cuDNN fused flash attention: CUDA GPU, bfloat16/float16 only

    @property
    def skips_causal_blocks(self) -> bool:
        """Whether the kernel never scores a query against a later key (flash-style), as the cost model counts it."""
        return self is not AttentionKind.DENSE

    @property
    def compute_dtypes(self) -> tuple[DType, ...]:
        """The compute dtypes the kernel runs in (cuDNN's fused kernel has no float32 path)."""
        return (DType.BFLOAT16, DType.FLOAT16) if self is AttentionKind.CUDNN else tuple(DType)


class RematPolicy(enum.StrEnum):
    """What each decoder layer keeps for the backward pass (`nnx.remat` per layer)."""

    NONE = "none"  # keep every activation: fastest, memory grows with layers x tokens x widths
    DOTS = "dots"  # keep matmul outputs, recompute the elementwise ops between them (no matmul recomputed)
    FULL = "full"  # keep only each layer's input, recompute the whole layer in the backward


def remat_runs(layers: int) -> int:
    """How many consecutive runs the dense layer scan under full remat splits its layers into
    (`rpegjax.models.layer_scan.remat_scan`'s `runs`), about sqrt(L): the backward's peak holds the kept inputs
    and 1/runs of the stacked kernels (or the stack and 1/runs of the kept inputs), against one compiled layer body
    per run (Qwen2.5-7B, 28 layers: 5 runs). Read by the model and by the perf model's memory formula."""
    return max(1, round(math.sqrt(layers)))


class CarryMode(enum.StrEnum):
    """How partial rollouts continue a sequence carried into the next step (`rpegjax.runtime.partial_rollouts`)."""

    RECOMPUTE = "recompute"  # its context is prefilled again with the new weights
    PAGES = "pages"  # its KV pages stay in the paged pool and it decodes on (`rpegjax.generate.page_carry`)


class CacheLayout(enum.StrEnum):
    """How the sampler stores keys and values (`rpegjax.generate.paged_cache`)."""

    CONTIGUOUS = "contiguous"  # [slots, k, capacity, e] per layer: the reference layout
    PAGED = "paged"  # pages from a shared pool, a page table per slot


class DecodeAttention(enum.StrEnum):
    """How the paged sampler's decode step attends over the pool (`rpegjax.models.paged_attention`)."""

    # XLA: each row gathers the page-table window of the bucket's longest row (a power of two of pages) and masks
    # past its own length: the work of rows x the longest row's pages
    GATHER = "gather"
    # the Pallas paged-attention kernel (Triton, CUDA GPUs only; Pallas interpret mode for tests): each row reads
    # its own pages up to its own length, so the work follows the live tokens
    PALLAS = "pallas"


class OptimizerSharding(enum.StrEnum):
    """How AdamW's moments are laid out on the training mesh (`rpegjax.learners.optim.split_over_data`)."""

    PARAMS = "params"  # each moment as its parameter: sharded over fsdp x tensor, replicated over the data axes
    # ZeRO-1: also split over the data axes the parameter is replicated on (the batch's axes), on a dimension they
    # divide; each data replica updates its slice and the new parameters are all-gathered over the data axes
    DATA = "data"


class DType(enum.StrEnum):
    """Floating-point storage or compute dtype of weights and matmuls."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2


# The fields of the model's execution, kept alike by the three records that carry them: `ModelConfig` (how a model
# runs), the job's `ModelSection` (what the user asks for) and the plan's `Execution` (what the planner chose).
MODEL_EXECUTION_FIELDS = ("attention", "attention_block_size", "remat", "scan_layers")

Choice = TypeVar("Choice", bound=enum.StrEnum)


def parse_choice(kind: type[Choice], value: object, where: str) -> Choice:
    """`value` (a member or its string) as a member of `kind`; ValueError naming `where` and the choices if it is none."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{where} must be one of {[member.value for member in kind]}, got {value!r}") from None
