import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.models import Architecture, Decoder, KVCache, ModelConfig
from rpegjax.models.config import Llama3RopeScaling
from rpegjax.options import remat_runs


@pytest.mark.parametrize("architecture", list(Architecture))
def test_cache_prefill_then_decode_equals_full_forward(architecture):
    cfg = ModelConfig.tiny(architecture)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, cfg.vocab_size)
    prompt_lengths = jnp.array([4, 2, 5])
    full = model(tokens)  # each row as one unpadded sequence

    # right-padded prefill of prompts of different lengths, then one token per step per row
    prompt_mask = jnp.arange(5)[None, :] < prompt_lengths[:, None]
    positions = jnp.broadcast_to(jnp.arange(5), (3, 5))
    cache = KVCache.zeros(cfg, 3, 12)
    hidden, cache = model.hidden_states(tokens[:, :5], positions, mask=prompt_mask, cache=cache)
    np.testing.assert_array_equal(cache.lengths, prompt_lengths)
    prefill_logits = model.logits(hidden)
    for row, length in enumerate(prompt_lengths.tolist()):
        np.testing.assert_allclose(prefill_logits[row, :length], full[row, :length], atol=1e-5)
    for step in range(3):
        index = prompt_lengths + step
        step_tokens = jnp.take_along_axis(tokens, index[:, None], axis=1)
        hidden, cache = model.hidden_states(step_tokens, index[:, None], cache=cache)
        logits = model.logits(hidden)[:, 0]
        expected = jnp.take_along_axis(full, index[:, None, None], axis=1)[:, 0]
        np.testing.assert_allclose(logits, expected, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, prompt_lengths + 3)


def test_cache_stores_keys_position_innermost_and_values_head_dim_innermost():
    """The layout `cached_attention` reads: a prefill writes token j of row b, KV head h at keys
    [b, h, :, j] and values [b, h, j, :], each that token's own key and value projection (layer 0)."""
    from rpegjax.models.rope import inverse_frequencies, rope_tables

    cfg = ModelConfig.tiny()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    _, cache = model.hidden_states(tokens, positions, cache=KVCache.zeros(cfg, 2, 8))
    kv, e = cfg.num_kv_heads, cfg.head_dim
    assert cache.layers[0].k.shape == (2, kv, e, 8) and cache.layers[0].v.shape == (2, kv, 8, e) and cache.capacity == 8
    layer = model.layers[0]
    normed = layer.input_norm(model.embed.get_value()[tokens].astype(cfg.jnp_dtype))
    rope = rope_tables(positions, inverse_frequencies(cfg.rope()))
    keys = layer.attention._project(normed, "k_proj", "k_bias", "k_norm", rope, None, None)  # b t k e
    values = layer.attention._project(normed, "v_proj", "v_bias", None, None, None, None)
    np.testing.assert_allclose(cache.layers[0].k[..., :5], keys.transpose(0, 2, 3, 1), atol=1e-6)
    np.testing.assert_allclose(cache.layers[0].v[:, :, :5], values.transpose(0, 2, 1, 3), atol=1e-6)


def test_left_padding_does_not_change_real_positions():
    cfg = ModelConfig.tiny()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (1, 6), 0, cfg.vocab_size)
    padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), tokens], axis=1)
    mask = jnp.arange(9)[None, :] >= 3
    np.testing.assert_allclose(model(padded, mask=mask)[:, 3:], model(tokens), atol=1e-5)


def test_value_head_and_tied_embeddings():
    cfg = ModelConfig.tiny(value_head=True, tie_word_embeddings=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(model, "lm_head")
    tokens = jnp.ones((2, 5), jnp.int32)
    hidden, _ = model.hidden_states(tokens, jnp.broadcast_to(jnp.arange(5), (2, 5)))
    assert model.values(hidden).shape == (2, 5)
    np.testing.assert_allclose(model.logits(hidden), hidden @ model.embed.get_value().T, atol=1e-5)
    with pytest.raises(ValueError, match="no value head"):
        Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0)).values(hidden)


def test_bfloat16_compute_tracks_float32():
    cfg = ModelConfig.tiny()
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
    f32 = Decoder(cfg, rngs=nnx.Rngs(0))(tokens)
    bf16_model = Decoder(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    bf16 = bf16_model(tokens)
    assert bf16.dtype == jnp.float32  # logits are always returned in float32
    # bfloat16 keeps 8 mantissa bits: ~0.4% relative error per op, a few ops deep
    assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.05 * float(jnp.max(jnp.abs(f32)))


def test_llama3_rope_scaling_changes_low_frequencies_only():
    from rpegjax.models.rope import inverse_frequencies

    base = ModelConfig.tiny(Architecture.LLAMA, head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                         original_max_position_embeddings=64))
    plain, rescaled = inverse_frequencies(base.rope()), inverse_frequencies(scaled.rope())
    wavelength = 2 * np.pi / plain
    high = wavelength < 64 / 4
    low = wavelength > 64
    np.testing.assert_allclose(rescaled[high], plain[high])
    np.testing.assert_allclose(rescaled[low], plain[low] / 8.0, rtol=1e-6)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_heads=3, num_kv_heads=2), "multiple of num_kv_heads"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(dtype="float8"), "dtype must be one of"),
    ],
)
def test_bad_model_configs(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**changes)


