"""Gated DeltaNet == transformers' Qwen3.5 functions and module (torch CPU, float32) with the same weights; chunked ==
recurrent, packed == unpacked, prefill + decode steps == the full-sequence forward, gradients == torch autograd."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402

from rpegjax.models.config import Architecture, ModelConfig  # noqa: E402
from rpegjax.models.gated_deltanet import (  # noqa: E402
    DeltaNetState,
    GatedDeltaNet,
    causal_conv,
    chunked_gated_delta_rule,
    hf_tensors,
    l2_normalize,
    recurrent_gated_delta_rule,
)

SIMPLE, COMPOSITE = 1e-5, 1e-4  # float32
# jitted: one compilation each beats op-by-op dispatch of the scans on the CPU
chunked_gated_delta_rule = jax.jit(chunked_gated_delta_rule, static_argnames="chunk_size")
recurrent_gated_delta_rule = jax.jit(recurrent_gated_delta_rule)
causal_conv = jax.jit(causal_conv)
B, T, K, H, DK, DV = 2, 37, 2, 4, 8, 6  # t spans several chunks of 16 and a partial one


def _inputs(seed: int = 0, t: int = T):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, t, K, DK)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(B, t, H, DV)).astype(np.float32)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, H))))).astype(np.float32)
    state = rng.normal(size=(B, H, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def _ours(q, k):
    """Our rule's inputs: q, k normalised (q scaled) and repeated to the value heads, as the layer does."""
    q = jnp.repeat(l2_normalize(jnp.asarray(q)), H // K, axis=2) / np.sqrt(DK)
    return q, jnp.repeat(l2_normalize(jnp.asarray(k)), H // K, axis=2)


def test_chunked_and_recurrent_rules_equal_transformers():
    q, k, v, g, beta, state = _inputs()
    t = [torch.tensor(a) for a in (q, k, v, g, beta, state)]
    want, want_state = hf.torch_chunk_gated_delta_rule(*t[:5], chunk_size=16, initial_state=t[5],
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_r, want_r_state = hf.torch_recurrent_gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True,
                                                              use_qk_l2norm_in_kernel=True)
    qq, kk = _ours(q, k)
    got, got_state = chunked_gated_delta_rule(qq, kk, v, g, beta, state, chunk_size=16)
    np.testing.assert_allclose(got, want.numpy(), atol=SIMPLE)
    np.testing.assert_allclose(got_state, want_state.numpy(), atol=SIMPLE)
    got_r, got_r_state = recurrent_gated_delta_rule(qq, kk, v, g, beta, state)
    np.testing.assert_allclose(got_r, want_r.numpy(), atol=SIMPLE)
    np.testing.assert_allclose(got_r_state, want_r_state.numpy(), atol=SIMPLE)
    for size in (1, 5, 64):  # any chunk size is the same recurrence
        again, again_state = chunked_gated_delta_rule(qq, kk, v, g, beta, state, chunk_size=size)
        np.testing.assert_allclose(again, got_r, atol=SIMPLE)
        np.testing.assert_allclose(again_state, got_r_state, atol=SIMPLE)


def test_packed_rule_restarts_the_state_at_each_segment():
    q, k, v, g, beta, _ = _inputs(1)
    qq, kk = _ours(q, k)
    bounds = [(0, 10), (10, 30), (30, 37)]  # a segment ends mid-chunk, one spans a chunk boundary
    segments = np.concatenate([np.full(hi - lo, i + 3) for i, (lo, hi) in enumerate(bounds)])[None].repeat(B, 0)
    got, got_state = chunked_gated_delta_rule(qq, kk, v, g, beta, None, jnp.asarray(segments), chunk_size=16)
    for lo, hi in bounds:
        alone, alone_state = recurrent_gated_delta_rule(qq[:, lo:hi], kk[:, lo:hi], v[:, lo:hi], g[:, lo:hi],
                                                        beta[:, lo:hi])
        np.testing.assert_allclose(got[:, lo:hi], alone, atol=SIMPLE)
    np.testing.assert_allclose(got_state, alone_state, atol=SIMPLE)  # the state after the last segment


def test_chunked_rule_gradients_equal_torch_autograd():
    q, k, v, g, beta, state = _inputs(2, t=21)
    weights = np.random.default_rng(3).normal(size=(B, 21, H, DV)).astype(np.float32)

    def ours(q, k, v, g, beta, state):
        qq = jnp.repeat(l2_normalize(q), H // K, axis=2) / np.sqrt(DK)
        out, final = chunked_gated_delta_rule(qq, jnp.repeat(l2_normalize(k), H // K, axis=2), v, g, beta, state,
                                              chunk_size=8)
        return jnp.sum(out * weights) + jnp.sum(final ** 2)

    got = jax.grad(ours, argnums=tuple(range(6)))(*map(jnp.asarray, (q, k, v, g, beta, state)))
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v, g, beta, state)]
    out, final = hf.torch_chunk_gated_delta_rule(*leaves[:5], chunk_size=8, initial_state=leaves[5],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    (torch.sum(out * torch.tensor(weights)) + torch.sum(final ** 2)).backward()
    for name, ours_grad, leaf in zip("q k v g beta state".split(), got, leaves, strict=True):
        np.testing.assert_allclose(ours_grad, leaf.grad.numpy(), atol=COMPOSITE, err_msg=name)


def test_causal_conv_equals_transformers_and_continues_from_its_window():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, 11, 10)).astype(np.float32)
    kernel = rng.normal(size=(10, 4)).astype(np.float32)
    want = hf.causal_conv1d_fn(torch.tensor(x).transpose(1, 2), torch.tensor(kernel), activation="silu")
    got, window = causal_conv(jnp.asarray(x), jnp.asarray(kernel))
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), atol=SIMPLE)
    np.testing.assert_allclose(window, x[:, -3:], atol=0)
    first, first_window = causal_conv(jnp.asarray(x[:, :6]), jnp.asarray(kernel))
    rest, rest_window = causal_conv(jnp.asarray(x[:, 6:]), jnp.asarray(kernel), first_window)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), got, atol=SIMPLE)
    np.testing.assert_allclose(rest_window, window, atol=0)
    # transformers' decode step from the same window (its state is [b, c, w]: the window plus the oldest input)
    conv_state = torch.tensor(np.concatenate([x[:, 5:6], x[:, 6:8]], axis=1)).transpose(1, 2).contiguous()
    step = hf.causal_conv1d_update(torch.tensor(x[:, 8:9]).transpose(1, 2), conv_state, torch.tensor(kernel),
                                   activation="silu")
    ours_step, _ = causal_conv(jnp.asarray(x[:, 8:9]), jnp.asarray(kernel), jnp.asarray(x[:, 5:8]))
    np.testing.assert_allclose(ours_step, step.transpose(1, 2).numpy(), atol=SIMPLE)
    # right padding: the window after each row's real tokens
    lengths = jnp.array([4, 9])
    _, padded_window = causal_conv(jnp.asarray(x), jnp.asarray(kernel), lengths=lengths)
    np.testing.assert_allclose(padded_window[0], x[0, 1:4], atol=0)
    np.testing.assert_allclose(padded_window[1], x[1, 6:9], atol=0)
    # packed: each segment convolves alone
    segments = jnp.asarray(np.array([[0] * 5 + [1] * 6] * B))
    packed, _ = causal_conv(jnp.asarray(x), jnp.asarray(kernel), segment_ids=segments)
    np.testing.assert_allclose(packed[:, 5:], causal_conv(jnp.asarray(x[:, 5:]), jnp.asarray(kernel))[0], atol=SIMPLE)


