"""LoRA adapters: the initial adapted model is its base, the adapted forward equals the dense W + s A B model, and
adapter gradients are the dense gradient of the merged kernel projected onto A and B."""

import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rpegjax.models.config import Architecture, ModelConfig
from rpegjax.models.lora import (
    Adapter,
    LoRAConfig,
    LoRAParam,
    LoRATarget,
    adapter_paths,
    count_parameters,
    merge_adapters,
    split_adapters,
)
from rpegjax.models.transformer import Decoder, KVCache
from rpegjax.sharding.mesh import make_mesh
from rpegjax.sharding.rules import ShardingRules, param_shardings

jax.config.update("jax_default_matmul_precision", "highest")


def _adapted(architecture=Architecture.QWEN2, lora=None, **changes) -> Decoder:
    """A tiny adapted model whose B matrices are random (a trained adapter), so that the adapters matter."""
    base = Decoder(ModelConfig.tiny(architecture, **changes), rngs=nnx.Rngs(0))
    model = base.with_lora(lora or LoRAConfig(rank=4, alpha=8.0), seed=1)
    key = jax.random.key(2)
    for path, variable in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        if path[-1] == "b":
            key, sub = jax.random.split(key)
            variable.set_value(0.1 * jax.random.normal(sub, variable.get_value().shape))
    nnx.update(model, nnx.state(model, LoRAParam))
    return model


def _merged_model(model: Decoder) -> Decoder:
    base = model.without_lora()
    return nnx.merge(nnx.graphdef(base), merge_adapters(nnx.state(model), model.lora.scale))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 7)), jnp.int32)


@jax.jit
def logits(model: Decoder) -> jax.Array:
    return model(TOKENS)


def test_fresh_adapters_leave_the_function_unchanged():
    base = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    adapted = base.with_lora(LoRAConfig(rank=4), seed=1)
    np.testing.assert_array_equal(np.asarray(logits(adapted)), np.asarray(logits(base)))
    # the base weights are shared, not copied
    assert adapted.layers[0].attention.q_proj.get_value() is base.layers[0].attention.q_proj.get_value()


@pytest.mark.parametrize("architecture", [Architecture.QWEN2, Architecture.LLAMA])
def test_adapted_forward_equals_dense_merged_weights(architecture):
    model = _adapted(architecture)
    reference = _merged_model(model)
    np.testing.assert_allclose(np.asarray(logits(model)), np.asarray(logits(reference)), atol=1e-4, rtol=1e-4)
    # and the adapters matter
    assert np.abs(np.asarray(logits(model)) - np.asarray(logits(model.without_lora()))).max() > 1e-2


def test_merge_is_w_plus_scaled_a_b_in_numpy():
    model = _adapted(lora=LoRAConfig(rank=3, alpha=6.0, targets=("o", "down")))
    state, merged = nnx.state(model), merge_adapters(nnx.state(model), 2.0)
    attention = model.layers[1].attention
    a, b = np.asarray(attention.o_proj_lora.a.get_value()), np.asarray(attention.o_proj_lora.b.get_value())
    w = np.asarray(attention.o_proj.get_value())  # [h, e, d]; A [h, e, r]; B [r, d]
    expected = w + 2.0 * np.einsum("her,rd->hed", a, b)
    np.testing.assert_allclose(np.asarray(merged["layers"][1]["attention"]["o_proj"].get_value()), expected, atol=1e-6)
    assert {kernel[-1] for _, kernel in adapter_paths(state)} == {"o_proj", "down_proj"}
    assert not hasattr(attention, "q_proj_lora")


def test_scanned_and_remat_layers_carry_the_adapters():
    model = _adapted()
    scanned = model.with_execution(scan_layers=True, remat="full")
    np.testing.assert_allclose(np.asarray(logits(scanned)), np.asarray(logits(model)), atol=1e-5, rtol=1e-5)


def _loss(model: Decoder) -> jax.Array:
    values = model(TOKENS)
    return jnp.mean(jax.nn.log_softmax(values)[..., 3] * jnp.arange(values.shape[1]))


