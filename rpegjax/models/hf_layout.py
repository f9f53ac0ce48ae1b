"""Hugging Face tensor names and layouts <-> the parameters of our `Decoder` (pure, no file I/O).

Each layer kind lists its own tensors and maps (`hf_tensors` of its module: `full_attention.Attention`, `mlp.MLP`,
`moe.SparseMoE` with its shared expert, and the block's norms in `layer_stack.Block`); this module adds the model's
own:

    model.embed_tokens.weight [v, d] -> embed [v, d];  model.norm.weight [d] -> final_norm.scale
    lm_head.weight [v, d] -> lm_head [d, v] (absent when tied)
    value_head.weight [1, d] -> value_kernel [d];  value_head.bias [1] -> value_bias []

HF `nn.Linear` stores `[out, in]`; we store `[in, ...out]` so that a matmul is `x @ W` (the maps: `hf_maps`). A
layout with `expert=j` is slice j of our stacked [x, ...] expert parameter.

`params_to_hf_tensors` / `hf_tensors_to_state` convert whole models, e.g. to sync weights with another engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpegjax.models.config import Architecture, ModelConfig, routing_rule
from rpegjax.models.hf_maps import TensorLayout, leading_one, tensor_layout, transposed
from rpegjax.models.layer_stack import Block
from rpegjax.models.routing import RoutingRule
from rpegjax.models.transformer import Decoder

__all__ = ["FLOAT_DTYPES", "CheckpointError", "TensorLayout", "abstract_split", "check_tensor", "convert_tensor",
           "hf_config", "hf_incompatibilities", "hf_tensors_to_state", "iter_hf_tensors", "params_to_hf_tensors",
           "state_from_values", "tensor_layouts"]

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors dtype codes we accept for parameters


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as the model it claims to be."""


def tensor_layouts(cfg: ModelConfig) -> list[TensorLayout]:
    """Every HF tensor of a checkpoint of `cfg` (value head included when `cfg.value_head`), in file order: each
    layer's as its kinds list them (`layer_stack.Block.hf_tensors`)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [tensor_layout("model.embed_tokens.weight", ("embed",), (v, d))]
    for i in range(cfg.num_layers):
        out += Block.hf_tensors(cfg, i)
    out.append(tensor_layout("model.norm.weight", ("final_norm", "scale"), (d,)))
    if not cfg.tie_word_embeddings:
        out.append(tensor_layout("lm_head.weight", ("lm_head",), (v, d), transposed()))
    if cfg.value_head:
        out.append(tensor_layout("value_head.weight", ("value_kernel",), (1, d), leading_one((d,))))
        out.append(tensor_layout("value_head.bias", ("value_bias",), (1,), leading_one(())))
    return out


def hf_incompatibilities(cfg: ModelConfig) -> list[str]:
    """What transformers' class for `cfg.architecture` cannot express (Qwen2 without biases is saved with zero biases)."""
    problems = []
    if cfg.architecture != Architecture.QWEN2 and cfg.attention_bias:
        problems.append(f"attention_bias=True ({cfg.architecture.value} in transformers would also bias o_proj)")
    if cfg.shared_expert_intermediate_size and cfg.architecture == Architecture.QWEN3_MOE:
        problems.append(f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} (transformers' "
                        "qwen3_moe has no shared expert)")
    if cfg.qk_norm != (cfg.architecture in (Architecture.QWEN3, Architecture.QWEN3_MOE)):
        problems.append(f"qk_norm={cfg.qk_norm} (transformers' {cfg.architecture.value} has qk_norm={not cfg.qk_norm})")
    softmax_top_k = RoutingRule(top_k=cfg.num_experts_per_token, norm_topk_prob=cfg.norm_topk_prob)
    if cfg.architecture == Architecture.QWEN3_MOE and (routing_rule(cfg) != softmax_top_k or cfg.router_correction_bias):
        problems.append(f"the router {routing_rule(cfg)} with correction bias={cfg.router_correction_bias} "
                        "(transformers' Qwen3-MoE routes by softmax top-k alone)")
    return problems


def hf_config(cfg: ModelConfig) -> ModelConfig:
    """The config a saved checkpoint describes: transformers' Qwen2 always has q/k/v biases (ours are then zero)."""
    return cfg.replace(attention_bias=True) if cfg.architecture == Architecture.QWEN2 else cfg


