"""Ours == `transformers` (torch CPU, float32) on random tiny Qwen2, Qwen3 and Llama checkpoints.

Checkpoints are written by transformers' own `save_pretrained`, loaded with `load_pretrained`, and run on a
left-padded batch with an attention mask and the same position ids on both sides; logits are compared at
real (non-pad) positions. Round trips go back through our `save_pretrained` into transformers.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rpegjax.models import Decoder  # noqa: E402
from rpegjax.models.hf import INDEX_FILE, WEIGHTS_FILE, load_pretrained, save_pretrained  # noqa: E402

TOLERANCE = 1e-4  # float32, composite op (two decoder layers + head)
SHAPES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=128)

CASES = {
    "qwen2": lambda: transformers.Qwen2Config(**SHAPES, rope_theta=10000.0, tie_word_embeddings=False),
    # head_dim 32 != hidden/heads 16: the projections must not assume d == h*e
    "qwen3": lambda: transformers.Qwen3Config(**SHAPES, head_dim=32, rope_theta=1e6, tie_word_embeddings=False),
    # theta 5e5, head_dim 16, original context 16: frequencies hit all three llama3 branches
    # (kept, smoothed: wavelength 2*pi in [4, 16], divided by factor: wavelengths > 16)
    "llama3": lambda: transformers.LlamaConfig(
        **SHAPES, head_dim=16, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16}),
    "qwen2_tied": lambda: transformers.Qwen2Config(**SHAPES, rope_theta=10000.0, tie_word_embeddings=True),
}


def _randomize(model) -> None:
    """transformers zero-initialises biases and sets norms to one; randomise everything so every weight matters."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def _hf_checkpoint(case: str, directory) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CASES[case](), attn_implementation="eager")
    _randomize(model)
    path = str(directory / case)
    model.save_pretrained(path)
    return path


def _left_padded_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    pads = np.array([0, 3, 6])
    length = 11
    tokens = rng.integers(1, 128, size=(len(pads), length))
    mask = np.arange(length)[None, :] >= pads[:, None]
    tokens = np.where(mask, tokens, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, mask, positions


def _hf_logits(path: str, tokens, mask, positions) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(positions))
    return out.logits.numpy()


def _our_logits(model: Decoder, tokens, mask, positions) -> np.ndarray:
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_on_left_padded_batch(case, tmp_path):
    path = _hf_checkpoint(case, tmp_path)
    tokens, mask, positions = _left_padded_batch()
    reference = _hf_logits(path, tokens, mask, positions)
    model, cfg = load_pretrained(path)
    assert cfg.tie_word_embeddings == (case == "qwen2_tied")
    assert (cfg.rope_scaling is not None) == (case == "llama3")
    ours = _our_logits(model, tokens, mask, positions)
    assert reference[mask].std() > 0.5  # the comparison is not between near-constant logits
    np.testing.assert_allclose(ours[mask], reference[mask], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", ["qwen3", "llama3"])
def test_blockwise_attention_matches_transformers_on_left_padded_batch(case, tmp_path):
    path = _hf_checkpoint(case, tmp_path)
    tokens, mask, positions = _left_padded_batch()
    reference = _hf_logits(path, tokens, mask, positions)
    loaded, cfg = load_pretrained(path)
    # block 4 over 11 tokens: three blocks, the last one padded
    model = loaded.with_execution(attention="blockwise", attention_block_size=4, remat="full", scan_layers=True)
    assert model.cfg.attention == "blockwise" and model.layers[0].attention.cfg.attention == "blockwise"
    np.testing.assert_allclose(_our_logits(model, tokens, mask, positions)[mask], reference[mask], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", ["llama3", "qwen2_tied"])
def test_round_trip_through_our_save_pretrained(case, tmp_path):
    original = _hf_checkpoint(case, tmp_path)
    model, cfg = load_pretrained(original)
    saved = save_pretrained(model, cfg, tmp_path / "ours")
    assert (saved / WEIGHTS_FILE).is_file() and not (saved / INDEX_FILE).exists()

    reference_state = transformers.AutoModelForCausalLM.from_pretrained(original).state_dict()
    reloaded_state = transformers.AutoModelForCausalLM.from_pretrained(str(saved)).state_dict()
    assert sorted(reference_state) == sorted(reloaded_state)
    for name, tensor in reference_state.items():
        assert torch.equal(tensor, reloaded_state[name]), name  # float32 weights survive bit for bit

    tokens, mask, positions = _left_padded_batch(seed=1)
    reference = _hf_logits(original, tokens, mask, positions)
    np.testing.assert_allclose(_hf_logits(str(saved), tokens, mask, positions)[mask], reference[mask], atol=0, rtol=0)
    np.testing.assert_allclose(_our_logits(model, tokens, mask, positions)[mask], reference[mask], atol=TOLERANCE, rtol=0)


def test_sharded_round_trip(tmp_path):
    original = _hf_checkpoint("qwen3", tmp_path)
    model, cfg = load_pretrained(original)
    saved = save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(name for name in os.listdir(saved) if name.endswith(".safetensors"))
    assert (saved / INDEX_FILE).is_file() and not (saved / WEIGHTS_FILE).exists()
    assert len(shards) > 2 and all(os.path.getsize(saved / name) <= 40_000 + 8_192 for name in shards)

    tokens, mask, positions = _left_padded_batch(seed=2)
    reference = _hf_logits(original, tokens, mask, positions)
    np.testing.assert_allclose(_hf_logits(str(saved), tokens, mask, positions)[mask], reference[mask], atol=0, rtol=0)
    reloaded, reloaded_cfg = load_pretrained(saved)
    assert reloaded_cfg == cfg
    np.testing.assert_array_equal(_our_logits(reloaded, tokens, mask, positions), _our_logits(model, tokens, mask, positions))


def test_value_head_checkpoint_still_loads_in_transformers(tmp_path):
    original = _hf_checkpoint("qwen2", tmp_path)
    model, cfg = load_pretrained(original, value_head=True)
    model.value_kernel.set_value(jnp.linspace(-1.0, 1.0, cfg.hidden_size))
    model.value_bias.set_value(jnp.asarray(0.5))
    saved = save_pretrained(model, cfg, tmp_path / "critic")
    tokens, mask, positions = _left_padded_batch(seed=3)
    reference = _hf_logits(original, tokens, mask, positions)
    np.testing.assert_allclose(_hf_logits(str(saved), tokens, mask, positions)[mask], reference[mask], atol=0, rtol=0)


def test_bfloat16_compute_is_close_to_float32(tmp_path):
    """bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3); weights, activations and matmul outputs
    are rounded at ~10 places in two layers, with errors adding roughly in quadrature, so the logits' relative
    error (in norm) should stay near 1e-2; we allow 3e-2 and also require the float32 argmax almost everywhere."""
    path = _hf_checkpoint("qwen2", tmp_path)
    tokens, mask, positions = _left_padded_batch(seed=4)
    model32, _ = load_pretrained(path)
    model16, cfg16 = load_pretrained(path, param_dtype="bfloat16")
    assert cfg16.dtype == "bfloat16" and model16.embed.get_value().dtype == jnp.bfloat16
    logits32 = _our_logits(model32, tokens, mask, positions)[mask]
    logits16 = _our_logits(model16, tokens, mask, positions)[mask]
    assert logits16.dtype == np.float32 and np.isfinite(logits16).all()
    relative = np.linalg.norm(logits16 - logits32) / np.linalg.norm(logits32)
    assert 0 < relative < 3e-2, relative
    assert np.mean(logits16.argmax(-1) == logits32.argmax(-1)) >= 0.9
