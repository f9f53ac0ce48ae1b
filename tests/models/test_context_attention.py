"""Context parallelism (`rpegjax.models.context_attention`): one row's sequence over the context axis equals one
device, for the attention kernel (with segment ids), the log-probs and the gradients of a model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.learners.scoring import sequence_logprobs
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.attention import blockwise_attention
from rpegjax.models.context_attention import balanced_order, context_attention, from_balanced, to_balanced
from rpegjax.sharding import ShardingRules, make_mesh
from rpegjax.sharding.rules import ActivationSharding, param_shardings


def test_balanced_order_gives_device_i_chunks_i_and_its_mirror():
    order = balanced_order(16, 4)  # 8 chunks of 2 tokens; device i holds 4 tokens
    parts = order.reshape(4, 2, 2)[:, :, 0] // 2  # chunk ids per device
    np.testing.assert_array_equal(parts, [[0, 7], [1, 6], [2, 5], [3, 4]])
    x = jnp.arange(32).reshape(2, 16)
    np.testing.assert_array_equal(from_balanced(to_balanced(x, 4), 4), x)
    with pytest.raises(ValueError, match="8 equal chunks"):
        balanced_order(20, 4)


def _segment_reference(q, k, v, mask, segments):
    """Dense causal attention in numpy with key mask and segment ids (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, e = q.shape
    k, v = np.repeat(k, h // k.shape[2], axis=2), np.repeat(v, h // v.shape[2], axis=2)
    scores = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(e)
    visible = np.tril(np.ones((t, t), bool))[None] & mask[:, None, :] & (segments[:, :, None] == segments[:, None, :])
    scores = np.where(visible[:, None], scores, -1e30)  # a query with no visible key: padding, not compared
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhe->bqhe", probs, v)


@pytest.mark.parametrize("axis_sizes, f", [({"data": 2, "context": 4}, 8), ({"context": 4, "tensor": 2}, 8),
                                           ({"context": 8}, 8), ({"data": 2, "context": 4}, 6)])
def test_context_attention_equals_one_device(axis_sizes, f):
    """Output and gradients of the kernel on rows in the balanced order equal blockwise attention on one device;
    segment ids (packed rows) equal a numpy reference that masks across segments. `f`: the values' head dim (6:
    their own, as latent attention's)."""
    sharding = ActivationSharding(make_mesh(axis_sizes), ShardingRules.fsdp_tp())
    shards = sharding.shards("seq")
    rng = np.random.default_rng(0)
    b, t, h, kv, e = 2, 64, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(b, t, h, e), (b, t, kv, e), (b, t, kv, f)])
    mask = jnp.arange(t)[None] < jnp.array([t, 41])[:, None]
    weights = jnp.asarray(rng.normal(size=(b, t, h, f)), jnp.float32) * mask[:, :, None, None]

    def sharded(q, k, v, segments=None):
        balanced = [to_balanced(x, shards) for x in (q, k, v, mask)]
        seg = None if segments is None else to_balanced(segments, shards)
        return from_balanced(context_attention(*balanced, sharding, block_size=4, segment_ids=seg), shards)

    def loss(attention):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v) * weights), argnums=(0, 1, 2)))

    (value, grads) = loss(sharded)(q, k, v)
    expected, expected_grads = loss(lambda q, k, v: blockwise_attention(q, k, v, mask, block_size=4))(q, k, v)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for ours, theirs in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    segments = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.1, axis=1), jnp.int32)  # packed rows of random lengths
    out = jax.jit(sharded)(q, k, v, segments)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[real], _segment_reference(q, k, v, real, np.asarray(segments))[real],
                               atol=1e-5)


def test_context_attention_refuses_chunks_the_block_does_not_divide():
    sharding = ActivationSharding(make_mesh({"data": 2, "context": 4}), ShardingRules.fsdp_tp())
    q = jnp.zeros((2, 48, 2, 4))  # chunks of 6 tokens, block 4
    with pytest.raises(ValueError, match="not a multiple of the attention block 4"):
        context_attention(q, q, q, None, sharding, block_size=4)


def _loss_and_grads(model, tokens, mask, sharding, mesh=None, rules=None):
    graphdef, state = nnx.split(model)

    def loss(state, tokens, mask):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, state), tokens, mask, chunk_size=4, sharding=sharding))

    if mesh is None:
        return jax.jit(jax.value_and_grad(loss))(state, tokens, mask)
    shardings = param_shardings(state, mesh, rules)
    step = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, None, None))
    return step(jax.device_put(state, shardings), tokens, mask)


@pytest.mark.slow
@pytest.mark.parametrize("axis_sizes,sequence_parallel", [({"data": 2, "context": 4}, False),
                                                           ({"fsdp": 2, "context": 2, "tensor": 2}, True)])
def test_context_parallel_model_equals_one_device(axis_sizes, sequence_parallel):
    """A row's sequence over the context axis, composed with data / fsdp / tensor (and sequence parallelism):
    the summed log-probs and every parameter's gradient equal one device's; blockwise attention, scanned layers and
    full remat against the dense unrolled model. Rows are padded (key mask) and the tokens are jit arguments."""
    cfg = ModelConfig.tiny()
    tokens = jax.random.randint(jax.random.key(2), (4, 64), 0, cfg.vocab_size)
    mask = jnp.arange(64)[None, :] < jnp.array([64, 58, 32, 61])[:, None]
    dense = Decoder(cfg, rngs=nnx.Rngs(0))
    expected_loss, expected = _loss_and_grads(dense, tokens, mask, None)
    mesh, rules = make_mesh(axis_sizes), ShardingRules.fsdp_tp(sequence_parallel=sequence_parallel)
    fast = dense.with_execution(attention="blockwise", attention_block_size=4, remat="full", scan_layers=True)
    loss, grads = _loss_and_grads(fast, tokens, mask, ActivationSharding(mesh, rules), mesh, rules)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for (path, ours), reference in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True):
        scale = max(1.0, float(np.abs(reference).max()))
        np.testing.assert_allclose(ours, reference, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_context_parallel_logprobs_equal_one_device():
    """The log-prob pass (per token, not summed) with one row's sequence over 8 devices."""
    cfg = ModelConfig.tiny()
    tokens = jax.random.randint(jax.random.key(3), (2, 64), 0, cfg.vocab_size)
    mask = jnp.arange(64)[None, :] < jnp.array([64, 45])[:, None]
    model = Decoder(cfg, rngs=nnx.Rngs(1)).with_execution(attention="blockwise", attention_block_size=4)
    expected = sequence_logprobs(model, tokens, mask, chunk_size=4)
    sharding = ActivationSharding(make_mesh({"context": 8}), ShardingRules.fsdp_tp())
    graphdef, state = nnx.split(model)
    ours = jax.jit(lambda state, tokens, mask: sequence_logprobs(nnx.merge(graphdef, state), tokens, mask, chunk_size=4,
                                                                 sharding=sharding))(state, tokens, mask)
    np.testing.assert_allclose(ours, expected, atol=1e-5)
