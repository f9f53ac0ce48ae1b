"""Full-sequence causal attention kernels: dense, blockwise (flash-attention in plain JAX) and cuDNN.

All take q and k [b, t, h|k, e], v [b, t, k, f] (h a multiple of k: grouped-query attention; values may have their
own head dim f, as DeepSeek's latent attention's 128 beside 192 for queries and keys) and a `key_mask` [b, t] of
real tokens; query i attends to keys j <= i with key_mask[j]. They agree on every
query that has at least one such key. A query with none (a left-padding position before a row's first
real token) is padding whose output nothing reads: dense averages all values there, blockwise returns 0.

Packed rows (several sequences in one row, `rpegjax.learners.packing`) pass `segment_ids` [b, t]: query i
then attends only to keys j <= i of its own segment (segment_ids[j] == segment_ids[i]), each segment's
tokens contiguous. The blockwise kernel also skips the key blocks that lie wholly before every query's
segment in a query block, so a packed row costs about the sum of its segments' squares, not its length's.

    out_i = sum_j softmax_j(q_i . k_j / sqrt(e)) v_j,   softmax in float32,   out [b, t, h, f].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.config import JAX_DTYPES
from rpegjax.options import AttentionKind

_NEG_INF = -1e30


def causal_attention(
    q: Float[Array, "b t h e"],
    k: Float[Array, "b t k e"],
    v: Float[Array, "b t k f"],
    key_mask: Bool[Array, "b t"] | None,
    segment_ids: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t h f"]:
    """Dense attention: materialises the [b, h, t, t] float32 scores (fastest for short sequences).

    Queries are laid out [b, k, g t, e] (the g heads sharing a KV head stacked along time), so each
    product is one batched GEMM over b k with the transposes done once, and 1/sqrt(e) scales q (smaller
    than the scores) inside that transpose.
    """
    b, t, h, e = q.shape
    kv = k.shape[2]
    g = h // kv
    index = jnp.arange(t)
    valid = (index[None, :] <= index[:, None])[None]  # 1 t s
    if key_mask is not None:
        valid = valid & key_mask[:, None, :]
    if segment_ids is not None:
        valid = valid & (segment_ids[:, :, None] == segment_ids[:, None, :])
    qg = (q / math.sqrt(e)).reshape(b, t, kv, g, e).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, e)
    keys, values = k.astype(q.dtype).transpose(0, 2, 1, 3), v.astype(q.dtype).transpose(0, 2, 1, 3)  # b k s e
    scores = jnp.einsum("bkqe,bkse->bkqs", qg, keys).astype(jnp.float32).reshape(b, kv, g, t, t)
    scores = jnp.where(valid[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, kv, g * t, t)
    out = jnp.einsum("bkqs,bkse->bkqe", probs, values)
    return out.reshape(b, kv, g, t, -1).transpose(0, 3, 1, 2, 4).reshape(b, t, h, -1)


def blockwise_attention(
    q: Float[Array, "b t h e"],
    k: Float[Array, "b t k e"],
    v: Float[Array, "b t k f"],
    key_mask: Bool[Array, "b t"] | None,
    segment_ids: Int[Array, "b t"] | None = None,
    *,
    block_size: int,
) -> Float[Array, "b t h f"]:
    """Flash attention in plain JAX: O(t · block) memory forward and backward.

    The sequence is cut into n = ceil(t / block) blocks. Each query block runs an online softmax over
    the key blocks at or before it (blocks above the diagonal are skipped, not masked):
        m' = max(m, max_j s_ij),  l' = e^(m - m') l + sum_j e^(s_ij - m'),  acc' = e^(m - m') acc + sum_j e^(s_ij - m') v_j
    and keeps only out = acc / l and the log-sum-exp m + log l per query. The backward (FlashAttention-2)
    recomputes each block's probabilities p_ij = e^(s_ij - lse_i) from them:
        dv_j = sum_i p_ij do_i,  ds_ij = p_ij (do_i . v_j - do_i . out_i),  dq_i = sum_j ds_ij k_j,  dk_j = sum_i ds_ij q_i.
    Scores, probabilities and accumulators are float32; matmul inputs stay in q's dtype.
    With `segment_ids`, query block i starts at the key block of its earliest query's segment start (blocks
    before it hold only other segments' keys), and the backward's key block j stops at the last query block
    that starts at or before it.
    """
    b, t, h, e = q.shape
    kv = k.shape[2]
    g = h // kv
    block = min(block_size, t)
    n = -(-t // block)
    pad = n * block - t
    valid = jnp.ones((b, t), bool) if key_mask is None else key_mask
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))  # padded keys are never attended to
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
    # block layouts: q [n, b, k, g, B, e]; k [n, b, k, B, e]; v [n, b, k, B, f]; valid [n, b, B]
    qb = (q / math.sqrt(e)).reshape(b, n, block, kv, g, e).transpose(1, 0, 3, 4, 2, 5)
    kb = k.astype(q.dtype).reshape(b, n, block, kv, e).transpose(1, 0, 3, 2, 4)
    vb = v.astype(q.dtype).reshape(b, n, block, kv, -1).transpose(1, 0, 3, 2, 4)
    validb = valid.reshape(b, n, block).swapaxes(0, 1)
    segments = None
    if segment_ids is not None:
        segmentb = jnp.asarray(segment_ids, jnp.int32).reshape(b, n, block).swapaxes(0, 1)
        first = (segment_starts(segment_ids).reshape(b, n, block) // block).min(axis=(0, 2))  # [n], nondecreasing
        segments = (segmentb, first.astype(jnp.int32))
    out = _flash(qb, kb, vb, validb, segments)
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * block, h, -1)[:, :t]


def cudnn_attention(
    q: Float[Array, "b t h e"],
    k: Float[Array, "b t k e"],
    v: Float[Array, "b t k f"],
    key_mask: Bool[Array, "b t"] | None,
    segment_ids: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t h f"]:
    """cuDNN's fused flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`).

    cuDNN takes key lengths, not a mask: rows must be left-aligned (real tokens first, padding after,
    the `TrainBatch` layout), where a causal query at a real token never reaches the padding anyway.
    Needs a CUDA GPU and bfloat16/float16 inputs; anything else raises instead of falling back. Packed rows
    (`segment_ids`) are refused: jax 0.10's `jax.nn.dot_product_attention` takes one length per row, no segments.
    """
    if segment_ids is not None:
        raise ValueError(f"ModelConfig.attention={AttentionKind.CUDNN.value!r} cannot mask packed sequences (segment ids): "
                         f"jax.nn.dot_product_attention takes one key length per row; use "
                         f"{AttentionKind.BLOCKWISE.value!r} with packing")
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"ModelConfig.attention={AttentionKind.CUDNN.value!r} needs a CUDA GPU; the JAX backend is {backend!r}"
                         f" (use {AttentionKind.BLOCKWISE.value!r})")
    if q.dtype not in [JAX_DTYPES[dtype] for dtype in AttentionKind.CUDNN.compute_dtypes]:
        raise ValueError(f"ModelConfig.attention={AttentionKind.CUDNN.value!r} needs dtype "
                         f"{' or '.join(AttentionKind.CUDNN.compute_dtypes)}, got {q.dtype}")
    lengths = None if key_mask is None else key_mask.sum(axis=-1).astype(jnp.int32)
    e, f = q.shape[-1], v.shape[-1]
    if f > e:
        raise ValueError(f"ModelConfig.attention={AttentionKind.CUDNN.value!r}: value head dim {f} exceeds the query "
                         f"head dim {e}; use {AttentionKind.BLOCKWISE.value!r}")
    # jax.nn.dot_product_attention wants one head dim: zero value dims add nothing to the output's first f dims
    values = jnp.pad(v.astype(q.dtype), ((0, 0), (0, 0), (0, 0), (0, e - f))) if f < e else v.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), values, is_causal=True,
                                        key_value_seq_lengths=lengths, implementation="cudnn")[..., :f]


def attend(kind: AttentionKind, block_size: int, q, k, v, key_mask, segment_ids=None) -> Float[Array, "b t h f"]:
    """Dispatches to the kernel `kind` names (ModelConfig.attention)."""
    if kind is AttentionKind.BLOCKWISE:
        return blockwise_attention(q, k, v, key_mask, segment_ids, block_size=block_size)
    return _KERNELS[kind](q, k, v, key_mask, segment_ids)


def segment_starts(segment_ids: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """The index of the first token of each token's segment (segments are contiguous runs of one id)."""
    index = jnp.arange(segment_ids.shape[1])
    boundary = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                               axis=1)
    return jax.lax.cummax(jnp.where(boundary, index[None, :], 0), axis=1)