def test_adapter_gradients_are_the_dense_gradient_projected():
    """With W' = W + s A B: dL/dA = s dL/dW' B^T and dL/dB = s A^T dL/dW' (kernels flattened to [in, out])."""
    model = _adapted(Architecture.QWEN3)
    scale = model.lora.scale
    graphdef, adapters, base = nnx.split(model, LoRAParam, ...)
    adapter_grads = jax.jit(jax.grad(lambda ad: _loss(nnx.merge(graphdef, ad, base))))(adapters)
    merged = _merged_model(model)
    merged_graphdef, merged_state = nnx.split(merged)
    dense_grads = jax.jit(jax.grad(lambda st: _loss(nnx.merge(merged_graphdef, st))))(merged_state)
    flat_adapters = dict(nnx.to_flat_state(adapters))
    flat_adapter_grads, flat_dense = dict(nnx.to_flat_state(adapter_grads)), dict(nnx.to_flat_state(dense_grads))
    pairs = adapter_paths(nnx.state(model))
    assert len(pairs) == 2 * 7
    for adapter, kernel in pairs:
        a = np.asarray(flat_adapters[(*adapter, "a")].get_value(), np.float64)
        b = np.asarray(flat_adapters[(*adapter, "b")].get_value(), np.float64)
        rank = a.shape[-1]
        a2, b2 = a.reshape(-1, rank), b.reshape(rank, -1)
        g = np.asarray(flat_dense[kernel].get_value(), np.float64).reshape(a2.shape[0], b2.shape[1])
        grad_a = np.asarray(flat_adapter_grads[(*adapter, "a")].get_value()).reshape(a2.shape)
        grad_b = np.asarray(flat_adapter_grads[(*adapter, "b")].get_value()).reshape(b2.shape)
        np.testing.assert_allclose(grad_a, scale * g @ b2.T, atol=1e-6, rtol=1e-4, err_msg=str(adapter))
        np.testing.assert_allclose(grad_b, scale * a2.T @ g, atol=1e-6, rtol=1e-4, err_msg=str(adapter))


def test_adapters_shard_like_their_kernels():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = _adapted()
    shardings = param_shardings(nnx.state(model), mesh, ShardingRules.fsdp_tp())
    attention = shardings["layers"][0]["attention"]
    mlp = shardings["layers"][0]["mlp"]
    assert attention["q_proj_lora"]["a"].get_value().spec == P("fsdp", None)
    assert attention["q_proj_lora"]["b"].get_value().spec == P(None, "tensor", None)
    assert attention["o_proj_lora"]["a"].get_value().spec == P("tensor", None, None)
    assert attention["o_proj_lora"]["b"].get_value().spec == P(None, "fsdp")
    assert mlp["down_proj_lora"]["a"].get_value().spec == P("tensor", None)
    # sharded forward == unsharded forward
    placed = nnx.merge(nnx.graphdef(model), jax.device_put(nnx.state(model), shardings))
    np.testing.assert_allclose(np.asarray(logits(placed)), np.asarray(logits(model)),
                               atol=1e-5, rtol=1e-5)


def test_split_and_count():
    model = _adapted(lora=LoRAConfig(rank=2, targets=("q", "v")))
    adapters, base = split_adapters(nnx.state(model))
    cfg = model.cfg
    per_layer = 2 * cfg.hidden_size * 2 + 2 * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    assert count_parameters(adapters) == cfg.num_layers * per_layer
    assert count_parameters(base) == cfg.num_params()


@pytest.mark.parametrize("bad, message", [
    (dict(rank=0), "rank"), (dict(rank=4, alpha=-1.0), "alpha"), (dict(rank=4, targets=("q", "x")), "targets"),
    (dict(rank=4, targets=()), "targets"), (dict(rank=4, dropout=1.0), "dropout"), (dict(rank=4, dropout=-0.1), "dropout"),
    (dict(rank=4, dropout=True), "dropout"),
])
def test_config_errors(bad, message):
    with pytest.raises(ValueError, match=f"LoRAConfig.{message}"):
        LoRAConfig(**bad)
    assert LoRAConfig(rank=4, dropout=0.1).dropout == 0.1


# ---- LoRA dropout ---------------------------------------------------------------------------------------------------

DROPOUT = 0.3
KEY = jax.random.key(11)


def _with_dropout(model: Decoder, rate: float) -> Decoder:
    """`model`'s weights (shared) under adapters with dropout `rate`."""
    lora = dataclasses.replace(model.lora, dropout=rate)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(model.cfg, rngs=nnx.Rngs(0), lora=lora)))
    return nnx.merge(graphdef, nnx.state(model))


def _hidden(model: Decoder, key) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    return model.hidden_states(TOKENS, positions, dropout_key=key)[0]


def test_dropout_zero_or_no_key_is_the_plain_forward_bit_exact():
    model = _adapted()
    plain = np.asarray(jax.jit(_hidden)(model, None))
    zero = _with_dropout(model, 0.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(_hidden)(zero, KEY)), plain)
    dropped = _with_dropout(model, DROPOUT)
    np.testing.assert_array_equal(np.asarray(jax.jit(_hidden)(dropped, None)), plain)  # no key: inference
    # and neither draws anything: no random op in the program
    for m, key in ((zero, KEY), (dropped, None)):
        assert "random_bits" not in str(jax.make_jaxpr(_hidden)(m, key))
    assert "random_bits" in str(jax.make_jaxpr(_hidden)(dropped, KEY))
    assert np.abs(np.asarray(jax.jit(_hidden)(dropped, KEY)) - plain).max() > 1e-3


