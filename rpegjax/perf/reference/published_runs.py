"""Published measurements that the performance model is checked against, each cited with its set-up.

Pre-training (Korthikanti et al. 2022): nothing is fitted, the default efficiencies predict each run.
RL step times (`RLRun`): each run is predicted with the system's own plan (`rl_plan`); a few efficiency
constants (`Efficiencies`) are fitted on some runs (`fit_efficiencies`) and the others are held out
(`tests/perf/reference/test_published_runs.py` checks the held-out errors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rpegjax.graph.ir import Algorithm, Execution
from rpegjax.options import CacheLayout, CarryMode, RematPolicy
from rpegjax.perf import planner
from rpegjax.perf.model import hardware as hardware_module
from rpegjax.perf.model.costs import ModelShape
from rpegjax.perf.model.expert_costs import ExpertShape
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.hardware import HardwareSpec
from rpegjax.perf.model.pretraining import PipelineRun
from rpegjax.perf.model.stage_costs import ExecutionOptions, Workload
from rpegjax.perf.model.step_model import Evaluator, Prediction
from rpegjax.perf.reference import presets
from rpegjax.perf.reference.presets import a100_node


def _gpt(layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads, mlp=4 * hidden,
                      vocab=51200, gated_mlp=False, param_dtype="bfloat16", compute_dtype="bfloat16")


# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023
# (arXiv:2205.05198): Table 3 (model configurations: GPT-3-style, sequence 2048, micro-batch 1, tensor 8,
# run on NVIDIA Selene, DGX A100 80 GB) and Table 5 ("present work" = sequence parallelism + selective
# recomputation: end-to-end iteration time and model FLOPs utilisation).
KORTHIKANTI_2022 = (
    PipelineRun(name="GPT 22B", shape=_gpt(48, 6144, 64), seq_len=2048, global_batch=4, micro_batch=1, tensor=8,
                pipeline=1, data=1, measured_seconds=1.10, measured_mfu=0.415,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
    PipelineRun(name="GPT-3 175B", shape=_gpt(96, 12288, 96), seq_len=2048, global_batch=64, micro_batch=1, tensor=8,
                pipeline=8, data=1, measured_seconds=13.75, measured_mfu=0.514,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
    PipelineRun(name="GPT 530B", shape=_gpt(105, 20480, 128), seq_len=2048, global_batch=280, micro_batch=1, tensor=8,
                pipeline=35, data=1, measured_seconds=37.83, measured_mfu=0.560,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
    PipelineRun(name="GPT 1T", shape=_gpt(128, 25600, 160), seq_len=2048, global_batch=512, micro_batch=1, tensor=8,
                pipeline=64, data=1, measured_seconds=71.49, measured_mfu=0.563,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
)


def selene(devices: int) -> HardwareSpec:
    """The DGX A100 80 GB cluster these runs used."""
    return a100_node(devices)


# ============================================================================================ RL step times
# Published RL step times, each with the system's own plan. NeMo RL, "Performance" page
# (docs/about/performance-summary.md), section "Nemo RL v0.5", table "H100 BF16 Benchmarks" (page of 2026-01-20,
# release r0.5.0); set-ups from the recipes it names (examples/configs/recipes/llm/performance/
# grpo-llama3.1-8b-instruct-2n8g{,-async-1off}.yaml, grpo-qwen3-32b-{4n8g,8n8g-async-1off}.yaml, defaults
# examples/configs/grpo_math_1B.yaml): GRPO with a reference model (KL 0.01), 64 prompts x 32 samples
# (G-GBS 2048), 4 optimiser steps of 512 (T-GBS), Megatron training (distributed optimiser, sequence packing with
# 4096-token micro-batches), vLLM generation with gpu_memory_utilization 0.6 colocated and 0.8 on its own GPUs,
# step time averaged over 5 steps (training, generation, log-probs and refit). What is not published: the prompt
# length (assumed 128 tokens: the table's tokens/s/GPU x GPUs x step time / 2048 exceeds its mean length by
# 100-135 tokens, i.e. the prompt) and the response-length distribution (assumed log-normal, sigma 1.0, with the
# table's "G-Average Seq len" as mean, clipped at 4096 - 128 new tokens).

# Hugging Face configs: meta-llama/Llama-3.1-8B-Instruct and Qwen/Qwen3-32B (config.json).
LLAMA31_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256)
QWEN3_32B = ModelShape(layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128, mlp=25600, vocab=151936)

NEMO_RL_V05 = "NeMo RL performance summary, section v0.5, table H100 BF16 (2026-01-20, recipes of r0.5.0)"
# The same page's first version (2025-12-01), section v0.4, one table (DGX-H100, BF16): the same four set-ups
# measured with the earlier release, except that its 1-step-off Llama recipe keeps PP 2 and has no in-flight
# weight updates.
NEMO_RL_V04 = "NeMo RL performance summary, section v0.4, table DGX-H100 BF16 (2025-12-01, recipes of r0.4.0)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLRun:
    """A published RL training run: its workload, its own plan and the measured seconds per step.

    generation_gpus: GPUs given to generation alone (0: generation shares every GPU with training);
    train_tensor / train_pipeline / train_context: Megatron's TP, PP and CP (data parallelism takes the rest of the
    training GPUs); train_expert: the expert axis (`rpegjax.perf.model.expert_costs`) carved out of that data
    parallelism (Megatron's EP where it spans data-parallel ranks only); sequence_parallel: Megatron's;
    async_bound: 0 on-policy, k: k steps off-policy.
    """

    name: str
    source: str
    shape: ModelShape
    hardware: str  # a preset of `rpegjax.perf.model.hardware`
    gpus: int
    prompts: int
    group_size: int
    prompt_tokens: int
    response_mean: float
    response_max: int
    generation_gpus: int
    generation_tensor: int
    train_tensor: int
    train_pipeline: int
    async_bound: int
    optimizer_steps: int
    remat: bool
    generation_memory_fraction: float
    microbatch_tokens: int
    measured_seconds: float
    train_context: int = 1
    train_expert: int = 1
    sequence_parallel: bool = False
    in_flight_weight_updates: bool = False
    # the peer's training efficiency for this model relative to a dense model's (`MEGATRON_MOE_RATIO`; 1: dense)
    train_efficiency_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.train_efficiency_ratio <= 1:
            raise ValueError(f"RLRun {self.name!r}: train_efficiency_ratio must be in (0, 1], "
                             f"got {self.train_efficiency_ratio!r}")
        if self.in_flight_weight_updates and (self.async_bound < 1 or not self.generation_gpus):
            raise ValueError(f"RLRun {self.name!r}: in-flight weight updates need asynchronous generation on its own "
                             f"GPUs (async_bound {self.async_bound}, generation_gpus {self.generation_gpus})")
        train_gpus = self.gpus - self.generation_gpus
        split = self.train_tensor * self.train_pipeline * self.train_context * self.train_expert
        if train_gpus < 1 or train_gpus % split:
            raise ValueError(f"RLRun {self.name!r}: {train_gpus} training GPUs do not split into TP {self.train_tensor} "
                             f"x PP {self.train_pipeline} x CP {self.train_context} x expert {self.train_expert}")
        if (self.generation_gpus or self.gpus) % self.generation_tensor:
            raise ValueError(f"RLRun {self.name!r}: generation GPUs do not split into TP {self.generation_tensor}")
        if self.measured_seconds <= 0:
            raise ValueError(f"RLRun {self.name!r}: measured_seconds must be positive, got {self.measured_seconds!r}")


def _nemo_rl(name: str, **fields) -> RLRun:
    common = {"source": NEMO_RL_V05, "hardware": "h100", "prompts": 64, "group_size": 32, "prompt_tokens": 128,
              "response_max": 4096 - 128, "optimizer_steps": 2048 // 512, "microbatch_tokens": 4096}
    return RLRun(name=name, **{**common, **fields})


_LLAMA_ON = {"shape": LLAMA31_8B, "gpus": 16, "generation_gpus": 0, "generation_tensor": 1, "train_tensor": 1,
             "train_pipeline": 2, "async_bound": 0, "remat": True, "generation_memory_fraction": 0.6}
_LLAMA_OFF = {**_LLAMA_ON, "generation_gpus": 8, "train_pipeline": 1, "async_bound": 1, "generation_memory_fraction": 0.8}
_QWEN_ON = {"shape": QWEN3_32B, "gpus": 32, "generation_gpus": 0, "generation_tensor": 4, "train_tensor": 4,
            "train_pipeline": 4, "sequence_parallel": True, "async_bound": 0, "remat": False,
            "generation_memory_fraction": 0.6}
_QWEN_OFF = {**_QWEN_ON, "gpus": 64, "generation_gpus": 32, "async_bound": 1, "generation_memory_fraction": 0.8}

NEMO_RL_RUNS = (
    _nemo_rl("NeMo-RL v0.5 Llama-3.1-8B on-policy", **_LLAMA_ON, response_mean=1019, measured_seconds=92.8),
    _nemo_rl("NeMo-RL v0.5 Llama-3.1-8B 1-step off", **_LLAMA_OFF, response_mean=1123, measured_seconds=64.8),
    _nemo_rl("NeMo-RL v0.5 Qwen3-32B on-policy", **_QWEN_ON, response_mean=3251, measured_seconds=376.0),
    _nemo_rl("NeMo-RL v0.5 Qwen3-32B 1-step off", **_QWEN_OFF, response_mean=3252, measured_seconds=200.0),
    _nemo_rl("NeMo-RL v0.4 Llama-3.1-8B on-policy", **_LLAMA_ON, response_mean=1060, measured_seconds=97.7,
             source=NEMO_RL_V04),
    _nemo_rl("NeMo-RL v0.4 Llama-3.1-8B 1-step off", **{**_LLAMA_OFF, "train_pipeline": 2}, response_mean=1129,
             measured_seconds=74.6, source=NEMO_RL_V04),
    _nemo_rl("NeMo-RL v0.4 Qwen3-32B on-policy", **_QWEN_ON, response_mean=3206, measured_seconds=393.0,
             source=NEMO_RL_V04),
    _nemo_rl("NeMo-RL v0.4 Qwen3-32B 1-step off", **_QWEN_OFF, response_mean=3207, measured_seconds=215.0,
             source=NEMO_RL_V04),
)
# Fitted on the smallest set-ups (Llama-3.1-8B on 16 GPUs, v0.5), chosen before looking at the errors: a user
# calibrates on what they can run and plans larger. Everything else is held out.
FIT_RUNS = NEMO_RL_RUNS[:2]
HELD_OUT_RUNS = NEMO_RL_RUNS[2:]

# ------------------------------------------------------------------------------------ GB200 dense runs
# The same page's section "Nemo RL v0.5", table "GB200 BF16 Benchmarks" (System: GB200-NVL72; page of 2026-01-20,
# NVIDIA-NeMo/RL 108bffdab, unchanged for these rows up to 4c1a0cd49) with the recipes it names at tag v0.5.0
# (examples/configs/recipes/llm/performance/): grpo-llama3.1-8b-instruct-2n4g.yaml (8 GPUs colocated, TP1 PP1,
# activation checkpointing, vLLM TP1 at the default 0.6), grpo-llama3.1-8b-instruct-2n4g-async-1off.yaml (4 GPUs of
# generation at 0.8 + 4 of training, in-flight weight updates, max_trajectory_age_steps 1),
# grpo-qwen3-32b-4n4g.yaml (16 GPUs colocated, TP2 PP1 with sequence parallelism, no activation checkpointing, vLLM
# TP1) and grpo-qwen3-32b-8n4g-async-1off.yaml (16 + 16 GPUs, generation at 0.8). Workload and assumptions as for
# the H100 rows (64 prompts x 32, 4 optimiser steps of 512, 4096-token packed micro-batches, 128-token prompts,
# log-normal responses with the table's mean). GB200 is the nearest published hardware to GH200 (a Grace CPU on
# NVLink-C2C, more HBM); its preset `gb200-nvl72` carries the datasheet figures. Held out: the efficiencies stay
# fitted on the two H100 Llama runs. The page's v0.6 section (from 69c7ca117, 2026-04-29, to 7ea279ab) has no dense
# rows: its H100 BF16/FP8 and GB200 BF16 tables list DeepSeek V3, Qwen3-235B, Qwen3-30B-A3B and Nemotron-3-Nano only.
NEMO_RL_V05_GB200 = "NeMo RL performance summary, section v0.5, table GB200 BF16 (GB200-NVL72, 2026-01-20, recipes of r0.5.0)"

_GB200 = {"source": NEMO_RL_V05_GB200, "hardware": "gb200-nvl72"}
_GB200_LLAMA_ON = {**_LLAMA_ON, **_GB200, "gpus": 8, "train_pipeline": 1}
_GB200_QWEN_ON = {**_QWEN_ON, **_GB200, "gpus": 16, "generation_tensor": 1, "train_tensor": 2, "train_pipeline": 1}
_GB200_OFF = {"async_bound": 1, "generation_memory_fraction": 0.8, "in_flight_weight_updates": True}
GB200_RUNS = (
    _nemo_rl("NeMo-RL v0.5 GB200 Llama-3.1-8B on-policy", **_GB200_LLAMA_ON, response_mean=1066,
             measured_seconds=91.0),
    _nemo_rl("NeMo-RL v0.5 GB200 Llama-3.1-8B 1-step off", **{**_GB200_LLAMA_ON, **_GB200_OFF, "generation_gpus": 4},
             response_mean=1107, measured_seconds=71.1),
    _nemo_rl("NeMo-RL v0.5 GB200 Qwen3-32B on-policy", **_GB200_QWEN_ON, response_mean=3253, measured_seconds=381.0),
    _nemo_rl("NeMo-RL v0.5 GB200 Qwen3-32B 1-step off", **{**_GB200_QWEN_ON, **_GB200_OFF, "gpus": 32,
                                                           "generation_gpus": 16},
             response_mean=3258, measured_seconds=210.0),
)

# ------------------------------------------------------------------------------- mixture-of-experts runs
# The same page's section "NeMo RL v0.6", table "H100 BF16 Benchmarks" (release r0.6.0; Megatron training with
# dropless token dispatch and grouped GEMMs, vLLM generation), and the recipes it names
# (examples/configs/recipes/llm/performance/): grpo-qwen3-30ba3b-4n8g.yaml (64 prompts x 32, TP1 PP1 EP8, vLLM
# TP2, colocated), grpo-qwen3-30ba3b-4n8g-async-1off.yaml (16 GPUs of generation at 0.8 memory + 16 of training,
# PP2 EP8), grpo-qwen3-30ba3b-24n8g-async-8off.yaml (64 + 128 GPUs, EP8, max_trajectory_age_steps 8),
# grpo-qwen3-235b-32n8g.yaml (16 prompts x 32, 8192-token sequences, TP2 CP2 PP8 EP16, sequence parallel,
# activation checkpointing, vLLM TP16, colocated) and grpo-qwen3-235b-32n8g-async-1off.yaml (128 GPUs of
# generation at TP8 + 128 of training at TP4 PP8 EP16). The table's T-GBS (512: 4 optimiser steps for 30B-A3B,
# 1 for 235B) is used where a later recipe differs. Megatron's EP spans data-parallel, context and tensor ranks;
# the expert axis here is data-like, so it takes EP's data-parallel part: EP8 for 30B-A3B; for 235B the
# data-parallel ranks (8 on-policy, 4 one-step off) with CP kept as context. Same assumptions as above (128-token
# prompts, log-normal responses with the table's mean). Held out: nothing is fitted on them. The three asynchronous
# recipes set grpo.async_grpo.in_flight_weight_updates (`continuous_generation`). vLLM as the 235B recipes run it
# (tag v0.6.0: examples/configs/grpo_math_1B.yaml's vllm_cfg, nemo_rl/models/generation/vllm/vllm_worker.py):
# expert_parallel_size 1 (TP only: every expert split over the TP group), kv_cache_dtype "auto" (bfloat16),
# max_model_len = max_new_tokens = 8192, gpu_memory_utilization 0.8 in the one-step-off recipe (0.88 only from
# NVIDIA-NeMo/RL cc34bee34, 2026-07-21, after the table), enforce_eager False (CUDA graphs), prefix caching on.
#
# Megatron trains a MoE model at a lower share of peak than a dense one (small grouped GEMMs, token permutation,
# dispatch). Its published pretraining throughput on H100 in BF16 (not these runs) gives the ratio: Megatron Core
# reaches up to 47% MFU on dense models (NVIDIA/Megatron-LM README); Megatron Bridge's MoE playbook (its
# skills/perf-techniques/moe-hardware-configs, "Rounded Performance Bands") gives Qwen3-30B-A3B "low-200s
# TFLOPS/GPU" (TP1 EP8 PP1, DeepEP), read at its floor, 200 TFLOP/s (the bands are tuned pretraining with DeepEP;
# NeMo RL's recipes route dropless), and Qwen3-235B-A22B "around 30% MFU". The fitted matmul efficiency (a dense
# fit) is scaled by MoE MFU / dense MFU for their training and log-prob passes.
MEGATRON_DENSE_MFU = 0.47
MEGATRON_MOE_RATIO = {"qwen3-30b-a3b": 200 * hardware_module.TFLOPS / presets.h100_node().device.flops("bfloat16")
                      / MEGATRON_DENSE_MFU,
                      "qwen3-235b-a22b": 0.30 / MEGATRON_DENSE_MFU}
QWEN3_30B_A3B = ModelShape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, mlp=6144, vocab=151936,
                           experts=ExpertShape(experts=128, top_k=8, mlp=768, sparse_layers=48))
QWEN3_235B_A22B = ModelShape(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, mlp=12288, vocab=151936,
                             experts=ExpertShape(experts=128, top_k=8, mlp=1536, sparse_layers=94))
NEMO_RL_V06 = "NeMo RL performance summary, section v0.6, table H100 BF16 (recipes of r0.6.0)"

_MOE_30B = {"source": NEMO_RL_V06, "shape": QWEN3_30B_A3B, "gpus": 32, "generation_gpus": 0, "generation_tensor": 2,
            "train_tensor": 1, "train_pipeline": 1, "train_expert": 8, "async_bound": 0, "remat": False,
            "generation_memory_fraction": 0.6, "train_efficiency_ratio": MEGATRON_MOE_RATIO["qwen3-30b-a3b"]}
_MOE_235B = {"source": NEMO_RL_V06, "shape": QWEN3_235B_A22B, "gpus": 256, "prompts": 16, "response_max": 8192 - 128,
             "optimizer_steps": 1, "microbatch_tokens": 8192, "generation_gpus": 0, "generation_tensor": 16,
             "train_tensor": 2, "train_pipeline": 8, "train_context": 2, "train_expert": 8, "sequence_parallel": True,
             "async_bound": 0, "remat": True, "generation_memory_fraction": 0.6,
             "train_efficiency_ratio": MEGATRON_MOE_RATIO["qwen3-235b-a22b"]}
MOE_RUNS = (
    _nemo_rl("NeMo-RL v0.6 Qwen3-30B-A3B on-policy", **_MOE_30B, response_mean=3203, measured_seconds=192.0),
    _nemo_rl("NeMo-RL v0.6 Qwen3-30B-A3B 1-step off", **{**_MOE_30B, "generation_gpus": 16, "train_pipeline": 2,
                                                         "async_bound": 1, "generation_memory_fraction": 0.8,
                                                         "in_flight_weight_updates": True},
             response_mean=3201, measured_seconds=152.0),
    _nemo_rl("NeMo-RL v0.6 Qwen3-30B-A3B 8-step off", **{**_MOE_30B, "gpus": 192, "generation_gpus": 64,
                                                         "async_bound": 8, "generation_memory_fraction": 0.8,
                                                         "in_flight_weight_updates": True},
             response_mean=3206, measured_seconds=34.5),
    _nemo_rl("NeMo-RL v0.6 Qwen3-235B-A22B on-policy", **_MOE_235B, response_mean=5713, measured_seconds=312.0),
    _nemo_rl("NeMo-RL v0.6 Qwen3-235B-A22B 1-step off", **{**_MOE_235B, "generation_gpus": 128, "generation_tensor": 8,
                                                           "train_tensor": 4, "train_context": 1, "train_expert": 4,
                                                           "async_bound": 1, "generation_memory_fraction": 0.8,
                                                           "in_flight_weight_updates": True},
             response_mean=5721, measured_seconds=231.0),
)


# ------------------------------------------------------------------------------------ plan and prediction
@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiencies:
    """The fitted constants: fraction of peak FLOP/s that training and log-prob passes reach (Megatron's
    kernels) and fraction of HBM bandwidth that decoding reaches (vLLM's kernels, per-step scheduling included)."""

    matmul: float
    decode_memory: float

    def __post_init__(self) -> None:
        for name in ("matmul", "decode_memory"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Efficiencies.{name} must be in (0, 1], got {getattr(self, name)!r}")


DEFAULT_EFFICIENCIES = Efficiencies(matmul=0.7, decode_memory=0.8)  # the presets' unfitted assumptions
# What `fit_efficiencies(FIT_RUNS)` returns (tests/perf/reference/test_published_runs.py recomputes it): Megatron's
# passes at 50% of peak, vLLM's decode at 57.5% of HBM bandwidth.
FITTED_EFFICIENCIES = Efficiencies(matmul=0.5, decode_memory=0.575)


def continuous_generation(run: RLRun) -> bool:
    """Whether the run's generation is continuous across steps, as NeMo RL's asynchronous GRPO runs it with
    in-flight weight updates (NVIDIA-NeMo/RL, nemo_rl/algorithms/async_utils.py, `AsyncTrajectoryCollector`): up to
    `num_prompts_per_step` x `max_trajectory_age_steps` prompt groups are in flight (its semaphore); a group started
    under weights v is trained at step v + age at the latest; at a weight update vLLM keeps decoding the running
    requests with their KV caches (`prepare_for_refit`; `recompute_kv_cache_after_weight_updates` off). That is
    rpegjax's partial-rollout model (`rpegjax.perf.model.partial_rollouts`) with `age` batches in flight, carried
    sequences continuing from their pages, and a trained token lagging at most `age` versions.

    With an age of 1 one batch is in flight (a semaphore of `num_prompts_per_step` groups; each sample is its own
    request, dealt round-robin over the vLLM replicas) and the collector reserves one target version per weights
    version, so the next batch's groups enter the places a finished group frees once the trainer has published
    the weights they start from. Such a run is costed as a whole batch per step, which is what that gives here:
    generation-bound, each batch's groups start in the places of the previous batch's groups as those end, and
    with the responses these runs are modelled with (log-normal, over 40% of them at the length cap) all but
    ~2e-8 of the groups of 32 hold a capped response, so every group lasts the cap's decode steps and no place
    frees before the whole batch ends (tests/perf/reference/test_published_runs.py checks the odds)."""
    return run.in_flight_weight_updates and run.async_bound >= 2


def rl_execution(run: RLRun) -> Execution:
    """The run's execution options: Megatron's sequence parallelism, and its continuous generation
    (`continuous_generation`): `age` batches in flight, tokens lagging at most `age` versions, carried sequences
    kept in the (paged) KV cache."""
    if not continuous_generation(run):
        return Execution(sequence_parallel=run.sequence_parallel)
    age = run.async_bound
    return Execution(sequence_parallel=run.sequence_parallel, kv_cache=CacheLayout.PAGED, partial_rollouts=True,
                     inflight_batches=age, max_token_lag=age, partial_carry=CarryMode.PAGES)


def rl_plan(run: RLRun) -> planner.PlanChoice:
    """The run's own plan as a planner choice: its placement (colocated or generation on its own GPUs), its
    generation TP, its training TP x PP (PP as a `pipeline` axis) with data parallelism over the rest, its
    asynchrony and its optimiser steps per RL step.

    Continuous generation (`continuous_generation`) takes asynchrony bound 1: in rpegjax's notation new tokens
    lag k versions and a group is generated over max_token_lag − k + 1 steps; NeMo RL's group of age a is
    generated under a weights versions (v … v + a − 1) and its first tokens lag a, so k = 1, max_token_lag = a."""
    train_gpus = run.gpus - run.generation_gpus
    data = train_gpus // (run.train_tensor * run.train_pipeline * run.train_context * run.train_expert)
    generation = (run.generation_gpus or run.gpus) // run.generation_tensor
    train = (("data", data), ("pipeline", run.train_pipeline), ("expert", run.train_expert),
             ("context", run.train_context), ("tensor", run.train_tensor))
    return planner.PlanChoice(
        algorithm=Algorithm.GRPO, use_reference=True, num_devices=run.gpus,
        async_bound=1 if continuous_generation(run) else run.async_bound,
        generation_devices=run.generation_gpus, optimizer_steps=run.optimizer_steps,
        generation_layout=(("data", generation), ("fsdp", 1), ("tensor", run.generation_tensor)),
        train_layout=tuple((axis, size) for axis, size in train if size > 1 or axis not in ("expert", "context")),
        execution=rl_execution(run))


def rl_evaluator(run: RLRun, efficiencies: Efficiencies) -> Evaluator:
    """Model, workload, hardware (with `efficiencies`) and execution options of the run."""
    hw = presets.preset(run.hardware, run.gpus)
    # decode streams weights and KV: its bandwidth efficiency stands for the serving engine; the training
    # passes' elementwise traffic keeps the preset's. A MoE model's passes run at the peer's MoE share of the dense
    # fit (`MEGATRON_MOE_RATIO`; vLLM's prefill, priced at the same rate, moves their generation by at most 0.2%)
    device = dataclasses.replace(hw.device, matmul_efficiency=efficiencies.matmul * run.train_efficiency_ratio)
    hw = dataclasses.replace(hw, device=device)
    workload = Workload(prompts=run.prompts, group_size=run.group_size, prompt_tokens=run.prompt_tokens,
                        responses=ResponseLengths.lognormal(run.response_mean, run.response_max))
    # the plan's continuous generation; the serving engine's own paged cache (PAGED decode), not rpegjax's pool
    execution = rl_execution(run)
    options = ExecutionOptions(remat=RematPolicy.FULL if run.remat else RematPolicy.NONE,
                               microbatch_tokens=run.microbatch_tokens,
                               generation_memory_fraction=run.generation_memory_fraction,
                               decode_memory_efficiency=efficiencies.decode_memory,
                               decode_custom_all_reduce=True,  # vLLM's default (NeMo RL does not disable it)
                               partial_rollouts=execution.partial_rollouts, inflight_batches=execution.inflight_batches,
                               max_token_lag=execution.max_token_lag, partial_carry=execution.partial_carry)
    return Evaluator(run.shape, workload, hw, options)


def predict_rl_run(run: RLRun, efficiencies: Efficiencies = DEFAULT_EFFICIENCIES) -> Prediction:
    """The step model's prediction of `run` under its own plan. Memory is reported, not enforced: these systems
    offload training state while generating and shard optimiser state over data parallelism (Megatron's
    distributed optimiser), which the plan-level accounting does not express."""
    return rl_evaluator(run, efficiencies).predict(planner.build_graph(rl_plan(run)), with_trace=False,
                                                   enforce_memory=False)


def relative_errors(runs: Sequence[RLRun], efficiencies: Efficiencies) -> dict[str, float]:
    """(predicted − measured) / measured per run."""
    out = {}
    for run in runs:
        predicted = predict_rl_run(run, efficiencies).step_seconds
        if not math.isfinite(predicted):
            raise ValueError(f"{run.name}: the model gives no finite step time")
        out[run.name] = predicted / run.measured_seconds - 1
    return out


def fit_efficiencies(runs: Sequence[RLRun], *, matmul: Sequence[float] = tuple(0.25 + 0.025 * i for i in range(23)),
                     decode_memory: Sequence[float] = tuple(0.2 + 0.025 * i for i in range(33))) -> Efficiencies:
    """The grid point that minimises the sum of squared log errors of `runs` (a grid: the step model is a
    simulation, not differentiable, and two constants on a 0.025 grid are cheap)."""
    if not runs:
        raise ValueError("fit_efficiencies needs at least one run")
    best, best_loss = None, math.inf
    for m in matmul:
        for d in decode_memory:
            candidate = Efficiencies(matmul=m, decode_memory=d)
            loss = sum(math.log1p(e) ** 2 for e in relative_errors(runs, candidate).values())
            if loss < best_loss - 1e-12:
                best, best_loss = candidate, loss
    return best
