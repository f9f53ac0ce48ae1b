"""Per-token log-probabilities without materialising `[batch, seq, vocab]` float32 logits."""

from __future__ import annotations

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


def _chunk_logits(h, kernel, temperature):  # kernel: already the compute-dtype cast
    return (h.astype(kernel.dtype) @ kernel).astype(jnp.float32) / temperature


def _chunk_forward(h, kernel, y, temperature, with_entropy):
    """(log p[y], entropy or None) of one chunk, p = softmax(h W / temperature); [b, c] each."""
    log_probs = jax.nn.log_softmax(_chunk_logits(h, kernel, temperature), axis=-1)
    picked = jnp.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
    return picked, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1) if with_entropy else None


def _chunk_backward(h, kernel, y, d_picked, d_entropy, temperature):
    """(dh, float32 dW) of one chunk from its recomputed logits: d log p[y] / d logits = onehot(y) - p;
    d H / d logits = -p (log p + H); one pass over [b, c, v]. dW is computed in the compute dtype (as the
    matmul's own backward would) and only then widened, to be summed over the chunks in float32."""
    log_probs = jax.nn.log_softmax(_chunk_logits(h, kernel, temperature), axis=-1)
    probs = jnp.exp(log_probs)
    onehot = y[..., None] == jnp.arange(log_probs.shape[-1])
    d_logits = d_picked[..., None] * (onehot - probs)
    if d_entropy is not None:
        entropy = -jnp.sum(probs * log_probs, axis=-1, keepdims=True)
        d_logits = d_logits - d_entropy[..., None] * probs * (log_probs + entropy)
    d_logits = (d_logits / temperature).astype(kernel.dtype)
    d_h = (d_logits @ kernel.T).astype(h.dtype)
    d_kernel = jnp.einsum("bcd,bcv->dv", h.astype(kernel.dtype), d_logits).astype(jnp.float32)
    return d_h, d_kernel


