"""Blockwise (flash) attention == dense attention, values and gradients; kernel choice validated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.attention import blockwise_attention, causal_attention, cudnn_attention
from rpegjax.options import AttentionKind

TOLERANCE = 1e-5  # float32, one attention


def _problem(t: int, heads: int = 4, kv_heads: int = 2, e: int = 8, seed: int = 0, f: int | None = None):
    """q, k [3, t, h|k, e], v [3, t, k, f] (f = e unless given), a mask, output weights, the queries that see a key."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (3, t, heads, e))
    k = jax.random.normal(keys[1], (3, t, kv_heads, e))
    v = jax.random.normal(keys[2], (3, t, kv_heads, e if f is None else f))
    # row 0 full, row 1 right-padded, row 2 left-padded and with a hole
    mask = np.ones((3, t), bool)
    mask[1, t - 4:] = False
    mask[2, :3] = False
    mask[2, t // 2] = False
    # queries with at least one visible key (the kernels may differ elsewhere: see the module docstring)
    visible = np.cumsum(mask, axis=1) > 0
    weights = jax.random.normal(keys[3], (*q.shape[:3], v.shape[-1])) * visible[:, :, None, None]
    return q, k, v, jnp.asarray(mask), weights, visible


@pytest.mark.parametrize("t, block, heads, kv_heads, f", [
    (13, 4, 4, 2, None),  # padded last block, GQA
    (16, 4, 4, 4, None),  # exact blocks, multi-head
    (24, 5, 6, 1, None),  # padded last block, multi-query
    (16, 16, 4, 2, None),  # one block (no loops)
    (7, 32, 4, 2, None),  # block longer than the sequence
    (13, 4, 4, 4, 6),  # values of their own head dim (latent attention's 128 beside 192)
    (16, 16, 4, 4, 5),  # ... in one block
])
def test_blockwise_matches_dense_values_and_gradients(t, block, heads, kv_heads, f):
    q, k, v, mask, weights, visible = _problem(t, heads, kv_heads, f=f)

    def loss(kernel, q, k, v):
        return jnp.sum(kernel(q, k, v, mask) * weights)

    blockwise = lambda q, k, v, m: blockwise_attention(q, k, v, m, block_size=block)  # noqa: E731
    dense_out = causal_attention(q, k, v, mask)
    block_out = jax.jit(blockwise)(q, k, v, mask)
    np.testing.assert_allclose(block_out * visible[:, :, None, None], dense_out * visible[:, :, None, None],
                               atol=TOLERANCE)
    dense_grads = jax.grad(loss, argnums=(1, 2, 3))(causal_attention, q, k, v)
    block_grads = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)(blockwise, q, k, v)
    for name, ours, expected in zip("qkv", block_grads, dense_grads, strict=True):
        np.testing.assert_allclose(ours, expected, atol=TOLERANCE, err_msg=f"d{name}")


