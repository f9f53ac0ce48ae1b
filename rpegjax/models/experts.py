"""Dropless expert computation: grouped matmuls over tokens sorted by expert (routing: `rpegjax.models.routing`).

The experts (`apply_experts`) are SwiGLU MLPs. Each of the T*k (token, expert) assignments is computed once,
none dropped: the assignments are sorted by expert so that each expert's tokens are contiguous, and three grouped
matmuls (`jax.lax.ragged_dot`, group sizes = tokens per expert) compute every expert's MLP in one pass. XLA does
not run them as grouped GEMMs in jax 0.10.2: the CPU lowering is a masked dense product over all E groups, and
the GPU compiler rewrites them the same way (a batched [E, rows, d] GEMM: E times the FLOPs and the temporaries;
`benchmarks/bench_moe_memory.py` reads it from the compiled HLO; TPU not checked). So the
dropless path is exact everywhere but costs E times a grouped kernel's work; the capacity mode
(`expert_parallel.dispatch_capacity`) is the one whose matmuls do only (capacity) work on GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rpegjax.models.activations import swiglu


def apply_experts(
    x: Float[Array, "n d"],
    expert_ids: Int[Array, "n k"],
    expert_weights: Float[Array, "n k"],
    gate: Float[Array, "x d f"],
    up: Float[Array, "x d f"],
    down: Float[Array, "x f d"],
) -> Float[Array, "n d"]:
    """y_t = sum_j w_tj * down[e_tj]^T (silu(gate[e_tj]^T x_t) * up[e_tj]^T x_t) for e_tj = expert_ids[t, j].

    Dropless: the n*k assignments are sorted by expert (stable, so ties keep token order), each expert's
    contiguous run goes through its weights by `jax.lax.ragged_dot`, and the results return to their tokens by
    the inverse permutation. The weighted sum over the k experts runs in float32; the output has x's dtype.
    """
    n, k = expert_ids.shape
    num_experts = gate.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # assignment slots grouped by expert
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    sorted_x = x[order // k]
    hidden = swiglu(jax.lax.ragged_dot(sorted_x, gate.astype(x.dtype), group_sizes),
                    jax.lax.ragged_dot(sorted_x, up.astype(x.dtype), group_sizes))
    sorted_y = jax.lax.ragged_dot(hidden, down.astype(x.dtype), group_sizes)
    y = sorted_y[jnp.argsort(order)].reshape(n, k, -1)  # back to (token, slot) order
    combined = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), expert_weights.astype(jnp.float32))
    return combined.astype(x.dtype)


def tokens_per_expert(expert_ids: Int[Array, "n k"], valid: Float[Array, " n"], num_experts: int) -> Float[Array, " x"]:
    """How many valid tokens chose each expert (a token counts once per expert it uses)."""
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # n k x
    return jnp.einsum("nkx,n->x", one_hot, valid.astype(jnp.float32))
