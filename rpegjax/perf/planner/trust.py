"""Which plans' predicted memory the planner trusts: plans in the regime its memory formulas were checked in
against XLA's compiled programs, fitting the usable memory with the largest under-prediction measured there.

The memory model was checked program by program (update, micro-batched log-probs, prefill, decode chunk) against XLA's
GPU compiler on compile-only H100s / GH200s (`scripts/plan.py --verify --verify-target cuda-h100|cuda-gh200`,
`docs/benchmarks.md`, "Memory model against XLA's GPU compiler"): dense decoders from Qwen2.5-0.5B to 32B, rows up to
W-plan's 1k + 16k tokens, data x fsdp x tensor layouts, blockwise (and cuDNN's, compiled as blockwise) attention, every
remat policy; and fsdp x tensor layouts with sequence parallelism for rows up to 32k tokens (Qwen2.5-7B at 16k on 8
H100s and 32B at 32k on 32, `docs/benchmarks.md`, "W-long"). Outside that regime the formulas are extrapolations:
context parallelism was compared with XLA:CPU only (0.86x of its figure), dense attention's scores not at real shapes,
larger models and longer rows not at all. A plan there is not printed as a plan; its one-line reason is.
Inside it, the compiled programs came out at most `margin` above the prediction per phase (compiled / predicted
- 1, the largest of the checked programs); a plan is trusted when every stage's predicted peak times (1 + its
phase's margin) is within the usable memory, which is what the dry run then checks the compiled program against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Graph, StageKind
from rpegjax.models.config import ModelConfig
from rpegjax.options import AttentionKind, RematPolicy
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.step_model import Prediction

GENERATION, INFERENCE, TRAINING = "generation", "inference", "training"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckedRegime:
    """Where the memory formulas were checked against compiled programs, and how far they under-predicted there."""

    largest_params: float  # dense decoders up to this many parameters (ModelShape.params)
    longest_row: int  # prompt + response tokens per row
    # rows checked with sequence parallelism (prompt + response tokens; 0: sequence parallelism not checked)
    longest_sequence_parallel_row: int = 0
    attention: frozenset[AttentionKind]
    remat: frozenset[RematPolicy]
    margins: Mapping[str, float]  # phase -> largest (compiled / predicted - 1) measured, >= 0
    experts: bool = False  # checked on mixture-of-experts models in the capacity mode (else on dense models)

    def __post_init__(self) -> None:
        if self.longest_sequence_parallel_row < 0:
            raise ValueError("CheckedRegime.longest_sequence_parallel_row must be >= 0 (0: sequence parallelism "
                             f"unchecked), got {self.longest_sequence_parallel_row}")
        if set(self.margins) != {GENERATION, INFERENCE, TRAINING} or any(m < 0 for m in self.margins.values()):
            raise ValueError(f"CheckedRegime.margins: one margin >= 0 per phase {GENERATION, INFERENCE, TRAINING}, "
                             f"got {dict(self.margins)}")

    def limit(self, usable_bytes: float, phase: str) -> float:
        """The largest predicted peak of a `phase` stage that is trusted to compile within `usable_bytes`."""
        return usable_bytes / (1 + self.margins[phase])


# docs/benchmarks.md, "Memory model against XLA's GPU compiler" (`scripts/plan.py ... --verify --verify-target
# cuda-h100|cuda-gh200`): the inference margin is the W-plan 32B fused log-prob pass (50.02 GB compiled, 47.22
# predicted, 5.9% above; not compiled again since the inference passes gather the output matrix as its bfloat16
# cast). The packed fused log-prob passes of the Llama 3.1 8B NeMo-RL plans compile 2.0% and 3.0% below their
# prediction (cut to 2 and 4 layers, 2.9% and 2.5% above).
GPU_CHECKED = CheckedRegime(
    largest_params=ModelShape(layers=64, hidden=5120, heads=40, kv_heads=8, head_dim=128, mlp=27648,
                              vocab=152064).params,  # Qwen2.5-32B
    longest_row=1024 + 16384,
    # the 32B update at 32768 tokens per row on fsdp16 x tensor2 compiled 4.8% above its prediction (within the
    # training margin), the 7B one at 16384 on fsdp4 x tensor2 9.5% below it; with the output matrix gathered as
    # its bfloat16 cast, program and model, 9.2% and 10.4% below (`benchmarks/bench_memory.py --target cuda-h100`,
    # docs/benchmarks.md, "W-long")
    longest_sequence_parallel_row=32768,
    attention=frozenset({AttentionKind.BLOCKWISE, AttentionKind.CUDNN}),
    remat=frozenset(RematPolicy),
    # generation: the verifies of the planner's best plans (docs/benchmarks.md, "W-plan"): the 7B / 16 H100 plan's
    # carried-sequence prefill 59.22 GB compiled against 58.4 predicted (+1.4%); with no margin the README 1.5B
    # plan's pool was sized to the usable 72.0 and its prefill compiled to 72.00 against 71.9, refused by its own
    # dry run
    margins={GENERATION: 0.014, INFERENCE: 0.06, TRAINING: 0.052})


# docs/benchmarks.md, "W-long": Qwen3-30B-A3B's update in the capacity mode (1.25), one 16384-token row per device,
# float32 masters, blockwise attention, full remat, compiled for H100 by benchmarks/bench_moe_memory.py: expert16
# 45.22 GiB compiled, expert8 79.21; predicted 40.30 and 68.74 (+12.2%, +15.2%: the training margin). The dense
# updates' buffer assignments show the head and layers phases apart; the MoE update was not dumped, so what its
# layers' phase holds beyond the model (expert buffers) is not known: the margin is the measured error. No log-prob
# pass with an expert axis was compiled before the margin was set: it gets the training margin, an assumption the
# dry run checks. Dropless experts are outside the regime: XLA runs them as a dense GEMM over every local expert of
# the worst-case receive buffer (expert8: 276.07 GiB compiled, 360.28 predicted), never planned to fit; and so are
# stages without an expert axis (`regime_problem`). The generation margin is the largest under-prediction of a
# colocated 32-H100 plan's sampler programs (d8xt4, 256 slots per replica, pool 1,020,928 tokens;
# benchmarks/bench_moe_sampler_margin.py): prefill 57.69 / 56.47 GB (+2.2%), decode 55.95 / 56.47, in float32
# compute prefill 100.10 / 96.83 (+3.4%) and decode 96.57 / 96.83.
MOE_CHECKED = CheckedRegime(
    largest_params=ModelShape.from_config(ModelConfig.qwen3_moe("30b-a3b")).params,
    longest_row=16384,
    attention=frozenset({AttentionKind.BLOCKWISE, AttentionKind.CUDNN}),
    remat=frozenset({RematPolicy.FULL}),
    margins={GENERATION: 0.034, INFERENCE: 0.153, TRAINING: 0.153},
    experts=True)


def regime_for(shape: ModelShape) -> CheckedRegime:
    """The regime a model's plans are checked in: `MOE_CHECKED` for a mixture-of-experts model, else `GPU_CHECKED`."""
    return GPU_CHECKED if shape.experts is None else MOE_CHECKED