class _ChunkLoop:
    """The chunk loop over [n, b, c, chunk, ...] chunks of rows split r ways (batch axes) and c ways (sequence
    axes), under one hand-written VJP.

    Both passes cast W to the compute dtype and only then broadcast it to one copy per shard [r, c, d, v], so FSDP
    gathers the bfloat16 cast, never the float32 master (7B: 1.09 GiB per device with tensor 2, 2.18 at fsdp8;
    `benchmarks/bench_memory.py --target cuda-h100`). The forward keeps only the chunks' inputs (no per-shard copy of W,
    no logits); the backward recomputes each chunk's logits and sums its shard's dW over the chunks into a float32
    accumulator [r, c, d, v], and the r c partials are summed once after the loop (one all-reduce or
    reduce-scatter per backward, not one per chunk)."""

    def __init__(self, rows, parts, temperature, with_entropy, dtype, sharding):
        self.rows, self.parts, self.temperature, self.with_entropy, self.dtype = (
            rows, parts, temperature, with_entropy, dtype)
        self.sharding = sharding
        row_axis = axes.BATCH if rows > 1 else None  # rows that do not divide the batch axes stay replicated
        self.per_shard_spec = (row_axis, axes.SEQ if parts > 1 else None, None, axes.VOCAB)
        self.run = jax.custom_vjp(self.forward)
        self.run.defvjp(self.forward_with_residuals, self.backward)

    def on_shards(self, x):  # [r, c, d, v]: shard (i, j)'s copy on shard (i, j)
        return x if self.rows * self.parts == 1 else constrain(x, self.sharding, self.per_shard_spec)

    def per_shard_kernels(self, kernel):  # [d, v] -> its compute-dtype cast, one copy per shard [r, c, d, v]
        return self.on_shards(jnp.broadcast_to(kernel.astype(self.dtype), (self.rows, self.parts, *kernel.shape)))

    def split(self, x):  # rows are sharded in contiguous blocks: [b, c, ...] -> [r, c, b / r, ...]
        return x.reshape(self.rows, -1, *x.shape[1:]).swapaxes(1, 2)

    @staticmethod
    def merged(x):  # [r, c, b / r, ...] -> [b, c, ...]
        return x.swapaxes(1, 2).reshape(-1, x.shape[1], *x.shape[3:])

    def forward(self, hidden_chunks, kernel, target_chunks):
        """(log p[y], entropy or None), [n, b, c, chunk] each."""
        kernels = self.per_shard_kernels(kernel)
        per_shard = jax.vmap(jax.vmap(lambda h, w, y: _chunk_forward(h, w, y, self.temperature, self.with_entropy)))

        def one_chunk(h, y):
            return jax.tree.map(self.merged, per_shard(self.split(h), kernels, self.split(y)))

        if hidden_chunks.shape[0] == 1:  # one chunk: no loop (its carries and copies cost more than the chunk saves)
            return jax.tree.map(lambda x: x[None], one_chunk(hidden_chunks[0], target_chunks[0]))
        return jax.lax.map(lambda args: one_chunk(*args), (hidden_chunks, target_chunks))

    def forward_with_residuals(self, hidden_chunks, kernel, target_chunks):
        return self.forward(hidden_chunks, kernel, target_chunks), (hidden_chunks, kernel, target_chunks)

    def backward(self, residuals, grads):
        hidden_chunks, kernel, target_chunks = residuals
        d_picked, d_entropy = grads
        kernels = self.per_shard_kernels(kernel)
        per_shard = jax.vmap(jax.vmap(
            lambda h, w, y, dp, de: _chunk_backward(h, w, y, dp, de, self.temperature)))

        def one_chunk(d_kernels, chunk):
            h, y, dp, de = (None if x is None else self.split(x) for x in chunk)
            d_h, d_kernel = per_shard(h, kernels, y, dp, de)
            return d_kernels + d_kernel, self.merged(d_h)

        zeros = self.on_shards(jnp.zeros(kernels.shape, jnp.float32))
        chunks = (hidden_chunks, target_chunks, d_picked, d_entropy)
        if hidden_chunks.shape[0] == 1:
            d_kernels, d_hidden = one_chunk(zeros, jax.tree.map(lambda x: x[0], chunks))
            d_hidden = d_hidden[None]
        else:
            d_kernels, d_hidden = jax.lax.scan(one_chunk, zeros, chunks)
        d_kernel = d_kernels.sum(axis=(0, 1))
        if self.rows * self.parts > 1:
            # reduced to W's own shard before dh is released: otherwise XLA schedules the reduce-scatter after the
            # layers' backward (nothing there needs it) and the whole float32 sum stays live through it
            d_kernel = self.sharding.sharded_weight(d_kernel, (axes.EMBED, axes.VOCAB), name="output matrix gradient")
            d_hidden, d_kernel = jax.lax.optimization_barrier((d_hidden, d_kernel))
        return d_hidden, d_kernel.astype(kernel.dtype), np.zeros(target_chunks.shape, jax.dtypes.float0)


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
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """log softmax(hidden @ W / temperature)[targets], computed `chunk_size` positions at a time.

    Each chunk's logits are recomputed in the backward pass (a hand-written VJP over the chunk loop that keeps
    only the chunks' inputs), so the peak is one chunk of `[b, chunk, v]` float32 logits, forward and backward.
    Optionally also the entropy -sum p log p of each position's distribution. W is used as its `dtype` cast
    (gathered as that cast); its gradient is summed over the chunks in float32 and returned in W's dtype.

    With `sharding` whose batch axes split the rows r ways and whose sequence axes (context parallelism) split
    each row into c parts, every device runs the chunk loop over its own part: the rows are viewed as
    [b, c, t / c] and W's cast is broadcast to one copy per shard [r, c, d, v], so each shard accumulates its own
    partial dW over the chunks and the r c partials are summed once after the loop (`_ChunkLoop`).
    """
    b, t, d = hidden.shape
    rows, parts = _shards(sharding, axes.BATCH, b), _shards(sharding, axes.SEQ, t)
    part = t // parts
    chunk = max(1, min(chunk_size, part))
    row_axis = axes.BATCH if rows > 1 else None
    hidden = hidden.reshape(b, parts, part, d)
    if parts > 1:
        hidden = constrain(hidden, sharding, (row_axis, axes.SEQ, None, None))

    def chunks(x: Array) -> Array:  # [b, c, t / c, ...] -> [n, b, c, chunk, ...]
        x = _pad_to_multiple(x, chunk, axis=2)
        return jnp.moveaxis(x.reshape(b, parts, -1, chunk, *x.shape[3:]), 2, 0)

    loop = _ChunkLoop(rows, parts, temperature, with_entropy, dtype, sharding)
    picked, entropy = loop.run(chunks(hidden), output_kernel, chunks(targets.reshape(b, parts, part)))

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