_KERNELS = {AttentionKind.DENSE: causal_attention, AttentionKind.CUDNN: cudnn_attention}


# ---- the blockwise kernel -----------------------------------------------------------------------
# qi [b, k, g, B, e] (pre-scaled), kj [b, k, B, e], vj [b, k, B, f], valid_j [b, B]; i, j block indices.
# segments: None, or (segment ids [n, b, B], first key block of each query block [n]).


def _block_mask(i, j, valid_j, block: int, segments=None):
    """[b, 1, 1, B, B]: key j*B + c visible from query i*B + r (causal, a real key, and the same segment)."""
    rows = i * block + jnp.arange(block)
    columns = j * block + jnp.arange(block)
    mask = (columns[None, :] <= rows[:, None])[None, None, None] & valid_j[:, None, None, None, :]
    if segments is None:
        return mask
    ids = segments[0]
    return mask & (ids[i][:, :, None] == ids[j][:, None, :])[:, None, None]


def _block_scores(qi, kj):
    return jnp.einsum("bkgqe,bkse->bkgqs", qi, kj, preferred_element_type=jnp.float32)


def _forward_query_block(i, qi, kb, vb, validb, segments, first: int | Array, last: int | Array):
    """Online softmax of query block i over key blocks first..last-1: (out [b k g B f], lse [b k g B]) float32."""
    block = qi.shape[-2]

    def step(j, carry):
        m, l, acc = carry
        mask = _block_mask(i, j, validb[j], block, segments)
        s = jnp.where(mask, _block_scores(qi, kb[j]), _NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # masked keys add exactly nothing
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("bkgqs,bkse->bkgqe", p.astype(qi.dtype), vb[j], preferred_element_type=jnp.float32)
        return m_new, l, alpha[..., None] * acc + pv

    shape = qi.shape[:-1]
    init = (jnp.full(shape, _NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, vb.shape[-1]), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, step, init) if isinstance(last, jax.Array) else _unrolled(step, first, last, init)
    safe = jnp.where(l > 0, l, 1.0)  # no real key: out 0, lse -1e30 (so recomputed p is 0 too)
    return acc / safe[..., None], m + jnp.log(safe)


def _unrolled(step, first: int, last: int, carry):
    for j in range(first, last):
        carry = step(j, carry)
    return carry


@jax.custom_vjp
def _flash(qb, kb, vb, validb, segments):
    return _flash_forward(qb, kb, vb, validb, segments)[0]


def _flash_forward(qb, kb, vb, validb, segments):
    n = qb.shape[0]
    if n == 1:  # one block: no loops (their carries cost more than they save)
        out, lse = _forward_query_block(0, qb[0], kb, vb, validb, segments, 0, 1)
        out, lse = out[None], lse[None]
    else:
        def query_block(_, xs):
            i, qi = xs
            first = 0 if segments is None else segments[1][i]
            return None, _forward_query_block(i, qi, kb, vb, validb, segments, first, i + 1)

        _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(n), qb))
    out = out.astype(qb.dtype)
    return out, (qb, kb, vb, validb, segments, out, lse)


