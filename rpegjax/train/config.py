"""The run configuration: small frozen sections composed into one `RunConfig`; the CLI maps
`--section.field=value` onto it (`rpegjax.train.overrides`), and the resolved config is saved as JSON
beside the checkpoints."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from rpegjax.data.prompts import ChatTemplateMode
from rpegjax.data.rows import DatasetFormat
from rpegjax.distributed.launch import DistributedConfig
from rpegjax.envs.catalog import EnvironmentName
from rpegjax.envs.python_sandbox import SandboxIsolation
from rpegjax.graph.ir import Algorithm, CriticMode
from rpegjax.learners.advantages import AdvantageKind
from rpegjax.learners.group_filter import DynamicSamplingConfig, SamplingCapAction
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.ppo import PPOConfig
from rpegjax.models.lora import LoRAConfig, LoRAGeneration, LoRATarget
from rpegjax.models.precision import Precision, resolve_precision
from rpegjax.options import (
    MODEL_EXECUTION_FIELDS,
    AttentionKind,
    CacheLayout,
    CarryMode,
    DecodeAttention,
    DType,
    OptimizerSharding,
    RematPolicy,
    parse_choice,
)
from rpegjax.rewards.custom import RewardSpec
from rpegjax.runtime.partial_rollouts import StalePolicy
from rpegjax.rewards.format import overlong_penalty
from rpegjax.rewards.task import Difficulty
from rpegjax.rewards.tasks import TaskName
from rpegjax.sharding.axes import CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS, FSDP_AXIS, TENSOR_AXIS
from rpegjax.sharding.mesh import parse_mesh
from rpegjax.train.overrides import (
    ConfigFileError,
    apply_overrides,
    from_jsonable,
    read_config_file,
    to_jsonable,
)

_WIDTHS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
"""The model widths a LoRA rank is checked against (`LoRASection.check_rank`)."""
MESH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, CONTEXT_AXIS, TENSOR_AXIS)
"""The mesh axis names the sharding rules know (`context`: training only, the sampler splits no row; `expert`:
a mixture-of-experts model's experts, in training and in the sampler, and a data axis besides)."""


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(section).__name__}.{name} must be a positive integer, got {value!r}")


