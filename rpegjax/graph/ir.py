"""The RPEG intermediate representation: stages, versioned data edges, placements, and their validation.

One RL step is a graph. A `Stage` is a unit of work (generate, reward, log-probs, values, advantages,
updates, weight sync) on a named `Placement` (a sub-mesh with parallel sizes). An `Edge` carries a named
payload from a producer stage to a consumer stage and says which step's output the consumer reads.

Version convention (read this before writing a runtime, planner or transform)
----------------------------------------------------------------------------
* Steps are numbered t = 0, 1, 2, ... Every stage runs once per step.
* `Edge.version_offset = d >= 0`: the consumer at step t reads what the producer wrote at step t - d.
  d = 0 is a same-step edge (these must form a DAG); d >= 1 is a cross-step edge, always backwards in time.
* Parameters are explicit payloads whose names start with `params:` (`params:actor`, `params:critic`,
  `params:actor:generate` for the generation layout, `params:reference`). The update stage at step t reads
  the parameters it wrote at step t - 1 (a self edge with d = 1) and writes version t + 1. Version 0 is the
  initial checkpoint, and a read that reaches before step 0 gets version 0.
  So a consumer at step t reading parameters over an edge of offset d sees version `t - d + 1` (clamped at 0)
  and a staleness of `d - 1` versions: d = 1 is on-policy (the weights after the previous step's update).
* Bounded asynchrony k (`Graph.async_bound`): generation at step t reads actor weights of version t - k, i.e.
  its `params:*` edge has offset k + 1. Validation therefore allows parameter edges up to offset
  `async_bound + 1` and data edges up to offset `async_bound`.
* Payloads that come from outside the graph (prompts from the data loader, the frozen reference weights)
  are listed in `Graph.external` and need no producer edge.

Everything here is plain Python (no JAX), immutable and JSON-serialisable; transforms live in
`rpegjax.graph.transforms`, text/DOT rendering in `rpegjax.graph.render`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

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

PARAMS_PREFIX = "params:"
HOST_PLACEMENT = "host"  # host stages run in the controller process, not on a sub-mesh

OptionValue = int | float | str | bool


class GraphError(ValueError):
    """An invalid graph or a refused transform; `stage` names the offending stage when there is one."""

    def __init__(self, message: str, *, stage: str | None = None):
        super().__init__(message)
        self.stage = stage


class StageKind(enum.StrEnum):
    GENERATE = "generate"
    REWARD = "reward"
    REF_LOGPROB = "ref_logprob"
    OLD_LOGPROB = "old_logprob"
    CRITIC_VALUE = "critic_value"
    ADVANTAGE = "advantage"
    ACTOR_UPDATE = "actor_update"
    CRITIC_UPDATE = "critic_update"
    WEIGHT_SYNC = "weight_sync"


class Role(enum.StrEnum):
    """Which model's weights a stage uses; NONE for stages without a model (reward, advantage)."""

    ACTOR = "actor"
    CRITIC = "critic"
    REFERENCE = "reference"
    NONE = "none"


class Payload(enum.StrEnum):
    """Standard payload names used by the builders; any other non-empty string is a valid payload too."""

    PROMPTS = "prompts"  # external: the step's prompt batch from the data loader
    RESPONSES = "responses"  # prompt + completion tokens and their mask, [b, t]
    BEHAVIOUR_LOGPROBS = "behaviour_logprobs"  # log-probs recorded by the sampler, for off-policy correction
    REWARDS = "rewards"  # one scalar per sequence, [b]
    REF_LOGPROBS = "ref_logprobs"
    OLD_LOGPROBS = "old_logprobs"  # proximal policy: the current weights before this step's update
    VALUES = "values"
    ADVANTAGES = "advantages"
    RETURNS = "returns"
    ACTOR_PARAMS = "params:actor"  # training layout, written by actor_update
    ACTOR_GENERATE_PARAMS = "params:actor:generate"  # generation layout, written by weight_sync
    CRITIC_PARAMS = "params:critic"
    REFERENCE_PARAMS = "params:reference"  # external and frozen


class Algorithm(enum.StrEnum):
    GRPO = "grpo"
    PPO = "ppo"


