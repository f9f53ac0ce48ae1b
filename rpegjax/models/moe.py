"""The sparse mixture-of-experts layer: a bias-free router, `num_experts` SwiGLU experts and an optional shared expert.

Parameters (ours; Hugging Face's per-expert tensors are in `hf_layout`):

    router              [d, x]     logits = x_t @ router (float32)
    gate_proj           [x, d, f]  expert e's gate kernel is gate_proj[e]
    up_proj             [x, d, f]
    down_proj           [x, f, d]
    shared_expert       a dense SwiGLU MLP of width `shared_expert_intermediate_size` (the decoder's `MLP`)
    shared_expert_gate  [d]        with `shared_expert_gate`: the shared expert's output is scaled by
                                   sigmoid(x_t . shared_expert_gate) (float32), as in Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE

y_t = sum_j w_tj expert_{e_tj}(x_t) + g_t shared_expert(x_t), with g_t = 1 without a gate.

`x` is the expert count (logical axis EXPERT: split over the `expert` mesh axis under expert parallelism), f the
expert width `moe_intermediate_size`. With `router_correction_bias` (DeepSeek-V3) the layer also holds

    correction_bias [x]   added to the scores to choose experts, never to weigh them (no gradient reaches it)

and the router follows `routing_rule(cfg)` (`rpegjax.models.routing`: softmax or sigmoid scores, group-limited
top-k, the routed scaling factor). The experts run dropless, or with `moe_capacity_factor` capped per row
(`rpegjax.models.expert_parallel`). The layer returns the
routing it used (`Routing`): the router's logits for the load-balancing loss and the chosen experts, which a later
pass can replay (`expert_ids=`) so that it routes every token exactly as the recorded pass did; the replayed
experts are weighted by this pass's router scores (`routing.replay_weights`), so the router still learns.
A token whose recorded ids are negative (none recorded, e.g. padding) is routed by its router as usual.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.config import ModelConfig, routing_rule
from rpegjax.models.expert_parallel import compute_experts
from rpegjax.models.hf_maps import TensorLayout, leading_one, tensor_layout, transposed
from rpegjax.models.lora import LoRAConfig
from rpegjax.models.mlp import MLP
from rpegjax.models.routing import replay_weights, route
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain


@flax.struct.dataclass
class Routing:
    """What one sparse layer routed: each token's experts, the router logits they came from, and how many of the
    token's assignments the capacity mode dropped (0 when dropless)."""

    expert_ids: Int[Array, "b t k"]
    router_logits: Float[Array, "b t x"]
    dropped: Int[Array, "b t"]


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, fan_in: int) -> nnx.Param:
    value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(value.astype(dtype), logical_axes=logical)


class SparseMoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, shared_expert: nnx.Module | None = None):
        """`shared_expert`: the dense MLP every token also goes through, built by the caller (the decoder's `MLP` of
        width `cfg.shared_expert_intermediate_size`, so that it is exactly a dense MLP, adapters included); given
        exactly when the config has one."""
        d, f, x, pdt = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.jnp_param_dtype
        if (shared_expert is None) != (cfg.shared_expert_intermediate_size == 0):
            raise ValueError(f"SparseMoE: shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} "
                             f"needs {'a' if shared_expert is None else 'no'} shared_expert module")
        self.router = _normal(rngs, (d, x), (axes.EMBED, None), pdt, d)
        self.gate_proj = _normal(rngs, (x, d, f), (axes.EXPERT, axes.EMBED, axes.MLP), pdt, d)
        self.up_proj = _normal(rngs, (x, d, f), (axes.EXPERT, axes.EMBED, axes.MLP), pdt, d)
        self.down_proj = _normal(rngs, (x, f, d), (axes.EXPERT, axes.MLP, axes.EMBED), pdt, f)
        if cfg.router_correction_bias:
            self.correction_bias = nnx.Param(jnp.zeros((x,), jnp.float32), logical_axes=(None,))
        self.top_k = cfg.num_experts_per_token
        self.rule = routing_rule(cfg)
        self.dtype = cfg.jnp_dtype
        self.capacity_factor = cfg.moe_capacity_factor
        self.shared_expert = shared_expert
        self.gated_shared_expert = cfg.shared_expert_gate
        if cfg.shared_expert_gate:
            self.shared_expert_gate = _normal(rngs, (d,), (axes.EMBED,), pdt, d)

    @classmethod
    def build(cls, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None) -> SparseMoE:
        """The kind's layer: its shared expert a dense `MLP` of width `shared_expert_intermediate_size` (with adapters
        where `lora` targets MLP projections), when the config has one."""
        shared = cfg.shared_expert_intermediate_size
        shared_expert = MLP(cfg.replace(intermediate_size=shared), rngs=rngs, lora=lora) if shared else None
        return cls(cfg, rngs=rngs, shared_expert=shared_expert)

    @classmethod
    def hf_tensors(cls, cfg: ModelConfig, index: int) -> list[TensorLayout]:
        """Expert j of x (the per-expert names of the published Qwen3-MoE checkpoints, which transformers 5 also
        writes; each is slice j of our stacked [x, ...] parameter, `expert=j`), then the shared expert:

            model.layers.N.mlp.gate.weight                     [x, d] -> layers.N.mlp.router            [d, x]
            model.layers.N.mlp.experts.j.{gate,up}_proj.weight [f, d] -> layers.N.mlp.{gate,up}_proj[j] [d, f]
            model.layers.N.mlp.experts.j.down_proj.weight      [d, f] -> layers.N.mlp.down_proj[j]      [f, d]
            model.layers.N.mlp.shared_expert.*_proj.weight            -> layers.N.mlp.shared_expert.*_proj (a dense MLP)
            model.layers.N.mlp.shared_expert_gate.weight       [1, d] -> layers.N.mlp.shared_expert_gate [d]
        """
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        hf, ours = f"model.layers.{index}.mlp.", ("layers", index, "mlp")
        out = [tensor_layout(f"{hf}gate.weight", (*ours, "router"), (cfg.num_experts, d), transposed())]
        for j in range(cfg.num_experts):
            for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                out.append(tensor_layout(f"{hf}experts.{j}.{proj}_proj.weight", (*ours, f"{proj}_proj"), shape,
                                         transposed(), j))
        shared = cfg.shared_expert_intermediate_size
        for proj, shape in (("gate", (shared, d)), ("up", (shared, d)), ("down", (d, shared))) if shared else ():
            out.append(tensor_layout(f"{hf}shared_expert.{proj}_proj.weight", (*ours, "shared_expert", f"{proj}_proj"),
                                     shape, transposed()))
        if cfg.shared_expert_gate:
            out.append(tensor_layout(f"{hf}shared_expert_gate.weight", (*ours, "shared_expert_gate"), (1, d),
                                     leading_one((d,))))
        return out

    def __call__(self, x: Float[Array, "b t d"], sharding: ActivationSharding | None,
                 expert_ids: Int[Array, "b t k"] | None = None, valid: Bool[Array, "b t"] | None = None
                 ) -> tuple[Float[Array, "b t d"], Routing]:
        """The layer's output and its routing; with `expert_ids` the tokens use those experts (replay). `valid`: the
        real tokens (None: all), the only ones that take an expert's capacity in the capacity mode."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d).astype(self.dtype)
        # float32 router (as Megatron's --moe-router-dtype fp32): a bf16 router flips near-tied experts
        logits = flat.astype(jnp.float32) @ self.router.get_value().astype(jnp.float32)
        bias = getattr(self, "correction_bias", None)
        ids, weights = route(logits, self.rule, None if bias is None else bias.get_value())
        if expert_ids is not None:  # a token with any id < 0 has no recorded routing: it keeps its router's choice
            replayed = expert_ids.reshape(b * t, self.top_k).astype(jnp.int32)
            ids = jnp.where(jnp.all(replayed >= 0, axis=-1, keepdims=True), replayed, ids)
            weights = replay_weights(logits, ids, self.rule)
        kernels = (self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value())
        ids, weights = ids.reshape(b, t, self.top_k), weights.reshape(b, t, self.top_k)
        out, dropped = compute_experts(flat.reshape(b, t, d), ids, weights, kernels, sharding, self.capacity_factor,
                                       valid=valid)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, sharding).astype(jnp.float32)
            if self.gated_shared_expert:
                gate = flat.astype(jnp.float32) @ self.shared_expert_gate.get_value().astype(jnp.float32)
                shared = shared * jax.nn.sigmoid(gate).reshape(b, t, 1)
            out = (out.astype(jnp.float32) + shared).astype(out.dtype)
        out = constrain(out, sharding, (axes.BATCH, None, axes.EMBED))
        return out, Routing(expert_ids=ids, router_logits=logits.reshape(b, t, -1), dropped=dropped)