def _choice(section: object, name: str, kind: type[enum.StrEnum], *, optional: bool = False) -> None:
    """Stores field `name` as a member of `kind` (or None when `optional`); a value outside it is an error naming
    field and choices."""
    value = getattr(section, name)
    if not (optional and value is None):
        object.__setattr__(section, name, parse_choice(kind, value, f"{type(section).__name__}.{name}"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """`path`: a local Hugging Face directory (config.json + safetensors + tokenizer files); without it a
    small Qwen2-style model of the sizes below is built for the built-in character tokenizer, or with
    `num_experts` > 0 a Qwen3-MoE-style one whose every layer routes each token to `num_experts_per_token` of
    `num_experts` experts of width `moe_intermediate_size` (rpegjax.models.moe). `moe_capacity_factor` (a MoE
    model, built or loaded): null runs the experts dropless; c > 0 caps each expert at ceil(c t k / x) of a row's
    assignments and drops the rest (counted in `moe/dropped_tokens`; rpegjax.models.expert_parallel)."""

    path: str | None = None
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    num_experts: int = 0
    num_experts_per_token: int = 2
    moe_intermediate_size: int = 128
    moe_capacity_factor: float | None = None
    # None: the mixed-precision policy (rpegjax.models.precision): float32 everywhere on CPU; on a GPU float32
    # master weights computing in a checkpoint's own dtype, generation in the compute dtype
    param_dtype: DType | None = None
    dtype: DType | None = None
    generation_dtype: DType | None = None
    # how the model executes (see rpegjax.models.config): long sequences want blockwise, full, scan_layers
    attention: AttentionKind = AttentionKind.DENSE
    attention_block_size: int = 512
    remat: RematPolicy = RematPolicy.NONE
    scan_layers: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "attention_block_size", "num_experts_per_token", "moe_intermediate_size")
        if not isinstance(self.num_experts, int) or isinstance(self.num_experts, bool) or self.num_experts < 0:
            raise ValueError(f"ModelSection.num_experts must be 0 (dense) or a positive integer, got {self.num_experts!r}")
        capacity = self.moe_capacity_factor
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int | float) or capacity <= 0):
            raise ValueError(f"ModelSection.moe_capacity_factor must be null (dropless) or a positive number, "
                             f"got {capacity!r}")
        _choice(self, "attention", AttentionKind)
        _choice(self, "remat", RematPolicy)
        for name in ("param_dtype", "dtype", "generation_dtype"):  # unset: the mixed-precision policy
            _choice(self, name, DType, optional=True)
        if self.path is not None and not pathlib.Path(self.path).is_dir():
            raise ValueError(f"ModelSection.path {self.path!r} is not a directory (a local Hugging Face checkpoint)")
        if self.path is not None:  # absolute: a run's config.json is read from anywhere (--resume, export)
            object.__setattr__(self, "path", os.path.abspath(self.path))

    def precision(self, *, backend: str, checkpoint_dtype: str | None) -> Precision:
        """The dtypes this section gives on `backend` for a checkpoint stored in `checkpoint_dtype` (None: the
        built-in model), by `rpegjax.models.precision.resolve_precision`."""
        return resolve_precision(backend=backend, checkpoint_dtype=checkpoint_dtype, param_dtype=self.param_dtype,
                                 dtype=self.dtype, generation_dtype=self.generation_dtype)

    def execution(self) -> dict[str, Any]:
        """The model config's execution fields (`rpegjax.options.MODEL_EXECUTION_FIELDS`) from this section."""
        return {name: getattr(self, name) for name in MODEL_EXECUTION_FIELDS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """Either a built-in `task` (generated, with a held-out split) or a `dataset` (a JSONL or Parquet file, a
    directory of Parquet files, or a Hugging Face `save_to_disk` directory) of GSM8K, MATH, prompt/answer (TRL's
    rows, a prompt of messages too) or verl rows, with an optional `eval_dataset`. `prompt_field` / `answer_field`
    name the row fields when they are not the format's own (nested ones by dotted names,
    `reward_model.ground_truth`). `reward`: specs `package.module:function[=weight]` of user reward functions whose
    weighted sum replaces the task's reward in training (`rpegjax.rewards.custom`); held-out accuracy stays
    the task's verifier. Prompts go through the model tokenizer's chat template per `chat_template`, with
    `system_prompt` as the system turn."""

    task: TaskName = TaskName.ARITHMETIC
    difficulty: Difficulty = Difficulty.EASY
    dataset: str | None = None
    dataset_format: DatasetFormat | None = None  # None: detected from the first row
    eval_dataset: str | None = None
    prompt_field: str | None = None  # None: the format's ("question", "problem" or "prompt")
    answer_field: str | None = None  # None: the format's ("answer" or "solution")
    train_size: int = 8000
    eval_size: int = 400
    prompt_template: str = "{question}"
    chat_template: ChatTemplateMode = ChatTemplateMode.AUTO
    system_prompt: str | None = None
    reward: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self, "train_size", "eval_size")
        choices = [("task", TaskName), ("difficulty", Difficulty), ("chat_template", ChatTemplateMode)]
        choices += [("dataset_format", DatasetFormat)] if self.dataset_format is not None else []
        for name, kind in choices:
            _choice(self, name, kind)
        for name in ("dataset_format", "prompt_field", "answer_field", "eval_dataset"):
            if getattr(self, name) is not None and self.dataset is None:
                raise ValueError(f"DataSection.{name} is set but no dataset is given (set DataSection.dataset)")
        for name in ("prompt_field", "answer_field"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"DataSection.{name} must be a non-empty field name or None, got {value!r}")
        if self.prompt_field is not None and self.prompt_field == self.answer_field:
            raise ValueError(f"DataSection.prompt_field and answer_field are both {self.prompt_field!r}")
        for name in ("dataset", "eval_dataset"):
            path = getattr(self, name)
            if path is not None and not pathlib.Path(path).exists():
                raise ValueError(f"DataSection.{name} {path!r}: no such file or directory")
            if path is not None:  # absolute: a run's config.json is read from anywhere (--resume, export)
                object.__setattr__(self, name, os.path.abspath(path))
        if isinstance(self.reward, str):
            raise ValueError(f"DataSection.reward must be a list of specs, got the string {self.reward!r}")
        object.__setattr__(self, "reward", tuple(self.reward))
        for spec in self.reward:  # the syntax here; importing the functions is the build's
            try:
                RewardSpec.parse(spec)
            except ValueError as error:
                raise ValueError(f"DataSection.reward: {error}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSection:
    prompts_per_step: int = 32
    group_size: int = 8
    max_prompt_len: int | None = None  # None: the longest prompt of the data (train and held out)
    max_new_tokens: int = 32
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    num_slots: int = 256
    chunk_steps: int = 8
    # the sampler's KV cache (`rpegjax.generate.paged_cache`): contiguous (every slot reserves prompt + max new
    # tokens) or paged, with pages of page_size tokens from a pool of kv_pool_tokens per slot replica (None: every
    # slot at capacity); a plan (`graph.plan`) carries its own and a different one here is refused.
    # decode_attention (paged only): gather (XLA, any platform) or pallas (the Pallas paged-attention kernel: each
    # row reads its own pages; CUDA GPUs only)
    kv_cache: CacheLayout = CacheLayout.CONTIGUOUS
    page_size: int = 16
    kv_pool_tokens: int | None = None
    decode_attention: DecodeAttention = DecodeAttention.GATHER
    # multi-turn rollouts with a tool (`rpegjax.envs`): the environment, model turns per episode, response
    # tokens per episode (model and tool; None: max_new_tokens), the tool tags to use instead of the
    # environment's (call start, call end, result start, result end) and the
    # Python sandbox's isolation (bubblewrap; `none` only for trusted code: see rpegjax.envs.python_sandbox)
    env: EnvironmentName = EnvironmentName.NONE
    max_turns: int = 4
    episode_token_budget: int | None = None
    tool_tags: tuple[str, ...] = ()
    sandbox_isolation: SandboxIsolation = SandboxIsolation.BUBBLEWRAP
    # partial rollouts (`rpegjax.runtime.partial_rollouts`): inflight_batches batches of groups in flight, a step
    # trains the first batch to complete and carries the rest into the next step's generation (newer weights);
    # a trained token lags the trainer by at most max_token_lag versions (None: graph.async_bound + 2), the groups
    # that would lag more are waited for or dropped (stale_policy); inflight_weights: a step's generation takes newer
    # weights between decode chunks (None: on with partial rollouts under an asynchrony bound >= 1, unless a plan
    # sets them: plans do not cost it): once inflight_after of the groups its batch lacked have completed, the next
    # version, waiting for it (reproducible), or with inflight_after=none each as soon as it is published (no
    # wait; the batches then depend on timing);
    # partial_carry: carried sequences recompute their prefix with the new weights, or keep their KV pages
    # (kv_cache=paged)
    partial: bool = False
    max_token_lag: int | None = None
    stale_policy: StalePolicy = StalePolicy.WAIT
    inflight_batches: int = 2
    inflight_weights: bool | None = None
    inflight_after: float | None = 0.5
    partial_carry: CarryMode = CarryMode.RECOMPUTE

    def __post_init__(self) -> None:
        _positive(self, "prompts_per_step", "group_size", "max_new_tokens", "num_slots", "chunk_steps", "max_turns")
        _choice(self, "stale_policy", StalePolicy)
        _choice(self, "partial_carry", CarryMode)
        if self.max_token_lag is not None:
            _positive(self, "max_token_lag")
        if self.inflight_after is not None and not 0 < self.inflight_after <= 1:
            raise ValueError(f"RolloutSection.inflight_after must be a share in (0, 1] or none, got "
                             f"{self.inflight_after!r}")
        if self.inflight_batches < 2:
            raise ValueError(f"RolloutSection.inflight_batches must be >= 2 (one batch completes while the others "
                             f"decode), got {self.inflight_batches}")
        _choice(self, "env", EnvironmentName)
        _choice(self, "sandbox_isolation", SandboxIsolation)
        _choice(self, "kv_cache", CacheLayout)
        _choice(self, "decode_attention", DecodeAttention)
        if self.decode_attention != DecodeAttention.GATHER and self.kv_cache != CacheLayout.PAGED:
            raise ValueError(f"RolloutSection.decode_attention={self.decode_attention} reads the paged pool; set "
                             "rollout.kv_cache=paged too")
        _positive(self, "page_size")
        if self.kv_pool_tokens is not None:
            _positive(self, "kv_pool_tokens")
            if self.kv_cache != CacheLayout.PAGED:
                raise ValueError(f"RolloutSection.kv_pool_tokens={self.kv_pool_tokens} sizes the paged cache's pool; "
                                 "set rollout.kv_cache=paged too")
        if self.max_prompt_len is not None:
            _positive(self, "max_prompt_len")
        if self.episode_token_budget is not None:
            _positive(self, "episode_token_budget")
            if self.episode_token_budget > self.max_new_tokens:
                raise ValueError(f"RolloutSection.episode_token_budget ({self.episode_token_budget}) must fit in "
                                 f"max_new_tokens ({self.max_new_tokens}): an episode is one training row")
        if self.tool_tags and (len(self.tool_tags) != 4 or not all(self.tool_tags)):
            raise ValueError(f"RolloutSection.tool_tags must be 4 non-empty strings (call start, call end, result "
                             f"start, result end) or empty, got {self.tool_tags!r}")
        if self.num_slots < self.group_size:
            raise ValueError(f"RolloutSection.num_slots ({self.num_slots}) must hold a whole group ({self.group_size})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartSection:
    """Supervised warm start on the task's reference solutions (built-in tasks), cached in `cache_dir`."""

    steps: int = 150
    batch_size: int = 64
    learning_rate: float = 1e-3
    cache_dir: str = "~/.cache/rpegjax/warmstart"

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"WarmStartSection.steps must be >= 0, got {self.steps!r}")
        _positive(self, "batch_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRASection:
    """LoRA (`rpegjax.models.lora`): `rank` 0 trains every weight; rank r > 0 puts adapters of rank r, scaled by
    alpha / r, on the `targets` projections (q, k, v, o, gate, up, down) and trains only them: the optimiser state
    and the checkpoints hold the adapters, the base weights are loaded from `model.path` (or built) and frozen, and
    they are the KL reference. `generation`: `merged` decodes the base model with the adapters merged into the
    generation copy at each weight sync (measured 1.0-1.3x faster, benchmarks/bench_lora_generation.py), `adapters` the
    adapted model. `learning_rate`: the optimiser's in a LoRA run (None: 10x the algorithm's learning rate, as
    adapters want a larger step than full fine-tuning). `dropout`: PEFT's lora_dropout, on the adapters' input in the
    update's forward only, its masks drawn from `train.seed` and the optimiser step (so a resumed run draws the same)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(t.value for t in LoRATarget)
    dropout: float = 0.0
    generation: LoRAGeneration = LoRAGeneration.MERGED
    learning_rate: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"LoRASection.rank must be an integer >= 0 (0: no LoRA), got {self.rank!r}")
        _choice(self, "generation", LoRAGeneration)
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"LoRASection.learning_rate must be positive or unset, got {self.learning_rate!r}")
        if self.rank:
            self.config()  # checks alpha, targets and dropout
            return
        defaults = LoRASection.__dataclass_fields__
        for name in ("alpha", "targets", "dropout", "generation", "learning_rate"):
            if getattr(self, name) != defaults[name].default:  # set for adapters that will not exist
                raise ValueError(f"LoRASection.{name}={getattr(self, name)!r} needs LoRA adapters (rank > 0); rank is 0 "
                                 "(set --lora-rank)")

    def check_rank(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   intermediate_size: int, where: str) -> None:
        """The rank must not exceed min(in, out) of any projection it adapts (a larger one adds parameters, not
        rank); `where` names the model whose widths these are."""
        if not self.enabled:
            return
        shapes = {"q": (hidden_size, num_heads * head_dim), "k": (hidden_size, num_kv_heads * head_dim),
                  "v": (hidden_size, num_kv_heads * head_dim), "o": (num_heads * head_dim, hidden_size),
                  "gate": (hidden_size, intermediate_size), "up": (hidden_size, intermediate_size),
                  "down": (intermediate_size, hidden_size)}
        target = min(self.targets, key=lambda name: min(shapes[name]))
        if self.rank > min(shapes[target]):
            width_in, width_out = shapes[target]
            raise ValueError(f"LoRASection.rank={self.rank} exceeds min(in, out) = {min(shapes[target])} of the "
                             f"targeted projection {target} ({width_in} -> {width_out}) of {where}; a rank is at most "
                             "the smaller width of every projection it adapts")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def config(self) -> LoRAConfig | None:
        """The adapters of this section, None without LoRA."""
        if not self.enabled:
            return None
        try:
            return LoRAConfig(rank=self.rank, alpha=self.alpha, targets=self.targets, dropout=self.dropout)
        except ValueError as error:
            raise ValueError(str(error).replace("LoRAConfig.", "LoRASection.")) from None

    def optimizer(self, optimizer: OptimizerConfig) -> OptimizerConfig:
        """The optimiser of a run with this section: `optimizer` itself without LoRA, else with LoRA's rate."""
        if not self.enabled:
            return optimizer
        rate = 10 * optimizer.learning_rate if self.learning_rate is None else self.learning_rate
        return dataclasses.replace(optimizer, learning_rate=rate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphSection:
    """Structure and execution of the RPEG: asynchrony bound k, fusion of inference stages, micro-batches
    of generation (pieces handed downstream as they finish), and placement.

    `mesh` lays out the training devices. `rollout_devices` = 0 colocates generation with training on all
    devices; n > 0 gives generation the first n devices (laid out by `rollout_mesh`) and training the rest,
    so that with k >= 1 the two run at the same time. `plan` names a graph JSON (a run's graph.json,
    or `scripts/plan.py --json` output: its best plan) to execute instead of the graph these fields describe.
    `optimizer_sharding` / `optimizer_offload`: `rpegjax.graph.ir.Execution`'s fields of those names.
    A `context` axis of `mesh` splits each training row's sequence over its devices (context parallelism); an
    `expert` axis splits a mixture-of-experts model's experts (expert parallelism; rows split over it too);
    `sequence_parallel` splits the residual stream over `tensor` too (`Execution.sequence_parallel`)."""

    async_bound: int = 1
    fuse: bool = True
    generate_microbatches: int = 1
    mesh: str = "data=-1"
    rollout_devices: int = 0
    rollout_mesh: str = "data=-1"
    plan: str | None = None
    # AdamW's moments as their parameters ("params") or also split over the data axes ("data": ZeRO-1); and the
    # optimiser state in host memory between updates (colocated plans: generation gets its device memory)
    optimizer_sharding: OptimizerSharding = OptimizerSharding.PARAMS
    optimizer_offload: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        _choice(self, "optimizer_sharding", OptimizerSharding)
        if not isinstance(self.optimizer_offload, bool):
            raise ValueError(f"GraphSection.optimizer_offload must be true or false, got {self.optimizer_offload!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"GraphSection.sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if CONTEXT_AXIS in parse_mesh(self.rollout_mesh):
            raise ValueError(f"GraphSection.rollout_mesh {self.rollout_mesh!r}: the sampler does not split rows over a "
                             f"{CONTEXT_AXIS!r} axis (context parallelism is for training: put it in graph.mesh)")
        if isinstance(self.async_bound, bool) or not isinstance(self.async_bound, int) or self.async_bound < 0:
            raise ValueError(f"GraphSection.async_bound must be an integer >= 0, got {self.async_bound!r}")
        if isinstance(self.rollout_devices, bool) or not isinstance(self.rollout_devices, int) or self.rollout_devices < 0:
            raise ValueError(f"GraphSection.rollout_devices must be an integer >= 0, got {self.rollout_devices!r}")
        _positive(self, "generate_microbatches")
        for name in ("mesh", "rollout_mesh"):
            # an unknown axis name would match no sharding rule and silently replicate everything
            unknown = [axis for axis in parse_mesh(getattr(self, name)) if axis not in MESH_AXES]
            if unknown:
                raise ValueError(f"GraphSection.{name} {getattr(self, name)!r}: unknown mesh axis {unknown[0]!r}; "
                                 f"axes are {list(MESH_AXES)}")

    @property
    def mesh_axes(self) -> dict[str, int]:
        return parse_mesh(self.mesh)

    @property
    def rollout_mesh_axes(self) -> dict[str, int]:
        return parse_mesh(self.rollout_mesh)


class WandbMode(enum.StrEnum):
    OFFLINE = "offline"
    ONLINE = "online"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
    steps: int = 300
    seed: int = 0
    run_dir: str | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 50  # held-out accuracy every N steps besides the start and the end (0: only those two)
    # every N steps, `samples_per_step` completions (prompt, response, reward, verdict) go to the console,
    # samples.jsonl and TensorBoard (0: never); evaluations write their first samples there too
    sample_every: int = 10
    samples_per_step: int = 4
    export_hf: bool = True  # write the final policy as a Hugging Face directory, RUN_DIR/hf
    # JAX's persistent compilation cache: programs that took over a second to compile are kept on disk and
    # reused by the next run with the same shapes (`rpegjax.runtime.compilation_cache`); the directory
    # defaults to $XDG_CACHE_HOME/rpegjax/jax (~/.cache/rpegjax/jax)
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    # also log metrics and samples to Weights & Biases (the optional `wandb` package: pip install rpegjax[wandb]);
    # offline by default (RUN_DIR/wandb, `wandb sync` uploads it), online sends as the run goes
    wandb: bool = False
    wandb_project: str = "rpegjax"
    wandb_mode: WandbMode = WandbMode.OFFLINE
    reward_timeout_s: float = 10.0
    reward_workers: int = 2
    # limits of each reward worker process (a user's reward must not take the machine down); None: no limit
    reward_memory_mb: int | None = 4096
    reward_cpu_s: int | None = 60
    # steps with a non-finite loss or gradient norm (or rewards a worker returned as non-finite) tolerated
    # before the run stops with an error; checkpoints are never written from non-finite weights
    max_nonfinite_steps: int = 3

    def __post_init__(self) -> None:
        _positive(self, "steps", "checkpoint_every", "keep_checkpoints", "reward_workers")
        for name in ("reward_memory_mb", "reward_cpu_s"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if isinstance(self.max_nonfinite_steps, bool) or not isinstance(self.max_nonfinite_steps, int) \
                or self.max_nonfinite_steps < 0:
            raise ValueError(f"TrainSection.max_nonfinite_steps must be an integer >= 0, "
                             f"got {self.max_nonfinite_steps!r}")
        for name in ("eval_every", "sample_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainSection.{name} must be an integer >= 0, got {value!r}")
        _positive(self, "samples_per_step")
        _choice(self, "wandb_mode", WandbMode)
        if self.reward_timeout_s <= 0:
            raise ValueError(f"TrainSection.reward_timeout_s must be positive, got {self.reward_timeout_s!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOSection(GRPOConfig):
    """The GRPO learner's settings (`GRPOConfig`) and what the job does around the learner:

    - `dynamic_sampling`: DAPO's dynamic sampling (`rpegjax.learners.group_filter`), run by the rollout
      stage: groups whose rewards all agree are dropped and more prompts sampled, at most `max_extra_rounds`
      rounds past the first; a batch still short then trains on the groups found (`on_sampling_cap=train`,
      logged as `dynamic_sampling/cap_hit`) or stops the run (`error`).
    - `overlong_buffer` > 0: DAPO's soft overlong punishment (`rpegjax.rewards.format.overlong_penalty`) over the
      last `overlong_buffer` tokens of the response budget (`rollout.max_new_tokens`), scaled by
      `overlong_penalty` and added to the task reward.
    """

    dynamic_sampling: bool = False
    max_extra_rounds: int = 4
    on_sampling_cap: SamplingCapAction = SamplingCapAction.TRAIN
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice(self, "on_sampling_cap", SamplingCapAction)
        for name in ("max_extra_rounds", "overlong_buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GRPOSection.{name} must be an integer >= 0, got {value!r}")
        if not self.overlong_penalty >= 0:
            raise ValueError(f"GRPOSection.overlong_penalty must be >= 0, got {self.overlong_penalty!r}")
        if self.dynamic_sampling and self.advantage == AdvantageKind.REINFORCE_PP:
            raise ValueError("GRPOSection.dynamic_sampling drops groups of zero advantage, which needs a group baseline; "
                             f"advantage {self.advantage.value!r} has none (use grpo, dr-grpo, rloo or "
                             "reinforce++-baseline)")

    def dynamic_sampling_config(self) -> DynamicSamplingConfig | None:
        """What the runtime's rollout stage needs for dynamic sampling, or None when off."""
        if not self.dynamic_sampling:
            return None
        return DynamicSamplingConfig(max_extra_rounds=self.max_extra_rounds, on_cap=self.on_sampling_cap)

    def overlong_shaping(self, max_new_tokens: int) -> Callable[[np.ndarray], np.ndarray] | None:
        """The additive reward term of response lengths (int [rows] -> float32 [rows]), or None when off."""
        if self.overlong_buffer == 0:
            return None
        return functools.partial(_scaled_overlong_penalty, max_length=max_new_tokens,
                                 cache_length=self.overlong_buffer, scale=self.overlong_penalty)


def _scaled_overlong_penalty(lengths: np.ndarray, *, max_length: int, cache_length: int, scale: float) -> np.ndarray:
    return (scale * overlong_penalty(lengths, max_length=max_length, cache_length=cache_length)).astype(np.float32)


class Recipe(enum.StrEnum):
    DEFAULT = "default"
    DAPO = "dapo"


# The fields a recipe sets; everything else keeps its value.
RECIPE_FIELDS = ("grpo.clip_low", "grpo.clip_high", "grpo.aggregation", "grpo.kl_coef", "grpo.dynamic_sampling",
                 "grpo.overlong_buffer", "grpo.overlong_penalty")


def recipe_overrides(recipe: Recipe | str, *, max_new_tokens: int) -> dict[str, str]:
    """The `--section.field` values of `recipe` (flags given explicitly win over them; `RunConfig.with_recipe`).

    - `default`: the job's GRPO defaults (`default_grpo()`): clip 0.2/0.2, token-mean, no KL, no dynamic
      sampling, no overlong shaping.
    - `dapo`: DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
      arXiv:2503.14476): clip-higher eps_low 0.2 / eps_high 0.28 (section 3.1), token-level loss (3.3),
      no KL (2.3), dynamic sampling (3.2), overlong reward shaping (3.4) with a buffer of 20% of the response
      budget (the paper: L_cache 4096 of L_max 20480) and penalty factor 1.
    """
    recipe = Recipe(recipe)
    if recipe == Recipe.DEFAULT:
        base = default_grpo()
        values = {"grpo.clip_low": base.clip_low, "grpo.clip_high": base.clip_high,
                  "grpo.aggregation": base.aggregation.value, "grpo.kl_coef": base.kl_coef,
                  "grpo.dynamic_sampling": False, "grpo.overlong_buffer": 0, "grpo.overlong_penalty": 1.0}
    else:
        values = {"grpo.clip_low": 0.2, "grpo.clip_high": 0.28, "grpo.aggregation": "token-mean", "grpo.kl_coef": 0.0,
                  "grpo.dynamic_sampling": True, "grpo.overlong_buffer": max(1, round(0.2 * max_new_tokens)),
                  "grpo.overlong_penalty": 1.0}
    return {"recipe": recipe.value, **{name: str(value) for name, value in values.items()}}


# Where the job's defaults differ from the library's, and why (the one place this is written down):
# - `GRPOConfig()` / `PPOConfig()` are on-policy (decoupled=False, no importance cap), with `OptimizerConfig()`'s
#   lr 1e-6, b2 0.999 and weight decay 0.01 — the usual settings for fine-tuning billion-parameter checkpoints.
# - The job runs with asynchrony bound k = 1 by default, so it corrects for the lag (decoupled PPO with the
#   sampler's behaviour log-probs, importance weights capped at 5), and its default model is the 2-layer CPU model
#   trained from a warm start, which learns in minutes only at lr 1e-4, b2 0.99, no weight decay. PPO's GAE uses
#   lam = 1 (outcome rewards on the last token; the library's 0.95 suits per-token rewards).
# Set any of them back with flags (`--grpo.decoupled=false --grpo.importance_cap=none`, `--lr 1e-6`, ...).
def default_grpo() -> GRPOSection:
    return GRPOSection(group_size=8, decoupled=True, importance_cap=5.0,
                       optimizer=OptimizerConfig(learning_rate=1e-4, b2=0.99, weight_decay=0.0))


def default_ppo() -> PPOConfig:
    return PPOConfig(decoupled=True, importance_cap=5.0, gamma=1.0, lam=1.0,
                     optimizer=OptimizerConfig(learning_rate=1e-4, b2=0.99, weight_decay=0.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a training run needs. `grpo` is used by train_grpo.py, `ppo` by train_ppo.py; the
    rollout's group size and temperature are the algorithm's (`grpo.group_size`, `grpo.temperature` and
    `ppo.temperature` are derived from them)."""

    algorithm: Algorithm = Algorithm.GRPO
    # the preset the run started from (`with_recipe`, `--recipe`); its values are in the sections below
    recipe: Recipe = Recipe.DEFAULT
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    lora: LoRASection = dataclasses.field(default_factory=LoRASection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    warm_start: WarmStartSection = dataclasses.field(default_factory=WarmStartSection)
    graph: GraphSection = dataclasses.field(default_factory=GraphSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    grpo: GRPOSection = dataclasses.field(default_factory=default_grpo)
    ppo: PPOConfig = dataclasses.field(default_factory=default_ppo)
    # how this launch joins other processes (flags here win over JAX_* / SLURM_* variables); describes
    # the launch, not the run: `--resume` starts from the defaults again
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        _choice(self, "algorithm", Algorithm)
        _choice(self, "recipe", Recipe)
        if not isinstance(self.grpo, GRPOSection):  # a library GRPOConfig: the job's own options at their defaults
            object.__setattr__(self, "grpo", GRPOSection(**{f.name: getattr(self.grpo, f.name)
                                                            for f in dataclasses.fields(GRPOConfig)}))
        # one source of truth for the group size and the sampling temperature: the rollout's (GRPO's
        # advantages need the group size; the learners' log-probs must use the sampler's temperature)
        object.__setattr__(self, "grpo", dataclasses.replace(
            self.grpo, group_size=self.rollout.group_size, temperature=self.rollout.temperature))
        object.__setattr__(self, "ppo", dataclasses.replace(self.ppo, temperature=self.rollout.temperature))
        if self.grpo.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(f"grpo.overlong_buffer ({self.grpo.overlong_buffer}) must not exceed the response budget "
                             f"rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        if self.recipe == Recipe.DAPO and self.algorithm != Algorithm.GRPO:
            raise ValueError(f"recipe {self.recipe.value!r} is a GRPO recipe; this run uses {self.algorithm.value}")
        if self.model.path is None:  # a model from config.json is checked when it is read (build)
            self.lora.check_rank(**{name: getattr(self.model, name) for name in _WIDTHS}, where="the built model "
                                 f"(model.hidden_size={self.model.hidden_size})")
        self._check_partial()
        if self.rollout.prompts_per_step % self.graph.generate_microbatches:
            raise ValueError(f"graph.generate_microbatches ({self.graph.generate_microbatches}) must divide "
                             f"rollout.prompts_per_step ({self.rollout.prompts_per_step})")

    def _check_partial(self) -> None:
        rollout = self.rollout
        if rollout.inflight_weights and not rollout.partial:
            raise ValueError("rollout.inflight_weights continues partial rollouts with newer weights; set "
                             "rollout.partial=true too")
        if rollout.inflight_after != RolloutSection.inflight_after and (
                not rollout.partial or rollout.inflight_weights is False):
            raise ValueError(f"rollout.inflight_after={rollout.inflight_after} says when partial rollouts take "
                             "weights in flight; set rollout.partial=true (and leave rollout.inflight_weights unset "
                             "or true)")
        if not rollout.partial:
            if rollout.partial_carry != CarryMode.RECOMPUTE:
                raise ValueError(f"rollout.partial_carry={rollout.partial_carry} chooses how partial rollouts carry "
                                 "sequences; set rollout.partial=true too")
            return
        if rollout.partial_carry == CarryMode.PAGES and rollout.kv_cache != CacheLayout.PAGED:
            raise ValueError("rollout.partial_carry=pages keeps carried sequences' KV pages in the paged pool; set "
                             "rollout.kv_cache=paged too (or partial_carry=recompute)")
        if rollout.partial_carry == CarryMode.PAGES and rollout.kv_pool_tokens is not None:
            raise ValueError("rollout.partial_carry=pages needs a pool that holds every slot at full capacity (a kept "
                             "sequence must never be preempted); leave rollout.kv_pool_tokens unset")
        if rollout.max_token_lag is not None and rollout.max_token_lag <= self.graph.async_bound:
            raise ValueError(f"rollout.max_token_lag ({rollout.max_token_lag}) must exceed graph.async_bound "
                             f"({self.graph.async_bound}): new tokens already lag by it, no sequence could be carried")
        if self.algorithm == Algorithm.GRPO and self.grpo.dynamic_sampling:
            raise ValueError("rollout.partial with grpo.dynamic_sampling: not supported yet; use one of them")
        if rollout.env != EnvironmentName.NONE:
            raise ValueError(f"rollout.partial with rollout.env={rollout.env.value}: multi-turn episodes are not "
                             "continued across steps yet")

    def algorithm_section(self) -> GRPOSection | PPOConfig:
        """The section of this run's algorithm, `grpo` or `ppo` (its KL weight, optimiser, mini-batches)."""
        return {Algorithm.GRPO: self.grpo, Algorithm.PPO: self.ppo}[self.algorithm]

    @property
    def shares_actor_critic(self) -> bool:
        """Whether the actor carries the critic (PPO with `ppo.critic = shared`: a value head on the actor's trunk)."""
        return self.algorithm is Algorithm.PPO and self.ppo.critic is CriticMode.SHARED

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return from_jsonable(cls, json.loads(text))

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> RunConfig:
        """The RunConfig saved in `path` (a run's config.json, or a `--config` file: JSON, or YAML when it ends
        in .yaml/.yml); an unreadable file, invalid JSON/YAML, a non-object, an unknown field or a mistyped
        value raises `ConfigFileError` naming the file and the field."""
        path = pathlib.Path(path)
        data = read_config_file(path)
        if isinstance(data, dict) and isinstance(data.get("rollout"), dict):
            # runs saved before the Python sandbox moved to bubblewrap hold rollout.sandbox_network (namespace or
            # audit-hook): sandbox_isolation replaces it, and its default is stronger than either old mode
            data["rollout"].pop("sandbox_network", None)
        try:
            # fields the file leaves out keep the job's defaults (of the file's algorithm)
            algorithm = data.get("algorithm", Algorithm.GRPO) if isinstance(data, dict) else Algorithm.GRPO
            try:
                base = cls(algorithm=algorithm)
            except (TypeError, ValueError):
                raise ConfigFileError(f"algorithm: {algorithm!r} is not one of {[a.value for a in Algorithm]}") from None
            return from_jsonable(cls, data, base=base)
        except ConfigFileError as error:
            raise ConfigFileError(f"{path}: {error}") from None

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def with_recipe(self, recipe: Recipe | str) -> RunConfig:
        """This config with `recipe`'s preset values (`recipe_overrides`) and `recipe` recorded."""
        return apply_overrides(self, recipe_overrides(recipe, max_new_tokens=self.rollout.max_new_tokens))