def test_dense_with_value_head_dim_of_its_own_equals_numpy():
    q, k, v, mask, _, visible = _problem(11, 4, 2, f=5)
    qn, kn, vn = (np.repeat(np.asarray(x, np.float64), 4 // x.shape[2], axis=2) for x in (q, k, v))
    scores = np.einsum("bqhe,bkhe->bhqk", qn, kn) / np.sqrt(8)
    allowed = np.tril(np.ones((11, 11), bool))[None, None] & np.asarray(mask)[:, None, None, :]
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bkhf->bqhf", probs / probs.sum(-1, keepdims=True), vn)
    out = causal_attention(q, k, v, mask)
    assert out.shape == (3, 11, 4, 5)
    np.testing.assert_allclose(np.asarray(out)[visible], expected[visible], atol=TOLERANCE)


def test_blockwise_without_mask_and_fully_masked_queries():
    q, k, v, _, _, _ = _problem(12)
    np.testing.assert_allclose(blockwise_attention(q, k, v, None, block_size=5), causal_attention(q, k, v, None),
                               atol=TOLERANCE)
    # a query with no visible key (left padding) gets 0 and passes no gradient back
    mask = jnp.arange(12)[None, :] >= 4
    mask = jnp.broadcast_to(mask, (3, 12))
    out, grad_fn = jax.vjp(lambda q: blockwise_attention(q, k, v, mask, block_size=5), q)
    np.testing.assert_array_equal(out[:, :4], 0.0)
    (dq,) = grad_fn(jnp.ones_like(out))
    np.testing.assert_array_equal(dq[:, :4], 0.0)
    assert np.isfinite(np.asarray(dq)).all()


def test_blockwise_bfloat16_tracks_float32():
    q, k, v, mask, _, visible = _problem(20)
    f32 = causal_attention(q, k, v, mask)
    bf16 = blockwise_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, block_size=8)
    assert bf16.dtype == jnp.bfloat16
    difference = jnp.abs(bf16.astype(jnp.float32) - f32) * visible[:, :, None, None]
    assert float(difference.max()) < 0.05  # 8 mantissa bits, softmax weights <= 1, |v| ~ 1


def test_blockwise_backward_memory_is_linear_in_length():
    """Compiled temporaries of value_and_grad grow ~linearly (dense: quadratically) with the sequence."""

    def temporaries(kernel, t):
        shape = jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
        mask = jax.ShapeDtypeStruct((1, t), jnp.bool_)
        grad = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(kernel(q, k, v, m) ** 2), argnums=(0, 1, 2)))
        return grad.lower(shape, kv, kv, mask).compile().memory_analysis().temp_size_in_bytes

    blockwise = lambda q, k, v, m: blockwise_attention(q, k, v, m, block_size=128)  # noqa: E731
    ratio = temporaries(blockwise, 4096) / temporaries(blockwise, 1024)
    assert ratio < 4.5, ratio  # 4x the tokens
    dense_ratio = temporaries(causal_attention, 4096) / temporaries(causal_attention, 1024)
    assert dense_ratio > 10, dense_ratio  # the check can fail: the [t, t] scores are quadratic


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama"])
def test_decoder_with_blockwise_attention_matches_dense(architecture):
    cfg = ModelConfig.tiny(architecture)
    tokens = jax.random.randint(jax.random.key(1), (3, 19), 0, cfg.vocab_size)
    mask = jnp.arange(19)[None, :] < jnp.array([19, 12, 7])[:, None]  # right padding, the TrainBatch layout
    dense = Decoder(cfg, rngs=nnx.Rngs(0))
    blockwise = Decoder(cfg.replace(attention="blockwise", attention_block_size=8), rngs=nnx.Rngs(0))

    def loss(model):
        logits = model(tokens, mask=mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)

    dense_loss, dense_grads = nnx.value_and_grad(loss)(dense)
    block_loss, block_grads = nnx.value_and_grad(loss)(blockwise)
    np.testing.assert_allclose(block_loss, dense_loss, rtol=1e-5)
    for (path, ours), (_, expected) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(block_grads)),
                                           jax.tree_util.tree_leaves_with_path(nnx.state(dense_grads)), strict=True):
        # composite (two layers, head, log-softmax): 1e-5 of the gradient's scale
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(ours, expected, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_attention_kind_is_validated():
    with pytest.raises(ValueError, match=r"ModelConfig.attention must be one of .* got 'flash'"):
        ModelConfig.tiny(attention="flash")
    with pytest.raises(ValueError, match=r"ModelConfig.attention_block_size must be a positive integer, got 0"):
        ModelConfig.tiny(attention_block_size=0)
    assert ModelConfig.tiny(attention="blockwise").attention is AttentionKind.BLOCKWISE


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error raised off GPU")
def test_cudnn_off_gpu_is_an_error_not_a_fallback():
    q, k, v, mask, _, _ = _problem(8)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        cudnn_attention(q.astype(jnp.bfloat16), k, v, mask)


@pytest.mark.gpu
def test_cudnn_matches_dense_on_right_padded_rows():
    q, k, v, _, _, _ = _problem(64, e=64)
    mask = jnp.arange(64)[None, :] < jnp.array([64, 40, 9])[:, None]
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    real = np.asarray(mask)[:, :, None, None]
    expected = causal_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask)
    ours = cudnn_attention(q, k, v, mask).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(ours - expected) * real)) < 0.05