class CriticMode(enum.StrEnum):
    """Where PPO's critic lives."""

    SEPARATE = "separate"  # its own model and optimiser
    SHARED = "shared"  # actor trunk + value head (`transforms.share_actor_critic`)


INFERENCE_KINDS = frozenset({StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB, StageKind.CRITIC_VALUE})
UPDATE_KINDS = frozenset({StageKind.ACTOR_UPDATE, StageKind.CRITIC_UPDATE})


def is_params_payload(payload: str) -> bool:
    """True for parameter-state payloads (`params:...`), which may reach one step further back than data."""
    return payload.startswith(PARAMS_PREFIX)


def _frozen_sizes(sizes: Mapping[str, int], where: str) -> Mapping[str, int]:
    if not isinstance(sizes, Mapping) or not sizes:
        raise GraphError(f"{where}: parallel sizes must be a non-empty mapping of axis name to size, got {sizes!r}")
    for axis, size in sizes.items():
        if not isinstance(axis, str) or not axis:
            raise GraphError(f"{where}: parallel axis names must be non-empty strings, got {axis!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise GraphError(f"{where}: parallel size of axis {axis!r} must be a positive integer, got {size!r}")
    return MappingProxyType(dict(sizes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """A named sub-mesh: `parallel` axis sizes (e.g. {"data": 2, "fsdp": 1, "tensor": 2}) over `size` devices.

    `devices` pins explicit device indices (length == size); None leaves the choice of `size` devices to the
    runtime. Placements may overlap: stages on overlapping placements time-share those devices.
    """

    name: str
    parallel: Mapping[str, int]
    devices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == HOST_PLACEMENT:
            raise GraphError(f"Placement.name must be a non-empty string other than {HOST_PLACEMENT!r}, got {self.name!r}")
        object.__setattr__(self, "parallel", _frozen_sizes(self.parallel, f"placement {self.name!r}"))
        if self.devices is not None:
            devices = tuple(self.devices)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices):
                raise GraphError(f"placement {self.name!r}: devices must be non-negative integers, got {devices!r}")
            if len(set(devices)) != len(devices):
                raise GraphError(f"placement {self.name!r}: devices {devices!r} contain duplicates")
            if len(devices) != self.size:
                raise GraphError(
                    f"placement {self.name!r}: {len(devices)} devices {devices!r} but parallel sizes "
                    f"{dict(self.parallel)} multiply to {self.size}"
                )
            object.__setattr__(self, "devices", devices)

    def __hash__(self) -> int:
        return hash((self.name, tuple(self.parallel.items()), self.devices))

    @property
    def size(self) -> int:
        return math.prod(self.parallel.values())

    @property
    def device_indices(self) -> tuple[int, ...]:
        """The explicit devices, else the first `size` (what the runtime and the performance model pick)."""
        return self.devices if self.devices is not None else tuple(range(self.size))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One unit of work per step.

    Fields:
      inputs / outputs: payload names read / written; each input arrives over exactly one edge unless the
        graph lists it as external.
      placement: a key of `Graph.placements`, or `HOST_PLACEMENT` for host stages (`host=True`).
      parallel: this stage's own axis sizes on its placement (e.g. generation with tensor parallelism on the
        devices that train with FSDP); None uses the placement's. Must multiply to the placement size.
      microbatches: the stage runs in this many pieces so that consumers can start on finished pieces.
      fused_group: stages with the same group name run as one jit-compiled program.
      merged_kinds: kinds of work absorbed by this stage (e.g. an old_logprob stage that also computes
        values after `share_actor_critic`).
      options: algorithm knobs the runtime and performance model read (e.g. {"epochs": 1, "minibatches": 4}).
    """

    name: str
    kind: StageKind
    role: Role
    placement: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    parallel: Mapping[str, int] | None = None
    microbatches: int = 1
    fused_group: str | None = None
    host: bool = False
    merged_kinds: tuple[StageKind, ...] = ()
    options: Mapping[str, OptionValue] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"Stage.name must be a non-empty string, got {self.name!r}")
        where = f"stage {self.name!r}"
        try:
            object.__setattr__(self, "kind", StageKind(self.kind))
            object.__setattr__(self, "role", Role(self.role))
            object.__setattr__(self, "merged_kinds", tuple(StageKind(k) for k in self.merged_kinds))
        except ValueError as error:
            raise GraphError(f"{where}: {error}", stage=self.name) from None
        if self.host and self.role is not Role.NONE:
            raise GraphError(f"{where}: host stages use no model, so role must be 'none', got {self.role.value!r}", stage=self.name)
        if self.host and self.placement != HOST_PLACEMENT:
            raise GraphError(f"{where}: host stages have placement {HOST_PLACEMENT!r}, got {self.placement!r}", stage=self.name)
        if not self.host and (not isinstance(self.placement, str) or not self.placement or self.placement == HOST_PLACEMENT):
            raise GraphError(f"{where}: device stages need a placement name (not {HOST_PLACEMENT!r}), got {self.placement!r}", stage=self.name)
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise GraphError(f"{where}: microbatches must be an integer >= 1, got {self.microbatches!r}", stage=self.name)
        if self.fused_group is not None and (not isinstance(self.fused_group, str) or not self.fused_group):
            raise GraphError(f"{where}: fused_group must be None or a non-empty string, got {self.fused_group!r}", stage=self.name)
        for field in ("inputs", "outputs"):
            names = tuple(getattr(self, field))
            if any(not isinstance(p, str) or not p for p in names) or len(set(names)) != len(names):
                raise GraphError(f"{where}: {field} must be distinct non-empty payload names, got {names!r}", stage=self.name)
            object.__setattr__(self, field, tuple(str(p) for p in names))  # Payload members become plain str
        if self.parallel is not None:
            if self.host:
                raise GraphError(f"{where}: host stages take no parallel sizes", stage=self.name)
            object.__setattr__(self, "parallel", _frozen_sizes(self.parallel, where))
        if not isinstance(self.options, Mapping):
            raise GraphError(f"{where}: options must be a mapping, got {self.options!r}", stage=self.name)
        for key, value in self.options.items():
            if not isinstance(key, str) or not isinstance(value, OptionValue):
                raise GraphError(f"{where}: option {key!r}={value!r} is not a str -> int/float/str/bool entry", stage=self.name)
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def __hash__(self) -> int:
        parallel = None if self.parallel is None else tuple(self.parallel.items())
        return hash((self.name, self.kind, self.role, self.placement, self.inputs, self.outputs, parallel,
                     self.microbatches, self.fused_group, self.host, self.merged_kinds, tuple(self.options.items())))

    @property
    def kinds(self) -> tuple[StageKind, ...]:
        """The stage's own kind followed by the kinds merged into it."""
        return (self.kind, *self.merged_kinds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Edge:
    """`dst` at step t reads payload `payload` written by `src` at step t - version_offset (see module doc)."""

    src: str
    dst: str
    payload: str
    version_offset: int = 0

    def __post_init__(self) -> None:
        for field in ("src", "dst", "payload"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise GraphError(f"Edge.{field} must be a non-empty string, got {getattr(self, field)!r} in {self}")
            object.__setattr__(self, field, str(getattr(self, field)))
        if isinstance(self.version_offset, bool) or not isinstance(self.version_offset, int):
            raise GraphError(f"edge {self.label()}: version_offset must be an integer, got {self.version_offset!r}", stage=self.dst)

    @property
    def is_params(self) -> bool:
        return is_params_payload(self.payload)

    def label(self) -> str:
        return f"{self.src} -[{self.payload}@t-{self.version_offset}]-> {self.dst}"

    def read_version(self, step: int) -> int:
        """The step whose output the consumer reads at `step`; for `params:` payloads, the parameter version."""
        produced = step - self.version_offset
        return max(produced + 1, 0) if self.is_params else produced


@dataclasses.dataclass(frozen=True, kw_only=True)
class Execution:
    """How the plan's programs execute: the one record the runtime applies (`rpegjax.runtime.assembly`) and the
    performance model reads (`rpegjax.perf.model.stage_costs.ExecutionOptions.for_execution`).

    attention / attention_block_size: the full-sequence attention kernel (training, log-probs, prefill).
    remat / scan_layers: what each layer keeps for the backward pass; the layer stack as one `lax.scan`.
    kv_cache / page_size / kv_pool_tokens: the sampler's KV-cache layout; the paged pool's tokens per slot
    replica (None: every slot at capacity, so no sequence is ever preempted but nothing is saved either).
    decode_attention: how the paged sampler's decode attends (`gather`: XLA, each row over the window of the
    longest; `pallas`: the Pallas paged-attention kernel, each row over its own pages; CUDA GPUs only).
    param_dtype / dtype: stored weights (and optimiser moments) / matmul compute.
    update_microbatches: gradient-accumulation pieces of every update mini-batch (memory against passes).
    inference_rows: at most this many rows (of the whole batch) per row micro-batch of an inference stage
    (log-probs, values: `rpegjax.learners.inference`); None: each stage's rows at once.
    decode_slots: the sampler's concurrent sequences (all replicas; None: the run's `rollout.num_slots`).
    packing / max_tokens_per_micro_batch: the update and the inference stages pack the rollout's sequences into
    rows of this many tokens, one row per row shard per micro-batch (`rpegjax.learners.packing`), in place of
    update micro-batches and inference rows; off: every row of a batch is padded to the same length.
    optimizer_sharding: AdamW's moments laid out as their parameters, or also split over the data axes (ZeRO-1).
    optimizer_offload: the optimiser state waits in pinned host memory between updates (generation then has its
    device memory; `rpegjax.runtime.offload`), moved to the devices for each update and back after it.
    sequence_parallel: training and inference stages split the residual stream between the tensor-parallel blocks on
    its sequence over `tensor` too (`rpegjax.sharding.rules.ShardingRules.fsdp_tp`). Context parallelism is a
    `context` axis of a stage's parallel sizes, not an option.
    partial_rollouts / inflight_batches / max_token_lag: generation runs continuously over `inflight_batches`
    batches of groups, a step trains the first to complete and carries the sequences still decoding into the next
    (`partial_carry`: `recompute`, re-prefilled under the newer weights, or `pages`, their KV pages kept in the paged
    pool); a trained token lags at most `max_token_lag` versions (None: the asynchrony bound + 2). The job's
    `rollout.partial`, `rollout.inflight_batches`, `rollout.max_token_lag`, `rollout.partial_carry`
    (`rpegjax.runtime.partial_rollouts`).
    moe_capacity_factor: a mixture-of-experts model's experts dropless (None) or in the capacity mode with this
    factor c (each expert takes at most ceil(c t k / x) of a row's t x k assignments, the rest dropped:
    `rpegjax.models.expert_parallel`); the model config's field of the same name, which the runtime, the dry run
    and the perf model take from here (`model_fields`). A dense model takes None only.
    Generation micro-batches are the stages' own `microbatches`.
    """

    attention: AttentionKind = AttentionKind.DENSE
    attention_block_size: int = 512
    remat: RematPolicy = RematPolicy.NONE
    scan_layers: bool = False
    kv_cache: CacheLayout = CacheLayout.CONTIGUOUS
    page_size: int = 16
    kv_pool_tokens: int | None = None
    decode_attention: DecodeAttention = DecodeAttention.GATHER
    param_dtype: DType = DType.FLOAT32
    dtype: DType = DType.FLOAT32
    update_microbatches: int = 1
    inference_rows: int | None = None
    decode_slots: int | None = None
    packing: bool = False
    max_tokens_per_micro_batch: int | None = None
    optimizer_sharding: OptimizerSharding = OptimizerSharding.PARAMS
    optimizer_offload: bool = False
    sequence_parallel: bool = False
    partial_rollouts: bool = False
    inflight_batches: int = 2
    max_token_lag: int | None = None
    partial_carry: CarryMode = CarryMode.RECOMPUTE
    moe_capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name, kind in (("attention", AttentionKind), ("remat", RematPolicy), ("kv_cache", CacheLayout),
                           ("param_dtype", DType), ("dtype", DType), ("optimizer_sharding", OptimizerSharding),
                           ("partial_carry", CarryMode), ("decode_attention", DecodeAttention)):
            try:
                object.__setattr__(self, name, parse_choice(kind, getattr(self, name), f"Execution.{name}"))
            except ValueError as error:
                raise GraphError(str(error)) from None
        for name in ("attention_block_size", "page_size", "update_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphError(f"Execution.{name} must be a positive integer, got {value!r}")
        for name in ("scan_layers", "optimizer_offload", "sequence_parallel", "partial_rollouts"):
            if not isinstance(getattr(self, name), bool):
                raise GraphError(f"Execution.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("inference_rows", "decode_slots"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise GraphError(f"Execution.{name} must be a positive integer or null, got {value!r}")
        capacity = self.moe_capacity_factor
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int | float) or capacity <= 0):
            raise GraphError(f"Execution.moe_capacity_factor must be null (dropless) or a positive number, got {capacity!r}")
        self._check_packing()
        self._check_partial()
        if self.decode_attention != DecodeAttention.GATHER and self.kv_cache != CacheLayout.PAGED:
            raise GraphError(f"Execution.decode_attention={self.decode_attention} reads the paged pool; the "
                             f"{self.kv_cache} cache has none (set kv_cache to paged, or decode_attention to gather)")
        if self.kv_pool_tokens is not None:
            value = self.kv_pool_tokens
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphError(f"Execution.kv_pool_tokens must be a positive integer or null, got {value!r}")
            if self.kv_cache != CacheLayout.PAGED:
                raise GraphError(f"Execution.kv_pool_tokens={value} sizes a paged KV cache's pool; the "
                                 f"{self.kv_cache} cache has none (set kv_cache to paged, or drop it)")

    def _check_packing(self) -> None:
        budget = self.max_tokens_per_micro_batch
        if not isinstance(self.packing, bool):
            raise GraphError(f"Execution.packing must be true or false, got {self.packing!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise GraphError(f"Execution.max_tokens_per_micro_batch must be a positive integer or null, got {budget!r}")
        if self.packing != (budget is not None):
            raise GraphError(f"Execution.packing={self.packing} and max_tokens_per_micro_batch={budget}: packing needs "
                             "the budget, and the budget means packing")
        if self.packing and (self.update_microbatches != 1 or self.inference_rows is not None):
            raise GraphError(f"Execution.packing chooses micro-batches by max_tokens_per_micro_batch; "
                             f"update_microbatches={self.update_microbatches} and inference_rows={self.inference_rows} "
                             "must stay 1 and null")

    def _check_partial(self) -> None:
        lag, batches = self.max_token_lag, self.inflight_batches
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 2:
            raise GraphError(f"Execution.inflight_batches must be an integer >= 2, got {batches!r}")
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 1):
            raise GraphError(f"Execution.max_token_lag must be a positive integer or null, got {lag!r}")
        if not self.partial_rollouts and (batches != 2 or lag is not None or self.partial_carry != CarryMode.RECOMPUTE):
            raise GraphError(f"Execution.inflight_batches={batches}, max_token_lag={lag} and partial_carry="
                             f"{self.partial_carry} set partial rollouts; set partial_rollouts too (or leave them at "
                             "2, null and recompute)")
        if self.partial_carry == CarryMode.PAGES and self.kv_cache != CacheLayout.PAGED:
            raise GraphError(f"Execution.partial_carry=pages keeps carried sequences' pages in the paged KV cache; "
                             f"the {self.kv_cache} cache has none (set kv_cache to paged, or partial_carry to recompute)")

    def model_fields(self) -> dict[str, Any]:
        """The fields a model config takes (`ModelConfig` execution fields, and the experts' capacity mode)."""
        return {**{name: getattr(self, name) for name in MODEL_EXECUTION_FIELDS},
                "moe_capacity_factor": self.moe_capacity_factor}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: choices as their plain string values."""
        return {name: value.value if isinstance(value, enum.Enum) else value
                for name, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "execution") -> Execution:
        if not isinstance(data, Mapping):
            raise GraphError(f"{where} must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise GraphError(f"{where}: unknown execution options {unknown}; known: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        try:
            return cls(**data)
        except GraphError as error:
            raise GraphError(f"{where}: {error}") from None

    def describe(self) -> str:
        micro = f", {self.update_microbatches} update micro-batches" if self.update_microbatches > 1 else ""
        rows = f", inference rows {self.inference_rows}" if self.inference_rows is not None else ""
        pool = f" ({self.kv_pool_tokens} tokens per replica)" if self.kv_pool_tokens is not None else ""
        pool += ", Pallas paged decode" if self.decode_attention == DecodeAttention.PALLAS else ""
        slots = f", {self.decode_slots} slots" if self.decode_slots is not None else ""
        packed = f", packed rows of {self.max_tokens_per_micro_batch} tokens" if self.packing else ""
        optimizer = "" if self.optimizer_sharding is OptimizerSharding.PARAMS else ", optimiser state over data"
        optimizer += ", optimiser state offloaded" if self.optimizer_offload else ""
        sequence = ", sequence parallel" if self.sequence_parallel else ""
        lag = "k+2" if self.max_token_lag is None else self.max_token_lag
        sequence += (f", partial rollouts ({self.inflight_batches} batches in flight, token lag <= {lag}, carry "
                     f"{self.partial_carry})"
                     if self.partial_rollouts else "")
        experts = "" if self.moe_capacity_factor is None else f", expert capacity {self.moe_capacity_factor:g}"
        return (f"{self.attention} attention, remat {self.remat}, {self.param_dtype}/{self.dtype}, "
                f"{self.kv_cache} KV cache{pool}{slots}{micro}{rows}{packed}{optimizer}{sequence}{experts}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Graph:
    """A whole RL step: stages (in declaration order), edges, placements and the asynchrony bound.

    Construction checks only per-field types; call `validate()` for the whole-graph rules. Builders and
    transforms return validated graphs.
    """

    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    placements: Mapping[str, Placement]
    async_bound: int = 0
    num_devices: int = 1
    external: tuple[str, ...] = ()
    algorithm: Algorithm | None = None
    name: str = ""
    execution: Execution = dataclasses.field(default_factory=Execution)

    def __post_init__(self) -> None:
        if not isinstance(self.execution, Execution):
            raise GraphError(f"Graph.execution must be an Execution, got {self.execution!r}")
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "external", tuple(str(p) for p in self.external))
        if self.algorithm is not None:
            object.__setattr__(self, "algorithm", Algorithm(self.algorithm))
        placements = dict(self.placements)
        for key, placement in placements.items():
            if not isinstance(placement, Placement) or placement.name != key:
                raise GraphError(f"Graph.placements[{key!r}] must be a Placement named {key!r}, got {placement!r}")
        object.__setattr__(self, "placements", MappingProxyType(placements))
        if any(not isinstance(s, Stage) for s in self.stages) or any(not isinstance(e, Edge) for e in self.edges):
            raise GraphError("Graph.stages must hold Stage objects and Graph.edges Edge objects")
        if isinstance(self.async_bound, bool) or not isinstance(self.async_bound, int) or self.async_bound < 0:
            raise GraphError(f"Graph.async_bound must be an integer >= 0, got {self.async_bound!r}")
        if isinstance(self.num_devices, bool) or not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise GraphError(f"Graph.num_devices must be a positive integer, got {self.num_devices!r}")

    def __hash__(self) -> int:
        return hash((self.stages, self.edges, tuple(self.placements.items()), self.async_bound, self.num_devices,
                     self.external, self.algorithm, self.name, self.execution))

    # ----------------------------------------------------------------------------------------- queries
    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise GraphError(f"no stage named {name!r}; stages are {list(self.stage_names)}", stage=name)

    def has_stage(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    def stages_of_kind(self, kind: StageKind | str) -> tuple[Stage, ...]:
        """Stages whose own or merged kinds include `kind`."""
        kind = StageKind(kind)
        return tuple(s for s in self.stages if kind in s.kinds)

    def in_edges(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.dst == name)

    def out_edges(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == name)

    def producers(self, name: str, *, same_step: bool = False) -> tuple[str, ...]:
        """Names of stages `name` reads from (only over offset-0 edges when `same_step`), in edge order."""
        edges = (e for e in self.in_edges(name) if not same_step or e.version_offset == 0)
        return tuple(dict.fromkeys(e.src for e in edges))

    def consumers(self, name: str, *, same_step: bool = False) -> tuple[str, ...]:
        """Names of stages reading from `name` (only over offset-0 edges when `same_step`), in edge order."""
        edges = (e for e in self.out_edges(name) if not same_step or e.version_offset == 0)
        return tuple(dict.fromkeys(e.dst for e in edges))

    def placement_of(self, name: str) -> Placement | None:
        """The stage's placement, None for host stages."""
        stage = self.stage(name)
        return None if stage.host else self.placements[stage.placement]

    def parallel_of(self, name: str) -> Mapping[str, int] | None:
        """The stage's effective parallel sizes (its own, else its placement's); None for host stages."""
        stage = self.stage(name)
        if stage.host:
            return None
        return stage.parallel if stage.parallel is not None else self.placements[stage.placement].parallel

    def fused_groups(self) -> dict[str, tuple[str, ...]]:
        """Group name -> member stage names in topological order."""
        groups: dict[str, list[str]] = {}
        for name in self.topological_order():
            group = self.stage(name).fused_group
            if group is not None:
                groups.setdefault(group, []).append(name)
        return {group: tuple(members) for group, members in groups.items()}

    def depends_on(self, later: str, earlier: str) -> bool:
        """True when `later` reaches back to `earlier` through same-step (offset-0) edges."""
        seen, frontier = set(), [later]
        while frontier:
            for src in self.producers(frontier.pop(), same_step=True):
                if src == earlier:
                    return True
                if src not in seen:
                    seen.add(src)
                    frontier.append(src)
        return False

    def topological_order(self) -> tuple[str, ...]:
        """Stage names ordered by same-step dependencies; ties keep declaration order. Raises on a cycle."""
        index = {name: i for i, name in enumerate(self.stage_names)}
        indegree = {name: 0 for name in index}
        children: dict[str, list[str]] = {name: [] for name in index}
        for edge in self.edges:
            if edge.version_offset == 0 and edge.src in index and edge.dst in index:
                indegree[edge.dst] += 1
                children[edge.src].append(edge.dst)
        ready = sorted((n for n, d in indegree.items() if d == 0), key=index.__getitem__)
        order: list[str] = []
        while ready:
            name = ready.pop(0)
            order.append(name)
            for child in children[name]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
            ready.sort(key=index.__getitem__)
        if len(order) != len(index):
            stuck = [n for n in self.stage_names if n not in order]
            raise GraphError(f"same-step edges (offset 0) form a cycle through stages {stuck}", stage=stuck[0])
        return tuple(order)

    def execution_units(self) -> tuple[tuple[str, ...], ...]:
        """What the runtime dispatches, in order: each fused group once (at its first member), else single stages."""
        groups = self.fused_groups()
        units: list[tuple[str, ...]] = []
        for name in self.topological_order():
            group = self.stage(name).fused_group
            if group is None:
                units.append((name,))
            elif groups[group][0] == name:
                units.append(groups[group])
        return tuple(units)

    @property
    def shares_actor_critic(self) -> bool:
        """True when the critic is the actor's trunk plus a value head (after `share_actor_critic`)."""
        return any(StageKind.CRITIC_VALUE in s.merged_kinds or StageKind.CRITIC_UPDATE in s.merged_kinds for s in self.stages)

    # -------------------------------------------------------------------------------------- validation
    def validate(self) -> Graph:
        """Checks every whole-graph rule and returns self; raises GraphError naming the stage otherwise."""
        from rpegjax.graph import (
            validation,  # one module per concept; imported late to avoid a cycle
        )

        validation.validate_graph(self)
        return self

    # ------------------------------------------------------------------------------------- rendering
    def to_text(self) -> str:
        from rpegjax.graph import render

        return render.graph_to_text(self)

    def to_dot(self) -> str:
        from rpegjax.graph import render

        return render.graph_to_dot(self)

    # --------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; `Graph.from_dict(g.to_dict()) == g`."""
        from rpegjax.graph import serialize

        return serialize.graph_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Graph:
        from rpegjax.graph import serialize

        return serialize.graph_from_dict(data)

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        """Parses `to_json` output back into an equal graph; GraphError when the text is not a graph."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise GraphError(f"graph JSON does not parse: {error}") from None
        return cls.from_dict(data)


def replace_stages(graph: Graph, stages: Iterable[Stage]) -> Graph:
    """The graph with the given stages swapped in by name (other stages and edges unchanged)."""
    updates = {s.name: s for s in stages}
    return dataclasses.replace(graph, stages=tuple(updates.get(s.name, s) for s in graph.stages))
