"""Per-token log-probabilities without materialising `[batch, seq, vocab]` float32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rpegjax.models.transformer import Decoder


def _pad_to_multiple(x: Array, multiple: int, axis: int = 1) -> Array:
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def logprobs_from_hidden(
    hidden: Float[Array, "b t d"],
    output_kernel: Float[Array, "d v"],
    targets: Int[Array, "b t"],
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    with_entropy: bool = False,
    dtype=jnp.float32,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """log softmax(hidden @ W / temperature)[targets], computed `chunk_size` positions at a time.

    Each chunk's logits are recomputed in the backward pass (`jax.checkpoint`), so the peak is one
    chunk of `[b, chunk, v]` float32 logits, forward and backward. Optionally also the entropy
    -sum p log p of each position's distribution.
    """
    b, t, d = hidden.shape
    chunk = max(1, min(chunk_size, t))
    hidden_chunks = _pad_to_multiple(hidden, chunk).reshape(b, -1, chunk, d).swapaxes(0, 1)
    target_chunks = _pad_to_multiple(targets, chunk).reshape(b, -1, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(h, y):
        logits = (h.astype(dtype) @ output_kernel.astype(dtype)).astype(jnp.float32) / temperature
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1) if with_entropy else jnp.zeros_like(picked)
        return picked, entropy

    if hidden_chunks.shape[0] == 1:  # one chunk: no loop (its carries and copies cost more than the chunk saves)
        picked, entropy = jax.tree.map(lambda x: x[None], one_chunk(hidden_chunks[0], target_chunks[0]))
    else:
        picked, entropy = jax.lax.map(lambda args: one_chunk(*args), (hidden_chunks, target_chunks))
    picked = picked.swapaxes(0, 1).reshape(b, -1)[:, :t]
    entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :t] if with_entropy else None
    return picked, entropy


def token_logprobs(
    model: Decoder,
    tokens: Int[Array, "b t"],
    *,
    mask=None,
    positions=None,
    chunk_size: int = 256,
    temperature: float = 1.0,
    sharding=None,
) -> Float[Array, "b t"]:
    """log p(tokens[:, i+1] | tokens[:, :i+1]) at position i; the last position gets 0.

    Output is aligned with `tokens[:, 1:]` shifted left, i.e. `out[:, i]` scores `tokens[:, i+1]`.
    """
    from rpegjax.models.transformer import default_positions

    if positions is None:
        positions = default_positions(tokens, mask)
    hidden, _ = model.hidden_states(tokens, positions, mask=mask, sharding=sharding)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    picked, _ = logprobs_from_hidden(
        hidden, model.output_kernel(), targets, chunk_size=chunk_size, temperature=temperature, dtype=model.cfg.jnp_dtype
    )
    return picked.at[:, -1].set(0.0)
