"""The dense MLP kind: down(act(x gate) * (x up)), with SwiGLU (Qwen, Llama) or GeGLU (Gemma) as `act`."""

from __future__ import annotations

from flax import nnx
from jaxtyping import Array, Float

from rpegjax.models.activations import geglu, swiglu
from rpegjax.models.config import Activation, ModelConfig
from rpegjax.models.lora import MLP_TARGETS, LoRAConfig
from rpegjax.models.projections import adapted_matmul, add_adapters, param, regathers
from rpegjax.models.hf_maps import TensorLayout, tensor_layout, transposed
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain

GATED_ACTIVATIONS = {Activation.SILU: swiglu, Activation.GELU_TANH: geglu}


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        d, f, pdt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
        self.gate_proj = param(rngs, (d, f), (axes.EMBED, axes.MLP), pdt, d)
        self.up_proj = param(rngs, (d, f), (axes.EMBED, axes.MLP), pdt, d)
        self.down_proj = param(rngs, (f, d), (axes.MLP, axes.EMBED), pdt, f)
        self.dtype = cfg.jnp_dtype
        self.regather = regathers(cfg)
        self.activation = cfg.activation
        add_adapters(self, MLP_TARGETS, lora, dict.fromkeys(MLP_TARGETS, 1), rngs)

    @classmethod
    def build(cls, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None) -> MLP:
        """The kind's layer (the protocol `layer_stack.Block` builds MLP kinds with)."""
        return cls(cfg, rngs=rngs, lora=lora)

    @classmethod
    def hf_tensors(cls, cfg: ModelConfig, index: int) -> list[TensorLayout]:
        """`model.layers.N.mlp.{gate,up}_proj.weight` [f, d] -> {gate,up}_proj [d, f]; down_proj [d, f] -> [f, d]."""
        d, f = cfg.hidden_size, cfg.intermediate_size
        hf, ours = f"model.layers.{index}.mlp.", ("layers", index, "mlp")
        return [tensor_layout(f"{hf}{proj}_proj.weight", (*ours, f"{proj}_proj"), shape, transposed())
                for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f)))]

    def __call__(self, x: Float[Array, "b t d"], sharding: ActivationSharding | None,
                 dropout_key: Array | None = None) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        dt, key = self.dtype, dropout_key
        flat = x.reshape(b * t, d)  # 2-D matmuls are much faster than batched ones on XLA's CPU backend
        gate = adapted_matmul(self, "gate_proj", flat, dt, sharding, key)
        up = adapted_matmul(self, "up_proj", flat, dt, sharding, key)
        hidden = GATED_ACTIVATIONS[self.activation](gate, up)
        hidden = constrain(hidden.reshape(b, t, -1), sharding, (axes.BATCH, axes.SEQ, axes.MLP))
        return adapted_matmul(self, "down_proj", hidden.reshape(b * t, -1), dt, sharding, key).reshape(b, t, d)