# ---- the layer against transformers' Qwen3_5GatedDeltaNet ------------------------------------------------------
HF_SHAPES = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def _cfg() -> ModelConfig:
    return ModelConfig.tiny(Architecture.QWEN3, hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)


@pytest.fixture(scope="module")
def layers():
    """Our layer and transformers' with the same (random, non-default) weights, through our HF maps."""
    torch.manual_seed(0)
    theirs = hf.Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**HF_SHAPES, layer_types=["linear_attention"]), 0).eval()
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            parameter.copy_(torch.randn(parameter.shape) * (0.3 if "proj" in name or "conv" in name else 0.5)
                            + (1.0 if name == "norm.weight" else 0.0))
    cfg = _cfg()
    ours = GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    tensors = dict(theirs.state_dict())
    for hf_name, attribute, shape, (to_ours, to_hf, window) in hf_tensors(cfg):
        weight = tensors[hf_name].numpy()
        assert weight.shape == shape, hf_name
        np.testing.assert_array_equal(to_hf(to_ours(weight)), weight, err_msg=hf_name)
        getattr(ours, attribute).set_value(jnp.asarray(to_ours(weight)))
        full = to_ours(weight)  # a device's window of ours reads the HF block it needs
        block = tuple(slice(0, n) if n < 2 else slice(1, n) for n in full.shape)
        hf_window, finish = window(block)
        np.testing.assert_array_equal(finish(weight[hf_window]), full[block], err_msg=hf_name)
    return cfg, ours, theirs


