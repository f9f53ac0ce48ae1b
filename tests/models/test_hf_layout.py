"""HF tensor layouts and the pure conversions between HF-named arrays and our parameter state."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.models.hf_layout import (
    CheckpointError,
    hf_tensors_to_state,
    params_to_hf_tensors,
    tensor_layouts,
)


def _assert_same_params(a: Decoder, b: Decoder) -> None:
    pa = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(a, nnx.Param))}
    pb = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(b, nnx.Param))}
    assert sorted(pa) == sorted(pb)
    for path in pa:
        np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


def test_hf_layout_matches_the_linear_convention():
    """HF Linear is y = x @ W.T with W [out, in]; our q_proj [d, h, e] must give the same per-head outputs."""
    cfg = ModelConfig.tiny(Architecture.QWEN3)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tensors = params_to_hf_tensors(model)
    x = np.random.default_rng(0).normal(size=(5, cfg.hidden_size)).astype(np.float32)
    hf_q = x @ tensors["model.layers.1.self_attn.q_proj.weight"].T  # [5, h*e], head-major like view(h, e)
    ours = np.einsum("td,dhe->the", x, np.asarray(model.layers[1].attention.q_proj.get_value()))
    np.testing.assert_allclose(hf_q.reshape(5, cfg.num_heads, cfg.head_dim), ours, atol=1e-5)
    hf_o = tensors["model.layers.0.self_attn.o_proj.weight"]  # [d, h*e]
    attended = np.random.default_rng(1).normal(size=(5, cfg.num_heads, cfg.head_dim)).astype(np.float32)
    ours_o = np.einsum("the,hed->td", attended, np.asarray(model.layers[0].attention.o_proj.get_value()))
    np.testing.assert_allclose(attended.reshape(5, -1) @ hf_o.T, ours_o, atol=1e-5)
    np.testing.assert_array_equal(tensors["lm_head.weight"], np.asarray(model.lm_head.get_value()).T)
    assert set(tensors) == {layout.name for layout in tensor_layouts(cfg)}


def test_pure_helpers_round_trip():
    cfg = ModelConfig.tiny(Architecture.LLAMA, value_head=True)
    model = Decoder(cfg, rngs=nnx.Rngs(2))
    graphdef, _ = nnx.split(model)
    state = hf_tensors_to_state(params_to_hf_tensors(model), cfg)
    _assert_same_params(model, nnx.merge(graphdef, state))


def test_pure_helper_errors():
    cfg = ModelConfig.tiny()
    tensors = params_to_hf_tensors(Decoder(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        hf_tensors_to_state({k: v for k, v in tensors.items() if k != "model.norm.weight"}, cfg)
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight' has shape \(64, 128\)"):
        hf_tensors_to_state({**tensors, "lm_head.weight": tensors["lm_head.weight"].T}, cfg)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'lm_head\.bias'"):
        hf_tensors_to_state({**tensors, "lm_head.bias": np.zeros(128, np.float32)}, cfg)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' has dtype int64"):
        hf_tensors_to_state({**tensors, "model.norm.weight": np.ones(64, np.int64)}, cfg)


def test_bias_less_qwen2_exports_zero_biases_and_casts_dtype():
    cfg = ModelConfig.tiny(Architecture.QWEN2, attention_bias=False)
    tensors = params_to_hf_tensors(Decoder(cfg, rngs=nnx.Rngs(0)), dtype=np.float16)
    bias = tensors["model.layers.0.self_attn.k_proj.bias"]
    assert bias.shape == (cfg.num_kv_heads * cfg.head_dim,) and not bias.any()
    assert {array.dtype for array in tensors.values()} == {np.dtype(np.float16)}


@pytest.mark.parametrize("architecture", list(Architecture))
def test_windows_read_exactly_the_converted_block(architecture):
    """For every tensor, reading the HF window a layout names and finishing it gives the same block of our
    parameter as converting the whole tensor and slicing it: random windows, single elements, whole tensors."""
    cfg = ModelConfig.tiny(architecture, value_head=True, attention_bias=architecture == Architecture.QWEN2)
    rng = np.random.default_rng(0)
    for layout in tensor_layouts(cfg):
        hf = rng.normal(size=layout.hf_shape).astype(np.float32)
        ours = layout.to_ours(hf)
        windows = [tuple(slice(0, n) for n in ours.shape)]
        for _ in range(6):
            window = []
            for n in ours.shape:
                start = int(rng.integers(0, n))
                window.append(slice(start, int(rng.integers(start + 1, n + 1))))
            windows.append(tuple(window))
        for window in windows:
            hf_window, finish = layout.window(window)
            np.testing.assert_array_equal(finish(hf[hf_window]), ours[window], err_msg=f"{layout.name} {window}")
