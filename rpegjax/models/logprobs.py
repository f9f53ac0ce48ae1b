"""Per-token log-probabilities without materialising `[batch, seq, vocab]` float32 logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rpegjax.models.transformer import Decoder
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain


def _pad_to_multiple(x: Array, multiple: int, axis: int = 1) -> Array:
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunk_logprobs(h, kernel, y, temperature: float, with_entropy: bool, dtype):
    """(log p[y], entropy or zeros) of one chunk, p = softmax(h W / temperature); [b, c] each."""
    return _chunk_forward(h, kernel, y, temperature, with_entropy, dtype)[0]


def _chunk_logits(h, kernel, temperature, dtype):
    return (h.astype(dtype) @ kernel.astype(dtype)).astype(jnp.float32) / temperature


def _chunk_forward(h, kernel, y, temperature, with_entropy, dtype):
    log_probs = jax.nn.log_softmax(_chunk_logits(h, kernel, temperature, dtype), axis=-1)
    picked = jnp.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1) if with_entropy else jnp.zeros_like(picked)
    # the logits are recomputed in the backward (as jax.checkpoint would): only the inputs are kept
    return (picked, entropy), (h, kernel, y)


def _chunk_backward(temperature, with_entropy, dtype, residuals, grads):
    """d log p[y] / d logits = onehot(y) - p;  d H / d logits = -p (log p + H); one pass over [b, c, v]."""
    h, kernel, y = residuals
    d_picked, d_entropy = grads
    log_probs = jax.nn.log_softmax(_chunk_logits(h, kernel, temperature, dtype), axis=-1)
    probs = jnp.exp(log_probs)
    onehot = y[..., None] == jnp.arange(log_probs.shape[-1])
    d_logits = d_picked[..., None] * (onehot - probs)
    if with_entropy:
        entropy = -jnp.sum(probs * log_probs, axis=-1, keepdims=True)
        d_logits = d_logits - d_entropy[..., None] * probs * (log_probs + entropy)
    d_logits = (d_logits / temperature).astype(dtype)
    d_h = (d_logits @ kernel.astype(dtype).T).astype(h.dtype)
    d_kernel = jnp.einsum("bcd,bcv->dv", h.astype(dtype), d_logits).astype(kernel.dtype)
    return d_h, d_kernel, np.zeros(y.shape, jax.dtypes.float0)


_chunk_logprobs.defvjp(lambda *args: _chunk_forward(*args), _chunk_backward)


def logprobs_from_hidden(
    hidden: Float[Array, "b t d"],
    output_kernel: Float[Array, "d v"],
    targets: Int[Array, "b t"],
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    with_entropy: bool = False,
    dtype=jnp.float32,
    sharding: ActivationSharding | None = None,
    forward_only: bool = False,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """log softmax(hidden @ W / temperature)[targets], computed `chunk_size` positions at a time.

    Each chunk's logits are recomputed in the backward pass (a hand-written VJP that keeps only the
    chunk's inputs), so the peak is one chunk of `[b, chunk, v]` float32 logits, forward and backward.
    Optionally also the entropy -sum p log p of each position's distribution.

    With `sharding` whose batch axes split the rows r ways and whose sequence axes (context parallelism) split
    each row into c parts, every device runs the chunk loop over its own part: the rows are viewed as
    [b, c, t / c] and W is broadcast to one copy per shard [r, c, d, v] before the loop, so each shard accumulates
    its own partial dW over the chunks and the broadcast's transpose sums the r c partials once after the loop
    (one all-reduce per backward instead of one per chunk; costs one [d, v] accumulator per device).
    `forward_only`: a pass that is never differentiated (the inference stages) casts W to `dtype` before the
    copies are gathered, so each shard gathers the compute-dtype kernel, not float32 masters and then their cast
    (Llama 3.1 8B on fsdp8: 1 GB per device per model, not 3; docs/benchmarks.md, issue 23 session 11); the same
    values, as every chunk casts W anyway. A differentiated pass keeps W in its own dtype, so its gradient sums
    over the chunks in that dtype.
    """
    b, t, d = hidden.shape
    if forward_only:
        output_kernel = output_kernel.astype(dtype)
    rows, parts = _shards(sharding, axes.BATCH, b), _shards(sharding, axes.SEQ, t)
    part = t // parts
    chunk = max(1, min(chunk_size, part))
    row_axis = axes.BATCH if rows > 1 else None  # rows that do not divide the batch axes stay replicated
    hidden = hidden.reshape(b, parts, part, d)
    if parts > 1:
        hidden = constrain(hidden, sharding, (row_axis, axes.SEQ, None, None))

    def chunks(x: Array) -> Array:  # [b, c, t / c, ...] -> [n, b, c, chunk, ...]
        x = _pad_to_multiple(x, chunk, axis=2)
        return jnp.moveaxis(x.reshape(b, parts, -1, chunk, *x.shape[3:]), 2, 0)

    def one_chunk(h, y):  # h [b, c, chunk, d], y [b, c, chunk]
        if rows * parts == 1:
            return jax.tree.map(lambda x: x[:, None], _chunk_logprobs(h[:, 0], output_kernel, y[:, 0], temperature,
                                                                      with_entropy, dtype))
        # rows are sharded in contiguous blocks: [b, c, ...] -> [r, c, b / r, ...] keeps each block on its shard
        per_shard = jax.vmap(jax.vmap(lambda h, w, y: _chunk_logprobs(h, w, y, temperature, with_entropy, dtype)))
        split = lambda x: x.reshape(rows, -1, *x.shape[1:]).swapaxes(1, 2)  # noqa: E731
        outs = per_shard(split(h), kernels, split(y))
        return jax.tree.map(lambda x: x.swapaxes(1, 2).reshape(b, parts, *x.shape[3:]), outs)

    if rows * parts > 1:
        kernels = jnp.broadcast_to(output_kernel, (rows, parts, *output_kernel.shape))
        kernels = constrain(kernels, sharding, (row_axis, axes.SEQ if parts > 1 else None, None, axes.VOCAB))

    hidden_chunks, target_chunks = chunks(hidden), chunks(targets.reshape(b, parts, part))
    if hidden_chunks.shape[0] == 1:  # one chunk: no loop (its carries and copies cost more than the chunk saves)
        picked, entropy = jax.tree.map(lambda x: x[None], one_chunk(hidden_chunks[0], target_chunks[0]))
    else:
        picked, entropy = jax.lax.map(lambda args: one_chunk(*args), (hidden_chunks, target_chunks))

    def unchunked(x: Array) -> Array:  # [n, b, c, chunk] -> [b, t]
        x = jnp.moveaxis(x, 0, 2).reshape(b, parts, -1)[:, :, :part].reshape(b, t)
        return x if parts == 1 else constrain(x, sharding, (row_axis, axes.SEQ))

    return unchunked(picked), unchunked(entropy) if with_entropy else None


def _shards(sharding: ActivationSharding | None, logical: str, size: int) -> int:
    """How many ways `sharding` splits a dimension of logical axis `logical` and `size` (1 without sharding or when
    they do not divide it)."""
    if sharding is None:
        return 1
    shards = sharding.shards(logical)
    return shards if size % shards == 0 else 1


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
        hidden, model.output_kernel(), targets, chunk_size=chunk_size, temperature=temperature, dtype=model.cfg.jnp_dtype,
        sharding=sharding,
    )
    return picked.at[:, -1].set(0.0)