def test_sharded_blockwise_scanned_gradient_equals_unsharded_dense():
    """fsdp=4 x tensor=2 (heads split over tensor): blockwise attention, scanned layers and full remat give the
    unsharded dense model's log-prob gradient."""
    from rpegjax.learners.scoring import sequence_logprobs
    from rpegjax.sharding import ShardingRules, make_mesh
    from rpegjax.sharding.rules import ActivationSharding, param_shardings

    cfg = ModelConfig.tiny()
    tokens = jax.random.randint(jax.random.key(2), (4, 21), 0, cfg.vocab_size)
    mask = jnp.arange(21)[None, :] < jnp.array([21, 15, 9, 18])[:, None]
    dense = Decoder(cfg, rngs=nnx.Rngs(0))
    fast = dense.with_execution(attention="blockwise", attention_block_size=8, remat="full", scan_layers=True)

    def loss_fn(graphdef, sharding):
        return lambda state: jnp.sum(sequence_logprobs(nnx.merge(graphdef, state), tokens, mask, sharding=sharding))

    graphdef, state = nnx.split(dense)
    expected_loss, expected = jax.jit(jax.value_and_grad(loss_fn(graphdef, None)))(state)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    rules = ShardingRules.fsdp_tp()
    graphdef, state = nnx.split(fast)
    shardings = param_shardings(state, mesh, rules)
    grad = jax.jit(jax.value_and_grad(loss_fn(graphdef, ActivationSharding(mesh, rules))), in_shardings=(shardings,))
    loss, grads = grad(jax.device_put(state, shardings))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for (path, ours), reference in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True):
        scale = max(1.0, float(np.abs(reference).max()))
        np.testing.assert_allclose(ours, reference, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _packed_rows(t: int) -> np.ndarray:
    """Segment ids of two packed rows of t >= 23 columns: segments of 5, 9, 6 then padding; 11, 1, 9 then padding."""
    segments = np.zeros((2, t), np.int32)
    segments[0, :5], segments[0, 5:14], segments[0, 14:20] = 1, 2, 3
    segments[1, :11], segments[1, 11:12], segments[1, 12:21] = 1, 2, 3
    return segments


@pytest.mark.parametrize("block", [4, 5, 8, 32])
def test_packed_segments_attend_as_each_sequence_alone(block):
    """Blockwise (skipping other segments' key blocks) and dense, values and gradients, against each segment's
    sequence computed on its own."""
    t = 23
    q, k, v, _, _, _ = _problem(t)
    q, k, v = q[:2], k[:2], v[:2]
    segments = jnp.asarray(_packed_rows(t))
    real = segments > 0
    weights = jax.random.normal(jax.random.key(5), q.shape) * real[:, :, None, None]

    def alone(q, k, v):  # each segment as its own unpadded sequence, laid back where it sits
        out = jnp.zeros_like(q)
        for row, bounds in ((0, [(0, 5), (5, 14), (14, 20)]), (1, [(0, 11), (11, 12), (12, 21)])):
            for start, end in bounds:
                piece = causal_attention(*(x[row:row + 1, start:end] for x in (q, k, v)), None)
                out = out.at[row:row + 1, start:end].set(piece)
        return out

    kernels = {"dense": lambda q, k, v: causal_attention(q, k, v, real, segments),
               "blockwise": lambda q, k, v: blockwise_attention(q, k, v, real, segments, block_size=block)}
    expected = jax.jit(alone)(q, k, v)
    expected_grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(alone(q, k, v) * weights), argnums=(0, 1, 2)))(q, k, v)
    for name, kernel in kernels.items():
        np.testing.assert_allclose(jax.jit(kernel)(q, k, v) * real[:, :, None, None], expected, atol=TOLERANCE,
                                   err_msg=name)
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(kernel(q, k, v) * weights), argnums=(0, 1, 2)))(q, k, v)
        for axis, ours, theirs in zip("qkv", grads, expected_grads, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, err_msg=f"{name} d{axis}")


def test_packed_positions_restart_per_segment_and_cudnn_refuses_segments():
    from rpegjax.models.transformer import packed_positions

    positions = np.asarray(packed_positions(jnp.asarray(_packed_rows(23))))
    np.testing.assert_array_equal(positions[0, :16], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1])
    np.testing.assert_array_equal(positions[1, 10:14], [10, 0, 0, 1])
    q, k, v, mask, _, _ = _problem(8)
    with pytest.raises(ValueError, match="cannot mask packed sequences"):
        cudnn_attention(q.astype(jnp.bfloat16), k, v, mask, jnp.ones((3, 8), jnp.int32))
