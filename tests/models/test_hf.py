"""Checkpoint I/O without transformers: round trips, value heads, atomic writes and every promised error."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.models.hf import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_pretrained,
    read_config,
    save_pretrained,
    tensor_layouts,
)


def _params(model: Decoder) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a: Decoder, b: Decoder) -> None:
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for path in pa:
        np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


@pytest.fixture
def saved(tmp_path):
    cfg = ModelConfig.tiny(Architecture.QWEN2, eos_token_id=1)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    return model, save_pretrained(model, cfg, tmp_path / "ckpt")


def _rewrite_weights(path, change) -> None:
    tensors = load_file(str(path / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


# ---- layouts and round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", list(Architecture))
def test_save_load_round_trip_is_exact(architecture, tmp_path):
    cfg = ModelConfig.tiny(architecture, tie_word_embeddings=architecture == Architecture.LLAMA)
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    path = save_pretrained(model, cfg, tmp_path / "m")
    loaded, loaded_cfg = load_pretrained(path)
    assert loaded_cfg == cfg
    _assert_same_params(model, loaded)


def test_qwen2_without_bias_is_saved_with_zero_biases(tmp_path):
    cfg = ModelConfig.tiny(Architecture.QWEN2, attention_bias=False)
    model = Decoder(cfg, rngs=nnx.Rngs(4))
    loaded, loaded_cfg = load_pretrained(save_pretrained(model, cfg, tmp_path / "m"))
    assert loaded_cfg.attention_bias and not np.asarray(loaded.layers[0].attention.q_bias.get_value()).any()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)))
    np.testing.assert_allclose(loaded(tokens), model(tokens), atol=1e-6)


def test_sharded_checkpoint_round_trip(tmp_path):
    cfg = ModelConfig.tiny(Architecture.QWEN3)
    model = Decoder(cfg, rngs=nnx.Rngs(5))
    path = save_pretrained(model, cfg, tmp_path / "m", max_shard_bytes=50_000)
    index = json.loads((path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == {layout.name for layout in tensor_layouts(cfg)}
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == 4 * cfg.num_params()
    loaded, _ = load_pretrained(path)
    _assert_same_params(model, loaded)


def test_dtype_overrides_and_bfloat16_storage(tmp_path):
    cfg = ModelConfig.tiny(Architecture.LLAMA, param_dtype="bfloat16", dtype="bfloat16")
    model = Decoder(cfg, rngs=nnx.Rngs(6))
    path = save_pretrained(model, cfg, tmp_path / "m")
    assert json.loads((path / CONFIG_FILE).read_text())["dtype"] == "bfloat16"
    loaded, loaded_cfg = load_pretrained(path)
    assert loaded_cfg.param_dtype == "bfloat16"
    _assert_same_params(model, loaded)
    as32, cfg32 = load_pretrained(path, param_dtype="float32")
    assert cfg32.dtype == "float32" and as32.embed.get_value().dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(as32.embed.get_value()), np.asarray(model.embed.get_value()).astype(np.float32))


def test_value_head_round_trip_and_defaults(tmp_path):
    cfg = ModelConfig.tiny(Architecture.QWEN2, value_head=True)
    model = Decoder(cfg, rngs=nnx.Rngs(7))
    model.value_kernel.set_value(jax.random.normal(jax.random.key(0), (cfg.hidden_size,)))
    model.value_bias.set_value(jnp.asarray(0.25))
    path = save_pretrained(model, cfg, tmp_path / "critic")
    assert {"value_head.weight", "value_head.bias"} <= set(load_file(str(path / WEIGHTS_FILE)))
    critic, _ = load_pretrained(path, value_head=True)
    _assert_same_params(model, critic)
    policy, policy_cfg = load_pretrained(path)  # the value head is skipped
    assert not policy_cfg.value_head and not hasattr(policy, "value_kernel")
    fresh, _ = load_pretrained(save_pretrained(policy, policy_cfg, tmp_path / "policy"), value_head=True)
    assert not np.asarray(fresh.value_kernel.get_value()).any() and float(fresh.value_bias.get_value()) == 0.0


def test_overwrite_replaces_checkpoint_and_leaves_no_temporaries(tmp_path):
    cfg = ModelConfig.tiny()
    first, second = Decoder(cfg, rngs=nnx.Rngs(8)), Decoder(cfg, rngs=nnx.Rngs(9))
    save_pretrained(first, cfg, tmp_path / "m", max_shard_bytes=30_000)
    save_pretrained(second, cfg, tmp_path / "m")
    assert sorted(os.listdir(tmp_path)) == ["m"]
    assert not (tmp_path / "m" / INDEX_FILE).exists()
    _assert_same_params(second, load_pretrained(tmp_path / "m")[0])


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = ModelConfig.tiny()
    model = Decoder(cfg, rngs=nnx.Rngs(10))
    save_pretrained(model, cfg, tmp_path / "m")
    import rpegjax.models.hf as hf

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "write_safetensors", crash)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(Decoder(cfg, rngs=nnx.Rngs(11)), cfg, tmp_path / "m")
    assert sorted(os.listdir(tmp_path)) == ["m"]
    _assert_same_params(model, load_pretrained(tmp_path / "m")[0])


# ---- errors ----------------------------------------------------------------------------------------------------
def test_unknown_model_type(saved):
    _, path = saved
    config = json.loads((path / CONFIG_FILE).read_text())
    config["model_type"] = "gpt2"
    (path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*unsupported model_type 'gpt2'"):
        load_pretrained(path)


def test_missing_config(saved):
    _, path = saved
    (path / CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_pretrained(path)


def test_missing_tensor(saved):
    _, path = saved
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_pretrained(path)


def test_unexpected_tensor(saved):
    _, path = saved
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_pretrained(path)


def test_shape_mismatch(saved):
    _, path = saved
    config = json.loads((path / CONFIG_FILE).read_text())
    config["intermediate_size"] = 96
    (path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\), expected \(96, 64\)"):
        load_pretrained(path)


def test_integer_tensor_is_a_dtype_mismatch(saved):
    _, path = saved
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I32"):
        load_pretrained(path)


def test_truncated_safetensors(saved):
    _, path = saved
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_pretrained(path)


def test_garbage_safetensors(saved):
    _, path = saved
    (path / WEIGHTS_FILE).write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_pretrained(path)


def test_index_naming_a_missing_shard(tmp_path):
    cfg = ModelConfig.tiny()
    path = save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "m", max_shard_bytes=30_000)
    victim = json.loads((path / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json: tensor '[\w.]+' is in shard '{victim}', which does not exist"):
        load_pretrained(path)


def test_index_listing_a_tensor_its_shard_lacks(tmp_path):
    cfg = ModelConfig.tiny()
    path = save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "m", max_shard_bytes=30_000)
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(s for s in shards if s != index["weight_map"]["model.norm.weight"])
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index lists tensor 'model\.norm\.weight' in this shard but it is not there"):
        load_pretrained(path)


def test_no_weights_and_pickle_refused(saved):
    _, path = saved
    (path / WEIGHTS_FILE).rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors.*pickle files, which we never load"):
        load_pretrained(path)


def test_half_a_value_head(tmp_path):
    cfg = ModelConfig.tiny(value_head=True)
    path = save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.pop("value_head.bias"))
    with pytest.raises(CheckpointError, match="missing tensor 'value_head.bias'"):
        load_pretrained(path, value_head=True)


def test_tied_checkpoint_with_a_different_lm_head(tmp_path):
    cfg = ModelConfig.tiny(tie_word_embeddings=True)
    path = save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    load_pretrained(path)  # an identical copy of the tied matrix is accepted
    _rewrite_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from embed_tokens"):
        load_pretrained(path)


def test_unsupported_config_features(saved):
    _, path = saved
    config = json.loads((path / CONFIG_FILE).read_text())
    for change, message in [({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
                            ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": None}, "unsupported rope type 'yarn'"),
                            ({"use_sliding_window": True}, "use_sliding_window")]:
        (path / CONFIG_FILE).write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=message):
            load_pretrained(path)


@pytest.mark.parametrize("change, message", [
    ({"tie_word_embeddings": "no"}, "field 'tie_word_embeddings' must be true or false, got str 'no'"),
    ({"tie_word_embeddings": 0}, "field 'tie_word_embeddings' must be true or false, got int 0"),
    ({"hidden_size": "64"}, "field 'hidden_size' must be an integer, got str '64'"),
    ({"num_key_value_heads": 2.0}, "field 'num_key_value_heads' must be an integer, got float 2.0"),
    ({"rms_norm_eps": "1e-6"}, "field 'rms_norm_eps' must be a number, got str '1e-6'"),
    ({"mlp_bias": "false"}, "field 'mlp_bias' must be true or false, got str 'false'"),
])
def test_config_values_of_the_wrong_json_type_name_the_file_and_field(saved, change, message):
    """A string "no" must not read as true (bool("no")), nor "64" give an error without the field's name."""
    _, path = saved
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as error:
        load_pretrained(path)
    assert str(path / CONFIG_FILE) in str(error.value) and message in str(error.value)


