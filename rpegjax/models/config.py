"""Model configuration: one frozen dataclass for the Qwen2/Qwen2.5, Qwen3, Qwen3-MoE and Llama 3 decoder families."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp

from rpegjax.models.routing import RouterScoring, RoutingRule
from rpegjax.models.kinds import LayerKind, MixerKind, MlpKind
from rpegjax.models.rope import Llama3RopeScaling, LinearRopeScaling, Rope, RopeScaling
from rpegjax.options import AttentionKind, DType, RematPolicy, parse_choice

__all__ = ["JAX_DTYPES", "QK_NORM", "Activation", "Architecture", "LinearRopeScaling", "Llama3RopeScaling",
           "ModelConfig", "routing_rule"]


class Architecture(enum.StrEnum):
    QWEN2 = "qwen2"  # q/k/v bias, no q/k norm
    QWEN3 = "qwen3"  # q/k RMSNorm over head dim, no bias
    LLAMA = "llama"  # no bias, optional llama3 RoPE scaling
    QWEN3_MOE = "qwen3_moe"  # Qwen3 attention; sparse layers route each token to top-k experts (models/moe.py)


class Activation(enum.StrEnum):
    """The gated MLP's activation (Hugging Face's `hidden_act` / `hidden_activation` names)."""

    SILU = "silu"  # SwiGLU
    GELU_TANH = "gelu_pytorch_tanh"  # GeGLU with gelu's tanh approximation


# Real-size presets train on 4k-32k-token rows: memory linear in length (blockwise attention, one
# layer input kept per layer). The field defaults (dense, no remat, unrolled) are fastest for the small CPU models.
_LONG_SEQUENCE_EXECUTION = dict(attention=AttentionKind.BLOCKWISE, remat=RematPolicy.FULL, scan_layers=True)

JAX_DTYPES = {DType.FLOAT32: jnp.float32, DType.BFLOAT16: jnp.bfloat16, DType.FLOAT16: jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    `param_dtype` is how weights are stored, `dtype` how matmuls are computed; norms, softmax and
    log-probs always run in float32. `attention` picks the full-sequence attention kernel
    (`attention_block_size` is the blockwise kernel's query/key block) and `remat` what each layer keeps
    for the backward pass; `scan_layers` runs the full-sequence layer stack as one `lax.scan` (compile time
    independent of depth; needed for remat to bound memory on XLA's CPU backend). None changes the maths.
    """

    architecture: Architecture = Architecture.QWEN2
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    value_head: bool = False
    param_dtype: DType = DType.FLOAT32
    dtype: DType = DType.FLOAT32
    attention: AttentionKind = AttentionKind.DENSE
    attention_block_size: int = 512
    remat: RematPolicy = RematPolicy.NONE
    scan_layers: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # the router variants of `rpegjax.models.routing` (defaults: Qwen3-MoE's); the correction bias only chooses
    router_scoring: RouterScoring = RouterScoring.SOFTMAX
    router_correction_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # a sparse layer's shared expert (0: none): a SwiGLU MLP of this width that every token goes through beside its
    # routed experts, scaled by sigmoid(x . shared_expert_gate) when `shared_expert_gate` (Qwen2-MoE, Qwen3-Next,
    # Qwen3.5-MoE); DeepSeek-style shared experts have no gate (their width: n_shared_experts x moe_intermediate_size)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Gated DeltaNet (linear attention) layers' shapes (all 0 in a model without them; rpegjax.models.gated_deltanet):
    # q and k have `linear_num_key_heads` heads of `linear_key_head_dim`, v, the output gate and the recurrent state
    # `linear_num_value_heads` heads of `linear_value_head_dim` (a multiple of the key heads: each key head serves a
    # group of consecutive value heads); the short causal convolution has `linear_conv_kernel_dim` taps.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # None: dropless experts; c > 0: each expert takes at most ceil(c t k / x) of a row's assignments, the rest are
    # dropped (rpegjax.models.expert_parallel). Not a checkpoint field: a training choice (Hugging Face's Qwen3-MoE
    # is dropless)
    moe_capacity_factor: float | None = None
    # each layer's mixer kind (Hugging Face's `layer_types`); empty: every layer full attention
    layer_types: tuple[MixerKind, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "architecture", Architecture(self.architecture))
        for name, kind in (("attention", AttentionKind), ("remat", RematPolicy), ("param_dtype", DType),
                           ("dtype", DType), ("router_scoring", RouterScoring)):
            object.__setattr__(self, name, parse_choice(kind, getattr(self, name), f"ModelConfig.{name}"))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "attention_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("ModelConfig.rms_norm_eps and rope_theta must be positive")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        _check_experts(self)
        _check_linear_attention(self)
        _check_layer_types(self)

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` is a mixture-of-experts layer (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse_layer(i))

    @property
    def activation(self) -> Activation:
        return Activation.SILU

    def layer_kind(self, index: int) -> LayerKind:
        """Layer `index`'s mixer kind (`layer_types`) and MLP kind (experts in a sparse layer)."""
        mixer = self.layer_types[index] if self.layer_types else MixerKind.FULL_ATTENTION
        return LayerKind(mixer=mixer, mlp=MlpKind.EXPERTS if self.is_sparse_layer(index) else MlpKind.DENSE)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    def rope(self) -> Rope:
        """The RoPE setting of the full-attention layers: `rope_theta` with `rope_scaling` over the whole head."""
        return Rope(theta=self.rope_theta, dim=self.head_dim, scaling=self.rope_scaling)

    @property
    def jnp_param_dtype(self) -> Any:
        return JAX_DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return JAX_DTYPES[self.dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, *, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameter count (the value head excluded); with `active`, a sparse layer counts only the
        `num_experts_per_token` experts one token uses (plus its router)."""
        d, f, h, k, e, v = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size)
        attention = d * h * e + 2 * d * k * e + h * e * d
        if self.attention_bias:
            attention += h * e + 2 * k * e
        if self.qk_norm:
            attention += 2 * e
        experts = self.num_experts_per_token if active else self.num_experts
        shared = 3 * d * self.shared_expert_intermediate_size + (d if self.shared_expert_gate else 0)
        sparse = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size + shared
        mlps = sum(sparse if self.is_sparse_layer(i) else 3 * d * f for i in range(self.num_layers))
        embeddings = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + 2 * d) + mlps + d + (embeddings if include_embeddings else 0)

    # ---- presets -------------------------------------------------------------------------------
    @classmethod
    def w_small(cls) -> ModelConfig:
        """The W-small benchmark model (shared/WORKLOADS.md)."""
        return cls(architecture=Architecture.QWEN2, vocab_size=512, hidden_size=256, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=64, intermediate_size=1024, attention_bias=True)

    @classmethod
    def tiny(cls, architecture: Architecture = Architecture.QWEN2, **changes: Any) -> ModelConfig:
        """2 layers, d=64: the size used by tests."""
        base = dict(architecture=architecture, vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=128,
                    attention_bias=architecture == Architecture.QWEN2, qk_norm=architecture in QK_NORM)
        if architecture == Architecture.QWEN3_MOE:
            base.update(num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, norm_topk_prob=True)
        base.update(changes)
        return cls(**base)

    @classmethod
    def qwen2p5(cls, size: str) -> ModelConfig:
        """Qwen2.5 shapes: size one of 0.5b, 1.5b, 7b, 32b, 72b."""
        shapes = {
            "0.5b": (896, 24, 14, 2, 4864, True),
            "1.5b": (1536, 28, 12, 2, 8960, True),
            "7b": (3584, 28, 28, 4, 18944, False),
            "32b": (5120, 64, 40, 8, 27648, False),
            "72b": (8192, 80, 64, 8, 29568, False),
        }
        if size not in shapes:
            raise ValueError(f"unknown Qwen2.5 size {size!r}; known: {sorted(shapes)}")
        d, l, h, k, f, tied = shapes[size]
        return cls(architecture=Architecture.QWEN2, vocab_size=151936 if size in ("0.5b", "1.5b") else 152064,
                   hidden_size=d, num_layers=l, num_heads=h, num_kv_heads=k, head_dim=d // h, intermediate_size=f,
                   rope_theta=1e6, tie_word_embeddings=tied, attention_bias=True, param_dtype="bfloat16", dtype="bfloat16",
                   **_LONG_SEQUENCE_EXECUTION)

    @classmethod
    def llama3(cls, size: str) -> ModelConfig:
        """Llama 3.1 shapes: size 8b or 70b (`_LLAMA31`)."""
        return cls(**_preset_fields("Llama 3", _LLAMA31, size), **_LONG_SEQUENCE_EXECUTION)

    @classmethod
    def qwen3(cls, size: str) -> ModelConfig:
        """Qwen3 dense shapes: size 32b (`_QWEN3`)."""
        return cls(**_preset_fields("Qwen3", _QWEN3, size), **_LONG_SEQUENCE_EXECUTION)

    @classmethod
    def qwen3_moe(cls, size: str) -> ModelConfig:
        """Qwen3-MoE shapes: size 30b-a3b or 235b-a22b, from the `config.json` of Hugging Face's Qwen/Qwen3-30B-A3B
        and Qwen/Qwen3-235B-A22B (also slime's scripts/models/qwen3-30B-A3B.sh and qwen3-235B-A22B.sh): 128 experts,
        8 per token, every layer sparse, norm_topk_prob, head_dim 128, theta 1e6, vocabulary 151936, untied."""
        shapes = {"30b-a3b": (2048, 48, 32, 4, 6144, 768), "235b-a22b": (4096, 94, 64, 4, 12288, 1536)}
        if size not in shapes:
            raise ValueError(f"unknown Qwen3-MoE size {size!r}; known: {sorted(shapes)}")
        d, l, h, k, f, moe_f = shapes[size]
        return cls(architecture=Architecture.QWEN3_MOE, vocab_size=151936, hidden_size=d, num_layers=l, num_heads=h,
                   num_kv_heads=k, head_dim=128, intermediate_size=f, rope_theta=1e6, max_position_embeddings=40960,
                   qk_norm=True, num_experts=128, num_experts_per_token=8, moe_intermediate_size=moe_f,
                   norm_topk_prob=True, param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151643,
                   eos_token_id=151645, **_LONG_SEQUENCE_EXECUTION)

    # ---- Hugging Face config.json (`rpegjax.models.hf_config`) ------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Reads a Hugging Face `config.json` dict; raises ValueError naming `source` when unsupported."""
        from rpegjax.models.hf_config import read_hf_config  # reads this module's classes

        return read_hf_config(hf, source=source)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` that `transformers` reads back as the same model."""
        from rpegjax.models.hf_config import write_hf_config  # reads this module's classes

        return write_hf_config(self)


def routing_rule(cfg: ModelConfig) -> RoutingRule:
    """How a sparse layer of `cfg` picks and weights its experts (`rpegjax.models.routing`)."""
    return RoutingRule(top_k=cfg.num_experts_per_token, norm_topk_prob=cfg.norm_topk_prob, scoring=cfg.router_scoring,
                       groups=cfg.router_groups, topk_groups=cfg.router_topk_groups,
                       scaling_factor=cfg.routed_scaling_factor)


def _check_layer_types(cfg: ModelConfig) -> None:
    """`layer_types` parsed into `MixerKind`s, one per layer; raises naming the field and the bad entry."""
    if not cfg.layer_types:
        object.__setattr__(cfg, "layer_types", ())
        return
    types = (cfg.layer_types,) if isinstance(cfg.layer_types, str) else tuple(cfg.layer_types)
    for index, entry in enumerate(types):
        if entry not in set(MixerKind):
            raise ValueError(f"ModelConfig.layer_types[{index}]={entry!r} is not a layer kind we implement; "
                             f"known: {[kind.value for kind in MixerKind]}")
    if len(types) != cfg.num_layers:
        raise ValueError(f"ModelConfig.layer_types lists {len(types)} layers, num_layers is {cfg.num_layers}")
    kinds = tuple(MixerKind(entry) for entry in types)
    # a stack of full attention only is the default stack: one spelling of it, so configs compare equal
    object.__setattr__(cfg, "layer_types", () if set(kinds) == {MixerKind.FULL_ATTENTION} else kinds)


def _check_experts(cfg: ModelConfig) -> None:
    """Raises ValueError naming the field when the mixture-of-experts fields do not fit the architecture."""
    if cfg.architecture != Architecture.QWEN3_MOE:
        for name in ("num_experts", "moe_capacity_factor", "shared_expert_intermediate_size", "shared_expert_gate"):
            if getattr(cfg, name):
                raise ValueError(f"ModelConfig.{name}={getattr(cfg, name)} needs architecture qwen3_moe, "
                                 f"got {cfg.architecture.value}")
        defaults = ModelConfig.__dataclass_fields__
        for name in _ROUTER_FIELDS:
            value = getattr(cfg, name)
            if value != defaults[name].default:
                shown = value.value if isinstance(value, enum.Enum) else value
                raise ValueError(f"ModelConfig.{name}={shown!r} is a router option; architecture "
                                 f"{cfg.architecture.value} has no experts")
        return
    for name in ("num_experts", "num_experts_per_token", "moe_intermediate_size", "decoder_sparse_step"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ModelConfig.{name} must be a positive integer for qwen3_moe, got {value!r}")
    shared = cfg.shared_expert_intermediate_size
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ValueError(f"ModelConfig.shared_expert_intermediate_size must be 0 (no shared expert) or a positive "
                         f"integer, got {shared!r}")
    if cfg.shared_expert_gate and not shared:
        raise ValueError("ModelConfig.shared_expert_gate=True needs a shared expert "
                         "(shared_expert_intermediate_size > 0)")
    capacity = cfg.moe_capacity_factor
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int | float) or capacity <= 0):
        raise ValueError(f"ModelConfig.moe_capacity_factor must be null (dropless) or a positive number, got {capacity!r}")
    if cfg.num_experts_per_token > cfg.num_experts:
        raise ValueError(f"ModelConfig.num_experts_per_token ({cfg.num_experts_per_token}) exceeds num_experts "
                         f"({cfg.num_experts})")
    _check_router(cfg)
    bad = [i for i in cfg.mlp_only_layers if not isinstance(i, int) or not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"ModelConfig.mlp_only_layers must be layer indices in [0, {cfg.num_layers}), got {bad}")
    if cfg.scan_layers and len({cfg.is_sparse_layer(i) for i in range(cfg.num_layers)}) > 1:
        raise ValueError("ModelConfig.scan_layers needs layers of one kind, but this model mixes dense and sparse "
                         f"layers (decoder_sparse_step={cfg.decoder_sparse_step}, "
                         f"mlp_only_layers={list(cfg.mlp_only_layers)}); set scan_layers=False")


_LINEAR_ATTENTION_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                            "linear_value_head_dim", "linear_conv_kernel_dim")


def _check_linear_attention(cfg: ModelConfig) -> None:
    """Raises ValueError naming the field when the Gated DeltaNet shapes are partly set or do not group."""
    values = {name: getattr(cfg, name) for name in _LINEAR_ATTENTION_FIELDS}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"ModelConfig.{name} must be a non-negative integer, got {value!r}")
    if any(values.values()) and not all(values.values()):
        unset = [name for name, value in values.items() if not value]
        raise ValueError(f"ModelConfig: Gated DeltaNet shapes need all of {list(values)} positive, got {unset[0]}=0")
    if cfg.linear_num_key_heads and cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError(f"ModelConfig.linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
                         f"linear_num_key_heads ({cfg.linear_num_key_heads})")


_ROUTER_FIELDS = ("router_scoring", "router_correction_bias", "router_groups", "router_topk_groups",
                  "routed_scaling_factor")


def _check_router(cfg: ModelConfig) -> None:
    """Raises ValueError naming the field when the router variant cannot route `num_experts` experts."""
    for name in ("router_groups", "router_topk_groups"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
    groups, experts = cfg.router_groups, cfg.num_experts
    if experts % groups:
        raise ValueError(f"ModelConfig.router_groups ({groups}) must divide num_experts ({experts})")
    if groups > 1 and experts // groups < 2:
        raise ValueError(f"ModelConfig.router_groups ({groups}): a group is scored by its two best experts, but "
                         f"{experts} experts make groups of {experts // groups}")
    if cfg.router_topk_groups > groups:
        raise ValueError(f"ModelConfig.router_topk_groups ({cfg.router_topk_groups}) exceeds router_groups ({groups})")
    eligible = cfg.router_topk_groups * experts // groups
    if cfg.num_experts_per_token > eligible:
        raise ValueError(f"ModelConfig.num_experts_per_token ({cfg.num_experts_per_token}) exceeds the {eligible} "
                         f"experts of router_topk_groups={cfg.router_topk_groups} groups")
    factor = cfg.routed_scaling_factor
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise ValueError(f"ModelConfig.routed_scaling_factor must be a positive number, got {factor!r}")


QK_NORM = (Architecture.QWEN3, Architecture.QWEN3_MOE)

# From the `config.json` of Hugging Face's meta-llama/Llama-3.1-8B(-Instruct) and Llama-3.1-70B: vocabulary 128256,
# head_dim 128, RMSNorm eps 1e-5, RoPE theta 5e5 with the llama3 scaling (factor 8, low 1, high 4, original 8192
# positions), 131072 positions, untied, bos 128000, eos 128001.
_LLAMA31_COMMON = dict(architecture=Architecture.LLAMA, vocab_size=128256, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
                       rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_max_position_embeddings=8192),
                       param_dtype="bfloat16", dtype="bfloat16")
_LLAMA31 = {size: dict(_LLAMA31_COMMON, hidden_size=d, num_layers=l, num_heads=h, num_kv_heads=k, intermediate_size=f)
            for size, (d, l, h, k, f) in {"8b": (4096, 32, 32, 8, 14336), "70b": (8192, 80, 64, 8, 28672)}.items()}
# From the `config.json` of Hugging Face's Qwen/Qwen3-32B: q/k RMSNorm, no bias, RMSNorm eps 1e-6, RoPE theta 1e6,
# 40960 positions, vocabulary 151936, untied, bos 151643, eos 151645.
_QWEN3 = {"32b": dict(architecture=Architecture.QWEN3, vocab_size=151936, hidden_size=5120, num_layers=64, num_heads=64,
                      num_kv_heads=8, head_dim=128, intermediate_size=25600, rope_theta=1e6, max_position_embeddings=40960,
                      qk_norm=True, bos_token_id=151643, eos_token_id=151645, param_dtype="bfloat16", dtype="bfloat16")}


def _preset_fields(family: str, table: dict[str, dict[str, Any]], size: str) -> dict[str, Any]:
    if size not in table:
        raise ValueError(f"unknown {family} size {size!r}; known: {sorted(table)}")
    return table[size]
