"""A Hugging Face `config.json` <-> `ModelConfig`: what we read of each family's fields, what we refuse (a feature we
do not implement is an error naming the field and the value, never loaded approximately), and what we write for
`transformers` to read back as the same model."""

from __future__ import annotations

import dataclasses
from typing import Any

from rpegjax.models.config import (
    JAX_DTYPES,
    QK_NORM,
    Architecture,
    Llama3RopeScaling,
    ModelConfig,
)

__all__ = ["HF_ARCHITECTURE_CLASS", "hf_value", "read_hf_config", "write_hf_config"]

HF_ARCHITECTURE_CLASS = {
    Architecture.QWEN2: "Qwen2ForCausalLM",
    Architecture.QWEN3: "Qwen3ForCausalLM",
    Architecture.LLAMA: "LlamaForCausalLM",
    Architecture.QWEN3_MOE: "Qwen3MoeForCausalLM",
}


def read_hf_config(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Reads a Hugging Face `config.json` dict; raises ValueError naming `source` when unsupported."""
    model_type = hf.get("model_type")
    try:
        architecture = Architecture(model_type)
    except ValueError:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {[a.value for a in Architecture]}"
        ) from None

    def need(key: str) -> int:
        if key not in hf:
            raise ValueError(f"{source}: missing required field {key!r}")
        return hf_value(hf, key, int, source)

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    for key, kind in _HF_TYPES.items():  # each field present has its JSON type (not "64" for 64, "no" for false)
        if hf.get(key) is not None:
            hf_value(hf, key, kind, source)
    _check_hf_features(hf, architecture, source)
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older versions `rope_theta` and
    # `rope_scaling`. When both are present transformers gives `rope_scaling` priority, and so do we.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_scaling/rope_parameters must be an object, got {rope!r}")
    if any(isinstance(value, dict) for value in rope.values()):
        raise ValueError(f"{source}: per-layer-type rope_parameters are not supported, got keys {sorted(rope)}")
    max_positions = int(hf.get("max_position_embeddings", 32768))
    scaling = None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                # transformers falls back to max_position_embeddings when this is absent
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_positions)),
            )
        except KeyError as missing:
            raise ValueError(f"{source}: llama3 rope scaling lacks field {missing.args[0]!r}") from None
    elif kind != "default":
        raise ValueError(f"{source}: unsupported rope type {kind!r} (supported: default, llama3)")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta"))
    torch_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        architecture=architecture,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=need("intermediate_size"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # transformers' Qwen2 always has q/k/v biases and ignores `attention_bias`; Llama/Qwen3 with
        # attention_bias were rejected by _check_hf_features (they would also need an o_proj bias).
        attention_bias=architecture == Architecture.QWEN2,
        qk_norm=architecture in QK_NORM,
        param_dtype=torch_dtype if torch_dtype in JAX_DTYPES else "float32",
        dtype=torch_dtype if torch_dtype in JAX_DTYPES else "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        **(_hf_experts(hf, source) if architecture == Architecture.QWEN3_MOE else {}),
    )


def write_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` that `transformers` reads back as the same model."""
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURE_CLASS[cfg.architecture]],
        "model_type": cfg.architecture.value,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers 5 reads `rope_parameters`; `rope_theta` (and `rope_scaling` below) are for older readers
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.param_dtype,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if cfg.architecture == Architecture.LLAMA:
        hf["attention_bias"] = cfg.attention_bias
        hf["mlp_bias"] = False
    if cfg.architecture in QK_NORM:
        hf["attention_bias"] = False
    if cfg.architecture == Architecture.QWEN3_MOE:
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
                  moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                  decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                  output_router_logits=False)
    if cfg.architecture != Architecture.LLAMA:
        hf["use_sliding_window"] = False
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
        hf["rope_scaling"] = scaling
        hf["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    return hf


def _hf_experts(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE `config.json` (transformers 5 writes the expert count as
    `num_local_experts`, the published checkpoints as `num_experts`)."""
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    for needed in (key, "num_experts_per_tok", "moe_intermediate_size"):
        if needed not in hf:
            raise ValueError(f"{source}: missing required field {needed!r} (qwen3_moe)")
        hf_value(hf, needed, int, source)
    layers = hf.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"{source}: field 'mlp_only_layers' must be a list of integers, got {layers!r:.60}")
    return dict(num_experts=hf[key], num_experts_per_token=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=hf_value(hf, "norm_topk_prob", bool, source) if "norm_topk_prob" in hf else False,
                decoder_sparse_step=hf_value(hf, "decoder_sparse_step", int, source) if "decoder_sparse_step" in hf else 1,
                mlp_only_layers=tuple(layers))


_HF_TYPES: dict[str, type] = {
    "vocab_size": int, "num_hidden_layers": int, "num_key_value_heads": int, "head_dim": int, "intermediate_size": int,
    "max_position_embeddings": int, "rms_norm_eps": float, "rope_theta": float, "tie_word_embeddings": bool,
    "attention_bias": bool, "mlp_bias": bool, "use_sliding_window": bool, "bos_token_id": int,
}
"""The JSON type of each config.json field read (when present and not null)."""


def hf_value(hf: dict[str, Any], key: str, kind: type, source: str) -> Any:
    """`hf[key]` checked to be a JSON value of `kind` (int: an integer, float: any number, bool: true/false);
    else ValueError naming `source`, the field and the value (a string "64" is not the number 64)."""
    value = hf[key]
    ok = (isinstance(value, bool) if kind is bool
          else not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float)))
    if not ok:
        expected = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise ValueError(f"{source}: field {key!r} must be {expected}, got {type(value).__name__} {value!r:.60}")
    return value


def _check_hf_features(hf: dict[str, Any], architecture: Architecture, source: str) -> None:
    """Rejects config.json features that our decoder does not implement (rather than silently ignoring them)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {hf['hidden_act']!r} (supported: silu)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    if architecture != Architecture.QWEN2 and hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for {architecture.value} (it biases o_proj)")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported")
