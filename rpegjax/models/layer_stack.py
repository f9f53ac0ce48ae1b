"""The layer stack: each layer kind's module, chosen through explicit dicts, inside one residual block.

`MIXERS` maps a `MixerKind` to the module class that owns that kind (docs/architecture.md, "Layer kinds": its
parameters and HF names, its RoPE setting, its generation state in both samplers and its decode step); `MLPS` maps an
`MlpKind` to its module. A new kind is a module and an entry here; the samplers, the cache containers and the HF
layout reach it only through these dicts and the class methods the kind's module defines.
"""

from __future__ import annotations

from flax import nnx

from rpegjax.models.config import ModelConfig
from rpegjax.models.full_attention import Attention
from rpegjax.models.kinds import MixerKind, MlpKind, PageGroup
from rpegjax.models.lora import LoRAConfig
from rpegjax.models.mlp import MLP
from rpegjax.models.moe import SparseMoE
from rpegjax.models.norm import RMSNorm
from rpegjax.models.rope import Rope
from rpegjax.models.hf_maps import TensorLayout, tensor_layout
from rpegjax.sharding import axes
from rpegjax.sharding.rules import constrain

MIXERS: dict[MixerKind, type[nnx.Module]] = {
    MixerKind.FULL_ATTENTION: Attention,
}
MLPS: dict[MlpKind, type[nnx.Module]] = {MlpKind.DENSE: MLP, MlpKind.EXPERTS: SparseMoE}

# Logical layouts of [b, t, d] activations: the residual stream between blocks (split on its sequence over `tensor`
# too under sequence parallelism), and a block's normed input to its column-parallel projections (gathered there).
RESIDUAL = (axes.BATCH, axes.RESIDUAL_SEQ, axes.EMBED)
GATHERED = (axes.BATCH, axes.SEQ, axes.EMBED)


def mixer_of(cfg: ModelConfig, index: int) -> type[nnx.Module]:
    """The module class of layer `index`'s mixer kind."""
    return MIXERS[cfg.layer_kind(index).mixer]


def layer_ropes(cfg: ModelConfig) -> tuple[Rope | None, ...]:
    """Each layer's RoPE setting (None: the kind uses none)."""
    return tuple(mixer_of(cfg, i).rope(cfg, i) for i in range(cfg.num_layers))


def page_groups(cfg: ModelConfig) -> tuple[tuple[PageGroup, ...], tuple[int | None, ...]]:
    """The distinct page groups of the stack's paged layers, in layer order, and each layer's index into them (None:
    a layer with no pages, only per-row state)."""
    groups: list[PageGroup] = []
    of_layer: list[int | None] = []
    for i in range(cfg.num_layers):
        group = mixer_of(cfg, i).page_group(cfg, i)
        if group is not None and group not in groups:
            groups.append(group)
        of_layer.append(None if group is None else groups.index(group))
    return tuple(groups), tuple(of_layer)


class Block(nnx.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)): layer `index` of the stack, its kinds from `cfg.layer_kind(index)`."""

    def __init__(self, cfg: ModelConfig, index: int = 0, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        kind = cfg.layer_kind(index)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.attention = MIXERS[kind.mixer](cfg, index, rngs=rngs, lora=lora)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.mlp = MLPS[kind.mlp].build(cfg, rngs=rngs, lora=lora)

    @classmethod
    def hf_tensors(cls, cfg: ModelConfig, index: int) -> list[TensorLayout]:
        """Layer `index`'s HF tensors: its mixer's, its MLP's, then `model.layers.N.{input,post_attention}_layernorm`
        [d] -> layers.N.{input,post_attention}_norm.scale."""
        kind, d = cfg.layer_kind(index), cfg.hidden_size
        norms = [tensor_layout(f"model.layers.{index}.{name}_layernorm.weight", ("layers", index, f"{name}_norm",
                                                                                 "scale"), (d,))
                 for name in ("input", "post_attention")]
        return MIXERS[kind.mixer].hf_tensors(cfg, index) + MLPS[kind.mlp].hf_tensors(cfg, index) + norms

    def __call__(self, x, rope, key_mask, layer_cache, cache_offsets, sharding, dropout_key=None, expert_ids=None,
                 segment_ids=None):
        """(output, written cache layer, `Routing` of a sparse layer or None); `expert_ids` [b t k]: replay;
        `segment_ids` [b t]: packed rows."""
        # under sequence parallelism: all-gather before the projections, reduce-scatter after them (GSPMD inserts both)
        normed = constrain(self.input_norm(x), sharding, GATHERED)
        attended, new_cache = self.attention(normed, rope, key_mask, layer_cache, cache_offsets, sharding,
                                             dropout_key, segment_ids)
        x = x + constrain(attended, sharding, RESIDUAL)
        normed = constrain(self.post_attention_norm(x), sharding, GATHERED)
        routing = None
        if isinstance(self.mlp, SparseMoE):
            mixed, routing = self.mlp(normed, sharding, expert_ids, key_mask)
        else:
            mixed = self.mlp(normed, sharding, dropout_key)
        x = x + constrain(mixed, sharding, RESIDUAL)
        return constrain(x, sharding, RESIDUAL), new_cache, routing