def test_adapter_dropout_and_its_gradient_equal_numpy_with_the_same_mask():
    """y = s (x * keep / (1 - p)) A B; with g = dL/dy: dL/dA = s xd^T g B^T, dL/dB = s (xd A)^T g, xd the dropped x."""
    model = _adapted(lora=LoRAConfig(rank=4, alpha=8.0, dropout=DROPOUT))
    adapter = model.layers[0].attention.o_proj_lora  # A [h, e, r], B [r, d]
    rng = np.random.default_rng(3)
    n, fan_in = 96, 4 * 16
    x = rng.standard_normal((n, fan_in)).astype(np.float32)
    g = rng.standard_normal((n, 64)).astype(np.float32)
    keep = np.asarray(jax.random.bernoulli(KEY, 1 - DROPOUT, x.shape))
    assert abs(keep.mean() - (1 - DROPOUT)) < 0.03
    a = np.asarray(adapter.a.get_value(), np.float64).reshape(fan_in, -1)
    b = np.asarray(adapter.b.get_value(), np.float64)
    s = model.lora.scale
    xd = x * keep / (1 - DROPOUT)
    np.testing.assert_allclose(np.asarray(adapter(jnp.asarray(x), jnp.float32, KEY)), s * xd @ a @ b, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(adapter(jnp.asarray(x), jnp.float32)), s * x @ a @ b, atol=1e-5, rtol=1e-5)

    graphdef, params = nnx.split(adapter)
    grads = jax.grad(lambda p: jnp.sum(jnp.asarray(g) * nnx.merge(graphdef, p)(jnp.asarray(x), jnp.float32, KEY)))(params)
    np.testing.assert_allclose(np.asarray(grads["a"].get_value()).reshape(fan_in, -1), s * xd.T @ g @ b.T,
                               atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["b"].get_value()), s * (xd @ a).T @ g, atol=1e-4, rtol=1e-5)


def _masked_reference(model: Decoder, masks: dict, monkeypatch) -> Decoder:
    """Patches `Adapter.__call__` to multiply its input by the next of `masks[layer]` (in q, k, v, o, gate, up, down
    order: the order a layer calls its adapters) and ignore any key: the dense reference of the dropped forward."""
    calls = []

    def reference_call(self, x, dtype, dropout_key=None):
        layer, index = divmod(len(calls), len(LoRATarget))
        calls.append(None)
        keep = masks[layer][index]
        a, b = self.a.get_value().astype(dtype), self.b.get_value().astype(dtype)
        xd = x * jnp.asarray(keep / (1 - DROPOUT), dtype)
        return (xd @ a.reshape(-1, a.shape[-1])) @ (b.reshape(b.shape[0], -1) * self.scale)

    monkeypatch.setattr(Adapter, "__call__", reference_call)
    return calls


def test_dropped_forward_and_gradient_equal_the_masked_reference(monkeypatch):
    """Layer l's adapter of target i draws keep ~ Bernoulli(1 - p) from fold_in(fold_in(key, l), i), independent of
    every other adapter's; the model with dropout equals the adapted model whose adapter inputs are so masked,
    forward and gradient, unrolled, scanned and rematerialised."""
    model = _adapted(lora=LoRAConfig(rank=4, alpha=8.0, dropout=DROPOUT))
    cfg, n = model.cfg, TOKENS.size
    widths = {LoRATarget.O: cfg.num_heads * cfg.head_dim, LoRATarget.DOWN: cfg.intermediate_size}
    masks = {layer: [np.asarray(jax.random.bernoulli(
        jax.random.fold_in(jax.random.fold_in(KEY, layer), index), 1 - DROPOUT, (n, widths.get(target, cfg.hidden_size))))
        for index, target in enumerate(LoRATarget)] for layer in range(cfg.num_layers)}
    assert not np.array_equal(masks[0][0], masks[0][1]) and not np.array_equal(masks[0][0], masks[1][0])

    def forward_and_grad(m, key):
        graphdef, adapters, base = nnx.split(m, LoRAParam, ...)

        @jax.jit
        def run(adapters, base, key):
            def loss(adapters):
                hidden = _hidden(nnx.merge(graphdef, adapters, base), key)
                return jnp.mean(hidden ** 2), hidden

            return jax.grad(loss, has_aux=True)(adapters)

        grads, hidden = run(adapters, base, key)
        return np.asarray(hidden), grads

    results = [forward_and_grad(m, KEY) for m in (model, model.with_execution(scan_layers=True, remat="full"),
                                                   model.with_execution(remat="dots"))]
    with monkeypatch.context() as patch:
        calls = _masked_reference(model, masks, patch)
        want_hidden, want_grads = forward_and_grad(model, None)
        assert len(calls) == cfg.num_layers * len(LoRATarget)
    for hidden, grads in results:
        np.testing.assert_allclose(hidden, want_hidden, atol=1e-5, rtol=1e-5)
        for (path, got), (_, want) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
            np.testing.assert_allclose(got.get_value(), np.asarray(want.get_value()), atol=1e-6, rtol=1e-4,
                                       err_msg=str(path))


def test_dropout_is_refused_in_a_cached_forward():
    model = _adapted(lora=LoRAConfig(rank=4, dropout=DROPOUT))
    cache = KVCache.zeros(model.cfg, TOKENS.shape[0], 16)
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    with pytest.raises(ValueError, match="dropout_key"):
        model.hidden_states(TOKENS, positions, cache=cache, dropout_key=KEY)