# ---- pure conversions ---------------------------------------------------------------------------------------
def params_to_hf_tensors(model: Decoder, *, dtype=None) -> dict[str, np.ndarray]:
    """HF-named host arrays of every parameter of `model` (in `dtype`, default the stored param dtype).

    A Qwen2 model without attention biases gets zero q/k/v biases, as transformers' Qwen2 always has them.
    """
    return dict(iter_hf_tensors(model, hf_config(model.cfg), dtype))


def iter_hf_tensors(
    model: Decoder, cfg: ModelConfig, dtype, names: set[str] | None = None,
    to_host: Callable[[jax.Array], np.ndarray] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) for the layouts of `cfg` (only `names` when given), converted one at a time.

    `to_host` fetches one parameter (default `jax.device_get`: each shard copied to host and assembled there,
    for arrays whose shards this process holds)."""
    to_host = to_host or jax.device_get
    flat = {path: variable for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    fetched: tuple[tuple, np.ndarray] | None = None  # the last stacked expert parameter: fetched once, not per expert
    for layout in tensor_layouts(cfg):
        if names is not None and layout.name not in names:
            continue
        if layout.expert is not None:
            if fetched is None or fetched[0] != layout.path:
                fetched = (layout.path, np.asarray(to_host(flat[layout.path].get_value())))
            ours = fetched[1][layout.expert]
        elif layout.path in flat:
            ours = np.asarray(to_host(flat[layout.path].get_value()))
        else:  # a bias of a bias-less Qwen2: zero is exactly "no bias"
            ours = np.zeros(layout.to_ours(np.zeros(layout.hf_shape)).shape, np.float32)
        target = np.dtype(dtype if dtype is not None else ours.dtype)
        yield layout.name, np.ascontiguousarray(layout.to_hf(ours).astype(target))


def hf_tensors_to_state(
    tensors: Mapping[str, np.ndarray], cfg: ModelConfig, *, source: str = "<tensors>"
) -> nnx.State:
    """The parameter state of `Decoder(cfg)` (as `nnx.split` returns it) from HF-named arrays.

    Every tensor of `tensor_layouts(cfg)` must be present with its HF shape and a floating dtype; arrays are
    cast to `cfg.param_dtype`. Raises CheckpointError naming `source` and the tensor otherwise.
    """
    layouts = tensor_layouts(cfg)
    missing = [layout.name for layout in layouts if layout.name not in tensors]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - {layout.name for layout in layouts})
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    values = {layout.path: convert_tensor(tensors[layout.name], layout, cfg, source) for layout in layouts
              if layout.expert is None}
    experts: dict[tuple, list[jax.Array]] = {}
    for layout in layouts:
        if layout.expert is not None:
            experts.setdefault(layout.path, []).append(convert_tensor(tensors[layout.name], layout, cfg, source))
    values.update({path: jnp.stack(blocks) for path, blocks in experts.items()})  # layouts list experts in order
    return state_from_values(cfg, values)


def convert_tensor(array: np.ndarray, layout: TensorLayout, cfg: ModelConfig, source: str) -> jax.Array:
    check_tensor(tuple(array.shape), _numpy_dtype_code(array.dtype), layout, source)
    return jnp.asarray(layout.to_ours(array).astype(jnp.dtype(cfg.jnp_param_dtype)))


def _numpy_dtype_code(dtype: np.dtype) -> str:
    """numpy dtype -> the safetensors code (F32, BF16, I32, ...) that `_check_tensor` expects."""
    name = np.dtype(dtype).name
    return {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}.get(name, name)


def check_tensor(shape: tuple[int, ...], dtype_code: str, layout: TensorLayout, source: str) -> None:
    if shape != layout.hf_shape:
        raise CheckpointError(
            f"{source}: tensor {layout.name!r} has shape {shape}, expected {layout.hf_shape} from the config")
    if dtype_code not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{source}: tensor {layout.name!r} has dtype {dtype_code}, expected a float dtype {sorted(FLOAT_DTYPES)}")


def abstract_split(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and shape-only state of `Decoder(cfg)`, without initialising any weights."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def state_from_values(cfg: ModelConfig, values: Mapping[tuple, jax.Array]) -> nnx.State:
    """Fills the abstract state of `Decoder(cfg)`; parameters absent from `values` (only a new value head) are zero."""
    _, abstract = abstract_split(cfg)
    filled = []
    for path, variable in nnx.to_flat_state(abstract):
        spec = variable.get_value()
        value = values[path] if path in values else jnp.zeros(spec.shape, spec.dtype)
        filled.append((path, variable.replace(value)))
    return nnx.from_flat_state(filled)