def _flash_backward(residuals, d_out):
    qb, kb, vb, validb, segments, out, lse = residuals
    n, block = qb.shape[0], qb.shape[-2]
    d_out = d_out.astype(qb.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [n b k g B]: do_i . out_i

    def pair(i, j, kj, vj, dk, dv, dq_i):
        """Adds query block i x key block j's terms to dk_j, dv_j and dq_i."""
        qi, do_i = qb[i], d_out[i]
        mask = _block_mask(i, j, validb[j], block, segments)
        p = jnp.where(mask, jnp.exp(_block_scores(qi, kj) - lse[i][..., None]), 0.0)
        dv = dv + jnp.einsum("bkgqs,bkgqe->bkse", p.astype(qi.dtype), do_i, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgqe,bkse->bkgqs", do_i, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[i][..., None])).astype(qi.dtype)
        dk = dk + jnp.einsum("bkgqs,bkgqe->bkse", ds, qi, preferred_element_type=jnp.float32)
        dq_i = dq_i + jnp.einsum("bkgqs,bkse->bkgqe", ds, kj, preferred_element_type=jnp.float32)
        return dk, dv, dq_i

    zeros_k, zeros_v = jnp.zeros(kb.shape[1:], jnp.float32), jnp.zeros(vb.shape[1:], jnp.float32)
    if n == 1:
        dk, dv, dq = pair(0, 0, kb[0], vb[0], zeros_k, zeros_v, jnp.zeros(qb.shape[1:], jnp.float32))
        dq, dk, dv = dq[None], dk[None], dv[None]
    else:
        def key_block(dq, xs):
            j, kj, vj = xs

            def query_block(i, carry):
                dk, dv, dq = carry
                dk, dv, dq_i = pair(i, j, kj, vj, dk, dv, dq[i])
                return dk, dv, dq.at[i].set(dq_i)  # in place inside the loop

            # query blocks past `last` start after key block j (first blocks are nondecreasing): nothing to add
            last = n if segments is None else jnp.sum(segments[1] <= j)
            dk, dv, dq = jax.lax.fori_loop(j, last, query_block, (zeros_k, zeros_v, dq))
            return dq, (dk, dv)

        dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32), (jnp.arange(n), kb, vb))
    no_segments = None if segments is None else tuple(np.zeros(x.shape, jax.dtypes.float0) for x in segments)
    return (dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), np.zeros(validb.shape, jax.dtypes.float0),
            no_segments)


_flash.defvjp(_flash_forward, _flash_backward)