def _loss_and_grads(cfg: ModelConfig, tokens, mask):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens, mask=mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1] * mask)

    return jax.jit(jax.value_and_grad(loss))(state), jax.make_jaxpr(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_gives_the_same_loss_and_gradients(remat):
    cfg = ModelConfig.tiny(attention="blockwise", attention_block_size=4)
    tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, cfg.vocab_size)
    mask = jnp.arange(10)[None, :] < jnp.array([10, 6])[:, None]
    (loss, grads), plain_jaxpr = _loss_and_grads(cfg, tokens, mask)
    (remat_loss, remat_grads), remat_jaxpr = _loss_and_grads(cfg.replace(remat=remat), tokens, mask)
    # remat is really applied: the backward recomputes the layers inside `remat` (jax.checkpoint) equations
    assert " remat" in str(remat_jaxpr) and " remat" not in str(plain_jaxpr)
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
    for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(remat_grads), jax.tree.leaves(grads),
                                      strict=True):
        np.testing.assert_allclose(ours, expected, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_remat_policy_is_validated():
    with pytest.raises(ValueError, match=r"ModelConfig.remat must be one of .* got 'some'"):
        ModelConfig.tiny(remat="some")


@pytest.mark.parametrize("remat, layers", [("none", 2), ("full", 2), ("full", 4)])
def test_scanned_layers_give_the_same_loss_and_gradients(remat, layers):
    """Scanned == unrolled; with full remat and 4 layers the scan runs in 2 runs of 2 (`options.remat_runs`)."""
    cfg = ModelConfig.tiny(attention="blockwise", attention_block_size=4, remat=remat, num_layers=layers)
    tokens = jax.random.randint(jax.random.key(5), (2, 10), 0, cfg.vocab_size)
    mask = jnp.arange(10)[None, :] < jnp.array([10, 7])[:, None]
    (loss, grads), _ = _loss_and_grads(cfg, tokens, mask)
    (scan_loss, scan_grads), scan_jaxpr = _loss_and_grads(cfg.replace(scan_layers=True), tokens, mask)
    # the layer loops (forward and backward) run over all layers, or over each run's (attention's block loops: 3)
    runs = remat_runs(layers) if remat == "full" else 1
    lengths = [int(n) for n in re.findall(r"length=(\d+)", str(scan_jaxpr))]
    assert sorted(n for n in lengths if n != 3) == [layers // runs] * 2 * runs, lengths
    np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)
    for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(scan_grads), jax.tree.leaves(grads),
                                      strict=True):
        np.testing.assert_allclose(ours, expected, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # 21 s of compilation
def test_full_remat_over_scanned_layers_keeps_one_input_per_layer():
    """Compiled temporaries per extra layer: full remat keeps the layer input, no remat every activation."""

    def temporaries(layers: int, remat: str) -> int:
        cfg = ModelConfig(vocab_size=128, hidden_size=128, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=32,
                          intermediate_size=512, attention="blockwise", attention_block_size=256, remat=remat,
                          scan_layers=True)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
        tokens = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
        grad = jax.jit(jax.grad(lambda state, tokens: jnp.sum(nnx.merge(graphdef, state)(tokens)[..., 0])))
        return grad.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes

    per_layer_full = (temporaries(6, "full") - temporaries(2, "full")) / 4
    per_layer_none = (temporaries(6, "none") - temporaries(2, "none")) / 4
    layer_input = 2048 * 128 * 4
    layer_params = 4 * (128 * 4 * 32 * 2 + 128 * 2 * 32 * 2 + 3 * 128 * 512)
    # the layer input, plus the stacked copies of its parameters and of their gradients
    assert per_layer_full < 1.5 * layer_input + 2 * layer_params, (per_layer_full, per_layer_none)
    assert per_layer_none > 2 * per_layer_full, (per_layer_full, per_layer_none)


def test_with_execution_keeps_parameters_and_rejects_other_fields():
    model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    changed = model.with_execution(attention="blockwise", remat="dots", scan_layers=True)
    assert changed.cfg.attention == "blockwise" and changed.layers[1].attention.cfg.remat == "dots"
    for ours, expected in zip(jax.tree.leaves(nnx.state(changed)), jax.tree.leaves(nnx.state(model)), strict=True):
        assert ours is expected
    with pytest.raises(ValueError, match=r"changes only .* got \['hidden_size'\]"):
        model.with_execution(hidden_size=32)


def test_scan_stacks_compute_dtype_kernels_with_the_same_values_and_gradients():
    """Under bfloat16 compute the layer scan stacks the projection kernels as their bfloat16 casts (half the bytes
    of the stacked float32 masters): the layers' output and the float32 gradients are those of stacking the masters."""
    from rpegjax.models.rope import inverse_frequencies, rope_tables
    from rpegjax.models.stack_scan import scan_layers
    from rpegjax.options import RematPolicy

    cfg = ModelConfig.tiny(attention="blockwise", attention_block_size=4, remat="full", dtype="bfloat16")
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)).layers)
    x = jax.random.normal(jax.random.key(6), (2, 10, cfg.hidden_size)).astype(jnp.bfloat16)
    mask = jnp.arange(10)[None, :] < jnp.array([10, 7])[:, None]
    rope = rope_tables(jnp.broadcast_to(jnp.arange(10), (2, 10)), inverse_frequencies(cfg.rope()))
    weights = jax.random.normal(jax.random.key(7), x.shape)

    def loss(state, compute_dtype):
        out, _ = scan_layers(nnx.merge(graphdef, state), x, [rope] * cfg.num_layers, mask, RematPolicy.FULL, None,
                              compute_dtype=compute_dtype)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    (masters, out_masters), grads_masters = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        state, None)
    (cast, out_cast), grads_cast = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        state, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out_cast, np.float32), np.asarray(out_masters, np.float32))
    np.testing.assert_allclose(cast, masters, rtol=1e-6)
    for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(grads_cast), jax.tree.leaves(grads_masters),
                                      strict=True):
        assert ours.dtype == expected.dtype == jnp.float32, jax.tree_util.keystr(path)
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(ours, expected, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))
