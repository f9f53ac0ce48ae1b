"""Sharded checkpoint I/O on 8 virtual devices: a load straight into each parameter's target sharding equals the
one-device load exactly, and an export from sharded arrays loads in `transformers` with the same logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.models.hf import CheckpointError, load_pretrained, save_pretrained
from rpegjax.models.hf_layout import abstract_split
from rpegjax.sharding import ShardingRules, make_mesh, param_shardings

MESHES = {
    "fsdp": {"fsdp": 8},  # every embedding dim split 8 ways: windows of columns of most HF tensors
    "tensor": {"fsdp": 2, "tensor": 2, "data": 2},  # heads, kv heads, mlp and vocab over tensor; replicas over data
    "tensor_only": {"tensor": 2, "data": 4},
}
# tiny has 4 heads and 2 kv heads: a tensor axis of 2 splits both; fsdp=8 splits d=64
CONFIGS = {
    "qwen2_bias_value_head": lambda: ModelConfig.tiny(Architecture.QWEN2, value_head=True),
    "qwen3_qk_norm": lambda: ModelConfig.tiny(Architecture.QWEN3),
    "llama_tied": lambda: ModelConfig.tiny(Architecture.LLAMA, tie_word_embeddings=True),
}


def _random_model(cfg: ModelConfig, seed: int) -> Decoder:
    """Random values for every parameter, value head and norms included (built without running the initialisers)."""
    graphdef, abstract = abstract_split(cfg)
    rng = np.random.default_rng(seed)
    filled = [(path, variable.replace(jnp.asarray(rng.normal(size=variable.get_value().shape), variable.get_value().dtype)))
              for path, variable in nnx.to_flat_state(abstract)]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    cfg = CONFIGS[request.param]()
    model = _random_model(cfg, 1)
    path = save_pretrained(model, cfg, tmp_path_factory.mktemp(request.param) / "ckpt", max_shard_bytes=30_000)
    return cfg, path


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_load_equals_the_one_device_load(checkpoint, mesh_name):
    cfg, path = checkpoint
    mesh = make_mesh(MESHES[mesh_name])
    rules = ShardingRules.fsdp_tp()
    whole, _ = load_pretrained(path, value_head=cfg.value_head)
    sharded, sharded_cfg = load_pretrained(path, value_head=cfg.value_head, mesh=mesh, rules=rules)
    assert sharded_cfg.value_head == cfg.value_head
    wanted = {path: v.get_value() for path, v in nnx.to_flat_state(param_shardings(nnx.state(sharded), mesh, rules))}
    expected = dict(nnx.to_flat_state(nnx.state(whole)))
    split = 0
    for path_, variable in nnx.to_flat_state(nnx.state(sharded)):
        value = variable.get_value()
        assert isinstance(value.sharding, NamedSharding) and value.sharding.is_equivalent_to(wanted[path_], value.ndim)
        split += value.sharding.shard_shape(value.shape) != value.shape
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[path_].get_value()), err_msg=str(path_))
    assert split >= 2 * cfg.num_layers  # not a blind comparison: the layers' weights really are split


def test_fresh_value_head_is_zero_and_sharded(checkpoint):
    cfg, path = checkpoint
    if cfg.value_head:
        pytest.skip("the checkpoint has a value head")
    mesh = make_mesh(MESHES["fsdp"])
    critic, critic_cfg = load_pretrained(path, value_head=True, mesh=mesh)
    assert critic_cfg.value_head
    kernel = critic.value_kernel.get_value()
    assert kernel.sharding.shard_shape(kernel.shape) == (cfg.hidden_size // 8,)
    assert not np.any(np.asarray(kernel)) and float(critic.value_bias.get_value()) == 0.0


def test_sharded_load_refuses_rules_without_a_mesh(checkpoint):
    with pytest.raises(ValueError, match="rules were given without a mesh"):
        load_pretrained(checkpoint[1], rules=ShardingRules.fsdp_tp())


def test_export_from_sharded_arrays_round_trips_exactly(checkpoint, tmp_path):
    cfg, path = checkpoint
    mesh = make_mesh(MESHES["tensor"])
    sharded, sharded_cfg = load_pretrained(path, value_head=cfg.value_head, mesh=mesh)
    exported = save_pretrained(sharded, sharded_cfg, tmp_path / "export")
    again, _ = load_pretrained(exported, value_head=cfg.value_head)
    original, _ = load_pretrained(path, value_head=cfg.value_head)
    for (name, a), (_, b) in zip(nnx.to_flat_state(nnx.state(again)), nnx.to_flat_state(nnx.state(original)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(name))


def test_export_from_an_8_device_model_matches_transformers_logits(tmp_path):
    """A transformers checkpoint loaded onto 8 devices (fsdp=2 x tensor=2 x data=2), exported with the
    tokenizer files of a source directory, loads in transformers with the same logits as the original."""
    pytest.importorskip("transformers")
    from test_parity import (  # the parity helpers
        _hf_checkpoint,
        _hf_logits,
        _left_padded_batch,
    )

    original = _hf_checkpoint("qwen2", tmp_path)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    (tokenizer_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    model, cfg = load_pretrained(original, mesh=make_mesh(MESHES["tensor"]))
    assert not model.layers[0].mlp.gate_proj.get_value().sharding.is_fully_replicated
    exported = save_pretrained(model, cfg, tmp_path / "export", tokenizer_dir=tokenizer_dir)
    assert (exported / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (exported / "tokenizer_config.json").is_file()
    tokens, mask, positions = _left_padded_batch()
    theirs = _hf_logits(original, tokens, mask, positions)
    ours = _hf_logits(str(exported), tokens, mask, positions)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


def test_sharded_load_checks_a_tied_copy_of_the_embedding(tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg = ModelConfig.tiny(Architecture.LLAMA, tie_word_embeddings=True)
    path = save_pretrained(_random_model(cfg, 2), cfg, tmp_path / "tied")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    mesh = make_mesh(MESHES["tensor"])
    load_pretrained(path, mesh=mesh)  # an exact copy is accepted
    tensors["lm_head.weight"][-1, -1] += 1.0  # in the last window only
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true but lm_head.weight differs"):
        load_pretrained(path, mesh=mesh)
