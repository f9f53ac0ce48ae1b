"""`gathered_matmul` (FSDP's gather, again in the backward): the same values and gradients as autodiff of the plain
matmul and as the unsharded model, and the layer scan without remat no longer keeps every layer's gathered kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.gathered_matmul import gathered_matmul
from rpegjax.models.lora import LoRAConfig, LoRAParam
from rpegjax.sharding import ShardingRules, axes, make_mesh
from rpegjax.sharding.rules import ActivationSharding, logical_to_spec
from test_sequence_parallel import _step

Q_AXES = (axes.EMBED, axes.HEADS, axes.HEAD_DIM)
O_AXES = (axes.HEADS, axes.HEAD_DIM, axes.EMBED)


@pytest.mark.parametrize("logical, shape", [(Q_AXES, (32, 4, 8)), (O_AXES, (4, 8, 32))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_matmul_equals_autodiff_of_the_plain_matmul(logical, shape, dtype):
    """fsdp4 x tensor2, q-like [d, h, e] and o-like [h, e, d] float32 kernels, computed in `dtype`: the value, dx and
    dW equal jax.grad of x @ cast(W) on one device; dW comes back in W's dtype and split as W is."""
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    sharding = ActivationSharding(mesh, ShardingRules.fsdp_tp())
    inputs = int(np.prod(shape[:-1])) if logical == O_AXES else shape[0]
    w = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (16, inputs), jnp.float32).astype(dtype)
    probe = jax.random.normal(jax.random.key(2), (16, w.size // inputs), jnp.float32)

    def plain(x, w):
        return jnp.sum((x @ w.astype(dtype).reshape(inputs, -1)).astype(jnp.float32) * probe)

    def ours(x, w):
        return jnp.sum(gathered_matmul(x, w, dtype, sharding, logical, "kernel").astype(jnp.float32) * probe)

    expected, (dx_expected, dw_expected) = jax.value_and_grad(plain, argnums=(0, 1))(x, w)
    w_sharded = jax.device_put(w, NamedSharding(mesh, logical_to_spec(logical, sharding.rules.params, mesh, shape)))
    value, (dx, dw) = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(x, w_sharded)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(value, expected, rtol=tolerance)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_expected, np.float32), rtol=tolerance,
                               atol=tolerance)
    np.testing.assert_allclose(dw, dw_expected, rtol=tolerance, atol=tolerance)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert dw.sharding.is_equivalent_to(w_sharded.sharding, w.ndim), (dw.sharding, w_sharded.sharding)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, scan, lora", [({"fsdp": 8}, True, False), ({"fsdp": 8}, False, False),
                                                    ({"fsdp": 4, "tensor": 2}, True, False),
                                                    ({"fsdp": 4, "tensor": 2}, False, False),
                                                    ({"fsdp": 4, "tensor": 2}, True, True)])
def test_remat_none_gradients_equal_the_unsharded_models(mesh_shape, scan, lora):
    """Remat none, scanned (the gather again in the backward) and unrolled layers, and LoRA adapters on every
    projection (the adapter term beside the gathered matmul): loss and gradients on 8 devices equal the unsharded
    model's (float32, 1e-5)."""
    cfg = ModelConfig.tiny()
    tokens = jax.random.randint(jax.random.key(2), (8, 16), 0, cfg.vocab_size)
    mask = jnp.arange(16)[None, :] < jnp.array([16, 13, 8, 15, 16, 9, 12, 16])[:, None]
    dense = Decoder(cfg, rngs=nnx.Rngs(0))
    if lora:
        dense = dense.with_lora(LoRAConfig(rank=4, alpha=8.0), seed=1)
        adapters = nnx.state(dense, LoRAParam)  # random B (a trained adapter): the adapter term and its dx matter
        for index, (path, variable) in enumerate(nnx.to_flat_state(adapters)):
            if path[-1] == "b":
                variable.set_value(0.1 * jax.random.normal(jax.random.key(index), variable.get_value().shape))
        nnx.update(dense, adapters)
    step, state = _step(dense, None, None)
    expected_loss, expected = step(state, tokens, mask)
    model = dense.with_execution(remat="none", scan_layers=scan)
    step, state = _step(model, make_mesh(mesh_shape), ShardingRules.fsdp_tp())
    loss, grads = step(state, tokens, mask)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for (path, ours), reference in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True):
        scale = max(1.0, float(np.abs(reference).max()))
        np.testing.assert_allclose(ours, reference, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _update_temporaries(layers: int) -> int:
    cfg = ModelConfig.tiny(hidden_size=256, intermediate_size=512, num_layers=layers, num_heads=4, num_kv_heads=4,
                           head_dim=64)
    model = Decoder(cfg, rngs=nnx.Rngs(0)).with_execution(remat="none", scan_layers=True)
    step, state = _step(model, make_mesh({"fsdp": 8}), ShardingRules.fsdp_tp())
    tokens = jnp.zeros((8, 8), jnp.int32)
    return step.lower(state, tokens, tokens > -1).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_layer_scan_keeps_no_gathered_kernels_without_remat():
    """fsdp8, remat none, scanned layers, 64 tokens (activations are small beside the weights): each added layer
    grew the update's temporaries by 1.97x one layer's float32 weights when autodiff kept every layer's gathered
    kernels (and a copy) for the backward; keeping the shards it grows by less than one layer's weights (0.30x)."""
    layer_weights = 4 * (4 * 256 * 256 + 3 * 256 * 512)  # q, k, v, o and gate, up, down, float32
    growth = (_update_temporaries(6) - _update_temporaries(2)) / 4 / layer_weights
    assert growth < 1.0, growth