@nnx.jit(static_argnames="chunk_size")
def _apply(layer, x, mask=None, *, segment_ids=None, state=None, chunk_size=64):
    return layer(x, mask, None, segment_ids=segment_ids, state=state, chunk_size=chunk_size)


def _hidden(seed: int, t: int = 13) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(B, t, 32)).astype(np.float32)


def test_layer_equals_transformers_on_a_left_padded_batch(layers):
    cfg, ours, theirs = layers
    x = _hidden(5)
    mask = np.arange(13)[None, :] >= np.array([0, 4])[:, None]
    with torch.no_grad():
        want = theirs(torch.tensor(x), attention_mask=torch.tensor(mask.astype(np.int64))).numpy()
    got, _ = _apply(ours, jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=COMPOSITE)


def test_prefill_and_decode_steps_equal_the_full_forward(layers):
    """A right-padded prefill of each row's prompt, then one token per step from the state, == the full sequence."""
    cfg, ours, _ = layers
    x = _hidden(6, t=12)
    full, _ = _apply(ours, jnp.asarray(x))
    prompt = np.array([5, 3])
    mask = np.arange(7)[None, :] < prompt[:, None]
    state = DeltaNetState.zeros(cfg, B)
    rows = np.arange(B)[:, None]
    prefill = np.where(mask[..., None], x[rows, np.arange(7)[None, :]], 0)  # each row's prompt, right-padded
    out, state = _apply(ours, jnp.asarray(prefill), jnp.asarray(mask), state=state)
    np.testing.assert_allclose(np.asarray(out)[mask], np.asarray(full)[:, :7][mask], atol=COMPOSITE)
    for step in range(4):
        position = prompt + step
        token = x[np.arange(B), position][:, None]
        out, state = _apply(ours, jnp.asarray(token), state=state)
        np.testing.assert_allclose(out[:, 0], np.asarray(full)[np.arange(B), position], atol=COMPOSITE)


def test_packed_layer_equals_each_sequence_alone(layers):
    cfg, ours, _ = layers
    x = _hidden(7, t=20)
    segments = np.array([[0] * 8 + [1] * 12, [4] * 20])
    packed, _ = _apply(ours, jnp.asarray(x), segment_ids=jnp.asarray(segments), chunk_size=4)
    first, _ = _apply(ours, jnp.asarray(x[:1, :8]), chunk_size=4)
    second, _ = _apply(ours, jnp.asarray(x[:1, 8:]), chunk_size=4)
    np.testing.assert_allclose(packed[:1], jnp.concatenate([first, second], 1), atol=COMPOSITE)
    whole, _ = _apply(ours, jnp.asarray(x[1:]), chunk_size=4)
    np.testing.assert_allclose(packed[1:], whole, atol=COMPOSITE)
