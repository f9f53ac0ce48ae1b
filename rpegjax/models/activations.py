"""The gated activations of the dense MLP: SwiGLU (also every expert's, with a fused hand-written backward) and GeGLU."""

from __future__ import annotations

import jax
from jaxtyping import Array, Float


@jax.custom_vjp
def swiglu(gate: Float[Array, "... f"], up: Float[Array, "... f"]) -> Float[Array, "... f"]:
    """silu(gate) * up, with a hand-written backward: XLA fuses each direction into one elementwise pass
    (autodiff materialises sigmoid, silu and their products separately, several passes over [b t f])."""
    return gate * jax.nn.sigmoid(gate) * up


def _swiglu_forward(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_backward(residuals, grad):
    gate, up = residuals
    sig = jax.nn.sigmoid(gate)  # recomputed: cheaper than storing it
    # d silu(g) / dg = sig (1 + g (1 - sig))
    return grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig


swiglu.defvjp(_swiglu_forward, _swiglu_backward)


def geglu(gate: Float[Array, "... f"], up: Float[Array, "... f"]) -> Float[Array, "... f"]:
    """gelu(gate) * up with gelu's tanh approximation (transformers' `gelu_pytorch_tanh`, Gemma's MLP):
    gelu(x) = x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    return jax.nn.gelu(gate, approximate=True) * up
