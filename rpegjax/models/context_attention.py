"""Context parallelism: one row's sequence split over the devices of the context axes, attention with all-gathered
keys and values over a load-balanced causal split.

Layout: the t tokens of a row are cut into 2c chunks of m = t / 2c tokens; of the c devices, device i holds chunks i
and 2c-1-i (`balanced_order`), so that under the causal mask every device's queries see about as many keys as any
other's (with contiguous chunks the last device would do c times the first one's work). The model permutes its
integer inputs into that order and its final hidden states back (`to_balanced`, `from_balanced`); every per-token
layer in between runs on the local tokens alone. Attention (`context_attention`) all-gathers keys, values, the key
mask and segment ids over the context axes, puts them in row order, and runs flash attention of the local query
chunks against the keys at or before them (later key blocks are skipped, not masked):

    out_i = sum_{j <= i, seg_j = seg_i, key_mask_j} softmax_j(q_i . k_j / sqrt(e)) v_j,   softmax in float32,

i and j row indices. The backward recomputes each block's probabilities from the log-sum-exp (FlashAttention-2,
query blocks outer, key/value gradients accumulated over the whole row), and the transpose of the all-gather
reduce-scatters the key/value gradients back to their devices. Memory per device: the gathered keys and values of
one layer, [b, t, k, e] each, and blocks of scores.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding

_NEG_INF = -1e30


def balanced_order(length: int, shards: int) -> np.ndarray:
    """Row indices in the load-balanced order: chunks 0, 2c-1, 1, 2c-2, ..., c-1, c of length / 2c tokens each
    (c = `shards`), so that contiguous splitting into c parts gives part i chunks i and 2c-1-i."""
    if length % (2 * shards):
        raise ValueError(f"context parallelism over {shards} devices cuts a row into {2 * shards} equal chunks; a row "
                         f"of {length} tokens does not divide (pick a length bucket that is a multiple of {2 * shards})")
    size = length // (2 * shards)
    chunks = np.stack([np.arange(shards), 2 * shards - 1 - np.arange(shards)], axis=1).reshape(-1)
    return (chunks[:, None] * size + np.arange(size)).reshape(-1)


def to_balanced(x: Array, shards: int) -> Array:
    """[b, t, ...] in row order -> the load-balanced order (`balanced_order`)."""
    return jnp.take(x, balanced_order(x.shape[1], shards), axis=1)


def from_balanced(x: Array, shards: int) -> Array:
    """[b, t, ...] in the load-balanced order -> row order."""
    return jnp.take(x, np.argsort(balanced_order(x.shape[1], shards)), axis=1)


def context_attention(
    q: Float[Array, "b t h e"],
    k: Float[Array, "b t k e"],
    v: Float[Array, "b t k f"],
    key_mask: Bool[Array, "b t"] | None,
    sharding: ActivationSharding,
    *,
    block_size: int,
    segment_ids: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t h f"]:
    """Causal attention of rows in the load-balanced order, their sequence split over the mesh axes `sharding`
    gives `axes.SEQ` (see the module docstring). `key_mask` marks real tokens; `segment_ids` (packed rows) limit
    each query to keys of its own segment. Equal to the blockwise kernel on the rows in row order."""
    mesh_axes = sharding.mesh_axes(axes.SEQ)
    shards = sharding.shards(axes.SEQ)
    b, t, h, e = q.shape
    chunk = t // (2 * shards)
    inverse = np.argsort(balanced_order(t, shards))
    block = min(block_size, chunk)
    if chunk % block:
        raise ValueError(f"context parallelism: chunks of {chunk} tokens ({t} over {2 * shards}) are not a multiple of "
                         f"the attention block {block_size}; pick a row length that is a multiple of "
                         f"{2 * shards * block_size}")
    key_mask = jnp.ones((b, t), bool) if key_mask is None else key_mask
    segment_ids = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    def local(q, k, v, key_mask, segments):
        def gathered(x):  # the whole row, in row order
            return jnp.take(jax.lax.all_gather(x, mesh_axes, axis=1, tiled=True), inverse, axis=1)

        index = jax.lax.axis_index(mesh_axes)
        starts = jnp.stack([index, 2 * shards - 1 - index]) * chunk  # row index of the two local chunks
        return _chunked_attention(q, gathered(k), gathered(v), gathered(key_mask), segments, gathered(segments),
                                  starts, block)

    q_spec = sharding.spec((axes.BATCH, axes.SEQ, axes.HEADS, None), q.shape)
    kv_spec = sharding.spec((axes.BATCH, axes.SEQ, axes.KV_HEADS, None), k.shape)
    row_spec = sharding.spec((axes.BATCH, axes.SEQ), (b, t))
    return jax.shard_map(local, mesh=sharding.mesh, in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, key_mask, segment_ids)


def _chunked_attention(q, k, v, key_valid, q_segments, k_segments, starts, block: int):
    """Flash attention of local queries q [b, 2m, h, e] (two chunks starting at row indices `starts`) against a
    whole row's keys k, v [b, t, k, e] in row order."""
    b, local_t, h, e = q.shape
    t, kv = k.shape[1], k.shape[2]
    g, nq, nk = h // kv, local_t // block, t // block
    per_chunk = nq // 2
    # block layouts: q [nq, b, k, g, B, e]; k, v [nk, b, k, B, e]; masks [n, b, B]; query block starts [nq]
    qb = (q / math.sqrt(e)).reshape(b, nq, block, kv, g, e).transpose(1, 0, 3, 4, 2, 5)
    kb = k.astype(q.dtype).reshape(b, nk, block, kv, e).transpose(1, 0, 3, 2, 4)
    vb = v.astype(q.dtype).reshape(b, nk, block, kv, -1).transpose(1, 0, 3, 2, 4)
    blocks = lambda x: x.reshape(b, -1, block).swapaxes(0, 1)  # noqa: E731
    q_starts = jnp.repeat(starts, per_chunk) + jnp.tile(jnp.arange(per_chunk) * block, 2)
    out = _flash(qb, kb, vb, blocks(key_valid), blocks(q_segments), blocks(k_segments), q_starts.astype(jnp.int32))
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, local_t, h, -1)


