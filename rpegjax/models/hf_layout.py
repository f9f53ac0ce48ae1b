"""Hugging Face tensor names and layouts <-> the parameters of our `Decoder` (pure, no file I/O).

HF `nn.Linear` stores `[out, in]`; we store `[in, ...out]` so that a matmul is `x @ W`:

    model.embed_tokens.weight                  [v, d]     -> embed                      [v, d]
    model.layers.N.self_attn.q_proj.weight     [h*e, d]   -> layers.N.attention.q_proj  [d, h, e]
    model.layers.N.self_attn.{k,v}_proj.weight [k*e, d]   -> ...{k,v}_proj              [d, k, e]
    model.layers.N.self_attn.o_proj.weight     [d, h*e]   -> ...o_proj                  [h, e, d]
    model.layers.N.self_attn.{q,k,v}_proj.bias [n*e]      -> ...{q,k,v}_bias            [n, e]
    model.layers.N.self_attn.{q,k}_norm.weight [e]        -> ...{q,k}_norm.scale        [e]
    model.layers.N.mlp.{gate,up}_proj.weight   [f, d]     -> layers.N.mlp.{gate,up}_proj [d, f]
    model.layers.N.mlp.down_proj.weight        [d, f]     -> layers.N.mlp.down_proj     [f, d]
    model.layers.N.{input,post_attention}_layernorm.weight -> layers.N.{input,post_attention}_norm.scale
    model.norm.weight [d] -> final_norm.scale;  lm_head.weight [v, d] -> lm_head [d, v] (absent when tied)
    value_head.weight [1, d] -> value_kernel [d];  value_head.bias [1] -> value_bias []

A sparse (mixture-of-experts) layer's MLP instead, expert j of x:

    model.layers.N.mlp.gate.weight                    [x, d] -> layers.N.mlp.router            [d, x]
    model.layers.N.mlp.experts.j.{gate,up}_proj.weight [f, d] -> layers.N.mlp.{gate,up}_proj[j] [d, f]
    model.layers.N.mlp.experts.j.down_proj.weight     [d, f] -> layers.N.mlp.down_proj[j]      [f, d]
    model.layers.N.mlp.shared_expert.*_proj.weight           -> layers.N.mlp.shared_expert.*_proj (as a dense MLP)
    model.layers.N.mlp.shared_expert_gate.weight      [1, d] -> layers.N.mlp.shared_expert_gate [d]

(the per-expert names of the published Qwen3-MoE checkpoints, which transformers 5 also writes); such a layout
has `expert=j`: it is slice j of our stacked [x, ...] parameter.

`params_to_hf_tensors` / `hf_tensors_to_state` convert whole models, e.g. to sync weights with another engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpegjax.models.config import Architecture, ModelConfig, routing_rule
from rpegjax.models.hf_maps import (
    Window,
    bias,
    identity,
    in_projection,
    leading_one,
    out_projection,
    transposed,
)
from rpegjax.models.routing import RoutingRule
from rpegjax.models.transformer import Decoder

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors dtype codes we accept for parameters


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as the model it claims to be."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """How one HF tensor maps onto one parameter of our `Decoder` state.

    `window(ours)` maps a window of our parameter (a device's shard) to the window of the HF tensor that
    holds it and a function turning that HF block into our block: a process reads only what it places.
    """

    name: str  # HF name
    path: tuple[str | int, ...]  # path in `nnx.state(decoder)`
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    window: Callable[[Window], tuple[Window, Callable[[np.ndarray], np.ndarray]]]
    expert: int | None = None  # this tensor is [expert] of our parameter (stacked over experts); maps act on it


def tensor_layouts(cfg: ModelConfig) -> list[TensorLayout]:
    """Every HF tensor of a checkpoint of `cfg` (value head included when `cfg.value_head`), in file order."""
    d, f, h, k, e, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    out: list[TensorLayout] = []

    def add(name, path, hf_shape, maps=None, expert=None):
        maps = identity() if maps is None else maps
        out.append(TensorLayout(name=name, path=path, hf_shape=hf_shape, to_ours=maps[0], to_hf=maps[1],
                                window=maps[2], expert=expert))

    add("model.embed_tokens.weight", ("embed",), (v, d))
    for i in range(cfg.num_layers):
        hf, attention = f"model.layers.{i}.", ("layers", i, "attention")
        for proj, heads in (("q", h), ("k", k), ("v", k)):
            add(f"{hf}self_attn.{proj}_proj.weight", (*attention, f"{proj}_proj"), (heads * e, d),
                in_projection(d, heads, e))
            if cfg.attention_bias:
                add(f"{hf}self_attn.{proj}_proj.bias", (*attention, f"{proj}_bias"), (heads * e,),
                    bias(heads, e))
        add(f"{hf}self_attn.o_proj.weight", (*attention, "o_proj"), (d, h * e), out_projection(h, e, d))
        if cfg.qk_norm:
            add(f"{hf}self_attn.q_norm.weight", (*attention, "q_norm", "scale"), (e,))
            add(f"{hf}self_attn.k_norm.weight", (*attention, "k_norm", "scale"), (e,))
        mlp = ("layers", i, "mlp")
        if cfg.is_sparse_layer(i):
            moe_f = cfg.moe_intermediate_size
            add(f"{hf}mlp.gate.weight", (*mlp, "router"), (cfg.num_experts, d), transposed())
            for j in range(cfg.num_experts):
                for proj, shape in (("gate", (moe_f, d)), ("up", (moe_f, d)), ("down", (d, moe_f))):
                    add(f"{hf}mlp.experts.{j}.{proj}_proj.weight", (*mlp, f"{proj}_proj"), shape, transposed(), j)
            shared = cfg.shared_expert_intermediate_size
            for proj, shape in (("gate", (shared, d)), ("up", (shared, d)), ("down", (d, shared))) if shared else ():
                add(f"{hf}mlp.shared_expert.{proj}_proj.weight", (*mlp, "shared_expert", f"{proj}_proj"), shape,
                    transposed())
            if cfg.shared_expert_gate:
                add(f"{hf}mlp.shared_expert_gate.weight", (*mlp, "shared_expert_gate"), (1, d), leading_one((d,)))
        else:
            add(f"{hf}mlp.gate_proj.weight", (*mlp, "gate_proj"), (f, d), transposed())
            add(f"{hf}mlp.up_proj.weight", (*mlp, "up_proj"), (f, d), transposed())
            add(f"{hf}mlp.down_proj.weight", (*mlp, "down_proj"), (d, f), transposed())
        add(f"{hf}input_layernorm.weight", ("layers", i, "input_norm", "scale"), (d,))
        add(f"{hf}post_attention_layernorm.weight", ("layers", i, "post_attention_norm", "scale"), (d,))
    add("model.norm.weight", ("final_norm", "scale"), (d,))
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", ("lm_head",), (v, d), transposed())
    if cfg.value_head:
        add("value_head.weight", ("value_kernel",), (1, d), leading_one((d,)))
        add("value_head.bias", ("value_bias",), (1,), leading_one(()))
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