def phase(graph: Graph, stage_name: str) -> str | None:
    """The memory phase of a device stage (generation, inference or training); None for the rest."""
    kinds = set(graph.stage(stage_name).kinds)
    if StageKind.GENERATE in kinds:
        return GENERATION
    if kinds & UPDATE_KINDS:
        return TRAINING
    return INFERENCE if kinds & INFERENCE_KINDS else None


def regime_problem(graph: Graph, shape: ModelShape, longest_row: int, regime: CheckedRegime = GPU_CHECKED) -> str | None:
    """Why `graph` for a model of `shape` and rows of `longest_row` tokens is outside `regime`, or None."""
    execution = graph.execution
    if (shape.experts is not None) != regime.experts:
        return ("a mixture-of-experts model: memory checked against compiled programs of dense models only"
                if shape.experts is not None else "a dense model: this regime was checked on mixture-of-experts models")
    if shape.experts is not None and shape.experts.capacity_factor is None:
        return ("dropless experts: XLA's GPU compiler runs them as a dense GEMM over every local expert of the worst-case "
                "receive buffer (Qwen3-30B-A3B, expert8: 276 GiB compiled per device); plan the capacity mode "
                "(the plan's execution.moe_capacity_factor: scripts/plan.py --moe-capacity-factor C)")
    if shape.experts is not None:
        unsplit = [s.name for s in graph.stages if not s.host and StageKind.GENERATE not in s.kinds
                   and graph.parallel_of(s.name).get("expert", 1) == 1
                   and graph.parallel_of(s.name).get("data", 1) * graph.parallel_of(s.name).get("fsdp", 1) > 1]
        if unsplit:
            return (f"experts without an expert axis on {unsplit[0]!r}: without `shard_map` the capacity buffers are "
                    f"built for the whole batch on every device (the f32 log-prob pass of Qwen3-30B-A3B compiled to "
                    f"140.67 GB per device); memory checked with an expert axis only")
    if shape.params > regime.largest_params:
        return (f"{shape.params / 1e9:.1f}B parameters: memory checked against compiled programs up to "
                f"{regime.largest_params / 1e9:.1f}B")
    if execution.sequence_parallel and not regime.longest_sequence_parallel_row:
        return "sequence parallelism: its memory was not checked against the GPU compiler"
    longest = regime.longest_sequence_parallel_row if execution.sequence_parallel else regime.longest_row
    if longest_row > longest:
        parallel = " with sequence parallelism" if execution.sequence_parallel else ""
        return f"rows of {longest_row} tokens: memory checked up to {longest}{parallel}"
    if execution.attention not in regime.attention:
        return f"{execution.attention} attention: its memory was not checked against compiled programs at real shapes"
    if execution.remat not in regime.remat:
        return f"remat {execution.remat}: its memory was not checked against compiled programs"
    if any(graph.parallel_of(s.name).get("context", 1) > 1 for s in graph.stages if not s.host):
        return "context parallelism: its memory was checked against XLA:CPU only (0.86x), not the GPU compiler"
    return None


def untrusted(prediction: Prediction, shape: ModelShape, longest_row: int,
              regime: CheckedRegime = GPU_CHECKED) -> str | None:
    """One line saying why the planner does not trust a fitting plan's predicted memory, or None when it does."""
    problem = regime_problem(prediction.graph, shape, longest_row, regime)
    if problem is not None:
        return f"untrusted: {problem}"
    usable = prediction.memory_limit_bytes
    for stage in prediction.stages:
        stage_phase = phase(prediction.graph, stage.name) if not prediction.graph.stage(stage.name).host else None
        if stage_phase is None or not math.isfinite(stage.peak_memory_bytes):
            continue
        if stage.peak_memory_bytes > regime.limit(usable, stage_phase):
            margin = regime.margins[stage_phase]
            return (f"untrusted: {stage_phase} ({stage.name}) predicted {stage.peak_memory_bytes / 1e9:.1f} GB per GPU, "
                    f"within the usable {usable / 1e9:.1f} GB but not with the {100 * margin:.0f}% its phase's "
                    f"programs compiled above their prediction")
    return None


__all__ = ["CheckedRegime", "GENERATION", "GPU_CHECKED", "INFERENCE", "MOE_CHECKED", "TRAINING", "phase", "regime_for",
           "regime_problem", "untrusted"]