def _block_mask(q_start, j, valid_j, q_segments_i, k_segments_j, block: int):
    """[b, 1, 1, B, B]: key j*B + c visible from the query at row q_start + r (causal, real, same segment)."""
    rows = q_start + jnp.arange(block)
    columns = j * block + jnp.arange(block)
    causal = (columns[None, :] <= rows[:, None])[None]
    same = q_segments_i[:, :, None] == k_segments_j[:, None, :]
    return (causal & same & valid_j[:, None, :])[:, None, None]


def _scores(qi, kj):
    return jnp.einsum("bkgqe,bkse->bkgqs", qi, kj, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _flash(qb, kb, vb, validb, q_segb, k_segb, q_starts):
    return _flash_forward(qb, kb, vb, validb, q_segb, k_segb, q_starts)[0]


def _flash_forward(qb, kb, vb, validb, q_segb, k_segb, q_starts):
    block = qb.shape[-2]

    def query_block(_, xs):
        qi, seg_i, start = xs

        def step(j, carry):  # online softmax over key block j
            m, l, acc = carry
            mask = _block_mask(start, j, validb[j], seg_i, k_segb[j], block)
            s = jnp.where(mask, _scores(qi, kb[j]), _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bkse->bkgqe", p.astype(qi.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

        shape = qi.shape[:-1]
        init = (jnp.full(shape, _NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, vb.shape[-1]), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, start // block + 1, step, init)  # key blocks at or before the query block
        safe = jnp.where(l > 0, l, 1.0)  # no visible key: out 0, lse -1e30 (so the recomputed p is 0 too)
        return None, (acc / safe[..., None], m + jnp.log(safe))

    _, (out, lse) = jax.lax.scan(query_block, None, (qb, q_segb, q_starts))
    out = out.astype(qb.dtype)
    return out, (qb, kb, vb, validb, q_segb, k_segb, q_starts, out, lse)


def _flash_backward(residuals, d_out):
    qb, kb, vb, validb, q_segb, k_segb, q_starts, out, lse = residuals
    block = qb.shape[-2]
    d_out = d_out.astype(qb.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [nq b k g B]: do_i . out_i

    def query_block(carry, xs):
        qi, do_i, lse_i, delta_i, seg_i, start = xs

        def step(j, carry):  # query block i x key block j's terms of dq_i, dk_j, dv_j
            dk, dv, dq_i = carry
            kj, vj = kb[j], vb[j]
            mask = _block_mask(start, j, validb[j], seg_i, k_segb[j], block)
            p = jnp.where(mask, jnp.exp(_scores(qi, kj) - lse_i[..., None]), 0.0)
            dv_j = jnp.einsum("bkgqs,bkgqe->bkse", p.astype(qi.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqe,bkse->bkgqs", do_i, vj, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None])).astype(qi.dtype)
            dk_j = jnp.einsum("bkgqs,bkgqe->bkse", ds, qi, preferred_element_type=jnp.float32)
            dq_i = dq_i + jnp.einsum("bkgqs,bkse->bkgqe", ds, kj, preferred_element_type=jnp.float32)
            return dk.at[j].add(dk_j), dv.at[j].add(dv_j), dq_i  # in place inside the loop

        dk, dv = carry
        dk, dv, dq_i = jax.lax.fori_loop(0, start // block + 1, step, (dk, dv, jnp.zeros(qi.shape, jnp.float32)))
        return (dk, dv), dq_i

    zeros = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
    (dk, dv), dq = jax.lax.scan(query_block, zeros, (qb, d_out, lse, delta, q_segb, q_starts))
    none = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731  (masks, segments, starts: not differentiable)
    return (dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), none(validb), none(q_segb), none(k_segb),
            none(q_starts))


_flash.defvjp(_flash_forward, _flash_backward)