def test_save_rejects_what_transformers_cannot_represent(tmp_path):
    cfg = ModelConfig.tiny(Architecture.LLAMA, attention_bias=True)
    with pytest.raises(CheckpointError, match="attention_bias=True"):
        save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "m")
    cfg = ModelConfig.tiny(Architecture.QWEN2)
    with pytest.raises(ValueError, match=r"config\.hidden_size=32 but the model has 64"):
        save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg.replace(hidden_size=32), tmp_path / "m")
    assert not os.listdir(tmp_path)


def test_config_formats_of_transformers_4_and_5_agree(tmp_path):
    """transformers 5 writes rope_parameters/dtype, older versions rope_theta/rope_scaling/torch_dtype."""
    common = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    old = {**common, "torch_dtype": "bfloat16", "rope_theta": 5e5,
           "rope_scaling": {"rope_type": "llama3", **scaling, "original_max_position_embeddings": 256}}
    new = {**common, "dtype": "bfloat16", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    configs = []
    for name, hf in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / CONFIG_FILE).write_text(json.dumps(hf))
        configs.append(read_config(tmp_path / name))
    assert configs[0] == configs[1]
    assert configs[0].rope_theta == 5e5 and configs[0].param_dtype == "bfloat16"
    assert configs[0].rope_scaling.original_max_position_embeddings == 256  # defaults to max_position_embeddings
