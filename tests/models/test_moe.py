"""Qwen3-MoE == transformers' Qwen3MoeForCausalLM (torch CPU, float32) on random checkpoints that transformers writes.

The checkpoints mix dense and sparse layers (mlp_only_layers, decoder_sparse_step); logits are compared on a
left-padded batch, greedy generation token for token with both KV-cache layouts, and checkpoints round-trip
through our save_pretrained exactly and back into transformers.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig  # noqa: E402
from rpegjax.models import Architecture, Decoder, ModelConfig  # noqa: E402
from rpegjax.models.hf import CONFIG_FILE, load_pretrained, save_pretrained, tensor_layouts  # noqa: E402
from rpegjax.models.lora import LoRAConfig  # noqa: E402

TOLERANCE = 1e-4  # float32, composite op (three decoder layers + head)
SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
              rms_norm_eps=1e-6, max_position_embeddings=128, rope_theta=1e6, tie_word_embeddings=False)
CASES = {  # sparse layers: 0 and 2 (layer 1 is dense); 1 (every second layer)
    "mlp_only_normalised": dict(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
    "sparse_step_2": dict(mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False),
}


def _hf_checkpoint(case: str, directory) -> str:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SHAPES, **CASES[case])
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + 0.2 * noise if "norm" in name else (1.0 if "gate.weight" in name else 0.15) * noise)
    path = str(directory / case)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return _hf_checkpoint(request.param, tmp_path_factory.mktemp("moe"))


def _left_padded_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    pads = np.array([0, 3, 6])
    tokens = rng.integers(1, 128, size=(3, 11))
    mask = np.arange(11)[None, :] >= pads[:, None]
    return np.where(mask, tokens, 0), mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def _hf_logits(path: str, tokens, mask, positions) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model.eval()(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                           position_ids=torch.tensor(positions))
    return out.logits.numpy()


def _our_logits(model: Decoder, tokens, mask, positions) -> np.ndarray:
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask)))


def test_logits_match_transformers_and_round_trip(checkpoint, tmp_path):
    tokens, mask, positions = _left_padded_batch()
    model, cfg = load_pretrained(checkpoint)
    assert cfg.architecture == Architecture.QWEN3_MOE and 0 < len(cfg.sparse_layers) < cfg.num_layers
    expected = _hf_logits(checkpoint, tokens, mask, positions)
    np.testing.assert_allclose(_our_logits(model, tokens, mask, positions)[mask], expected[mask], atol=TOLERANCE)

    saved = save_pretrained(model, cfg, tmp_path / "ours")  # ours -> transformers: the same function
    np.testing.assert_allclose(_hf_logits(str(saved), tokens, mask, positions)[mask], expected[mask], atol=TOLERANCE)
    reloaded, reloaded_cfg = load_pretrained(saved)  # and back, bit for bit
    assert reloaded_cfg == cfg
    before = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(reloaded, nnx.Param)):
        np.testing.assert_array_equal(variable.get_value(), before[path].get_value(), err_msg=str(path))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_greedy_generation_equals_transformers(checkpoint, layout):
    ours, cfg = load_pretrained(checkpoint)
    graphdef, params = nnx.split(ours)
    cache = CacheConfig(layout=layout, page_size=4, prefill_chunk=4)
    sampler = Sampler(cfg, graphdef, num_slots=3, max_prompt_len=7, max_new_tokens=8, chunk_steps=4, cache=cache)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 128, n).tolist() for n in (7, 2, 5)]
    greedy = SamplingConfig(max_new_tokens=8, greedy=True, ignore_eos=True)
    completions = sampler.generate(params, prompts, greedy, key=jax.random.key(0))

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, completion in zip(prompts, completions, strict=True):  # one row at a time: no padding on their side
        with torch.no_grad():
            out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert completion.response_ids.tolist() == out[0, len(prompt):].tolist()


def test_replayed_routing_reproduces_the_forward_and_other_routing_changes_it():
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, num_layers=3, mlp_only_layers=(1,))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9), tokens.shape)
    hidden, _, routing = model.routed_hidden_states(tokens, positions)
    assert routing.expert_ids.shape == (2, 9, 2, 2) and routing.router_logits.shape == (2, 9, 2, 4)
    replayed, _, again = model.routed_hidden_states(tokens, positions, expert_ids=routing.expert_ids)
    np.testing.assert_array_equal(replayed, hidden)
    np.testing.assert_array_equal(again.expert_ids, routing.expert_ids)
    other = (routing.expert_ids + 1) % cfg.num_experts
    assert np.abs(np.asarray(model.routed_hidden_states(tokens, positions, expert_ids=other)[0] - hidden)).max() > 1e-3
    with pytest.raises(ValueError, match="expert_ids"):
        model.routed_hidden_states(tokens, positions, expert_ids=routing.expert_ids[:, :, :1])


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_sparse_layers_equal_unrolled(remat):
    """All-sparse stack: scan (+ remat) == unrolled in loss, gradients and the routing it returns."""
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE)
    model = Decoder(cfg, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), tokens.shape)

    def run(scan: bool):
        graphdef, state = nnx.split(model.with_execution(scan_layers=scan, remat=remat))

        def loss(state):
            model = nnx.merge(graphdef, state)
            hidden, _, routing = model.routed_hidden_states(tokens, positions)
            z = jnp.mean(jax.nn.logsumexp(routing.router_logits, -1) ** 2)
            return jnp.mean(jax.nn.log_softmax(model.logits(hidden))[..., 1]) + 1e-2 * z, routing

        (value, routing), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        return value, routing, grads

    unrolled, scanned = run(False), run(True)
    np.testing.assert_allclose(scanned[0], unrolled[0], rtol=1e-6)
    np.testing.assert_array_equal(scanned[1].expert_ids, unrolled[1].expert_ids)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(scanned[2]), jax.tree.leaves(unrolled[2]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_lora_adapts_attention_and_leaves_experts_frozen():
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE)
    with pytest.raises(ValueError, match="attention only"):
        Decoder(cfg, rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4))
    base = Decoder(cfg, rngs=nnx.Rngs(0))
    adapted = base.with_lora(LoRAConfig(rank=4, targets=("q", "k", "v", "o")), seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 6)))
    np.testing.assert_allclose(adapted(tokens), base(tokens), atol=1e-6)  # B = 0: the same function
    from rpegjax.models.lora import LoRAParam

    trainable = nnx.state(adapted, LoRAParam)
    paths = [path for path, _ in nnx.to_flat_state(trainable)]
    assert paths and all(path[2] == "attention" for path in paths)


def test_config_json_round_trip_and_both_expert_count_keys(tmp_path):
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert cfg.sparse_layers == (1,)
    hf = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(hf) == cfg
    renamed = {("num_local_experts" if key == "num_experts" else key): value for key, value in hf.items()}
    assert ModelConfig.from_hf_dict(renamed) == cfg
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf_dict({key: value for key, value in hf.items() if key != "moe_intermediate_size"})
    with pytest.raises(ValueError, match="scan_layers"):
        cfg.replace(scan_layers=True)
    with pytest.raises(ValueError, match="num_experts_per_token"):
        cfg.replace(num_experts_per_token=5)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    path = save_pretrained(model, cfg, tmp_path / "m")
    assert json.loads((path / CONFIG_FILE).read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    names = {layout.name for layout in tensor_layouts(cfg)}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.3.mlp.up_proj.weight" in names


@pytest.mark.parametrize("size, total, active", [("30b-a3b", 30.5e9, 3.3e9), ("235b-a22b", 235e9, 22e9)])
def test_preset_parameter_counts_match_the_published_figures(size, total, active):
    """Qwen3 technical report / model cards: 30.5B total, 3.3B activated; 235B total, 22B activated."""
    cfg = ModelConfig.qwen3_moe(size)
    assert abs(cfg.num_params() / total - 1) < 0.01
    assert abs(cfg.num_params(active=True) / active - 1) < 0.03


def test_fsdp_and_tensor_sharded_moe_equals_unsharded():
    """8 virtual devices (data 2, fsdp 2, tensor 2): logits, router-loss gradients and routing as unsharded."""
    from rpegjax.sharding import ShardingRules, axes, make_mesh
    from rpegjax.sharding.rules import ActivationSharding, shard_state

    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, num_layers=3, mlp_only_layers=(1,))
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(3)))
    tokens = jax.random.randint(jax.random.key(0), (8, 10), 0, cfg.vocab_size)
    mask = jnp.arange(10)[None, :] >= jnp.array([0, 3, 0, 5, 1, 0, 2, 7])[:, None]

    def loss(state, tokens, mask, sharding):
        model = nnx.merge(graphdef, state)
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
        hidden, _, routing = model.routed_hidden_states(tokens, positions, mask=mask, sharding=sharding)
        logits = model.logits(hidden)
        value = jnp.mean(jax.nn.log_softmax(logits)[..., 1] * mask) + 1e-2 * jnp.mean(routing.router_logits ** 2)
        return value, (logits, routing.expert_ids)

    run = jax.value_and_grad(loss, has_aux=True)
    (expected, (logits, ids)), grads = jax.jit(run, static_argnums=3)(state, tokens, mask, None)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = ShardingRules.fsdp_tp()
    activation = ActivationSharding(mesh, rules)
    rows = activation.sharding((axes.BATCH, None), tokens.shape)
    sharded = shard_state(state, mesh, rules)
    assert sharded["layers"][0]["mlp"]["down_proj"].get_value().sharding.spec == jax.sharding.PartitionSpec(
        None, "tensor", "fsdp")
    (got, (got_logits, got_ids)), got_grads = jax.jit(run, static_argnums=3)(
        sharded, jax.device_put(tokens, rows), jax.device_put(mask, rows), activation)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(got_logits, logits, atol=1e-5)
    np.testing.assert_array_equal(got_ids, ids)
    # composite (three layers' backward): sharded reductions sum in another order, ~1e-6 apart at values ~1
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_memory_estimate_refuses_expert_layers():
    from rpegjax.models.memory import forward_bytes_per_row, forward_fixed_bytes

    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE)
    with pytest.raises(ValueError, match="no memory estimate for mixture-of-experts"):
        forward_bytes_per_row(cfg, 16, logprob_chunk=8)
    with pytest.raises(ValueError, match="inference_rows"):
        forward_fixed_bytes(cfg)


def _moe_with_shared_expert(cfg: ModelConfig, seed: int):
    from rpegjax.models.moe import SparseMoE
    from rpegjax.models.mlp import MLP

    rngs = nnx.Rngs(seed)
    shared = MLP(cfg.replace(intermediate_size=cfg.shared_expert_intermediate_size), rngs=rngs)
    return SparseMoE(cfg, rngs=rngs, shared_expert=shared)


def test_gated_shared_expert_equals_transformers_sparse_moe_block():
    """Routed + sigmoid-gated shared expert == transformers' Qwen3.5-MoE block (the Qwen2-MoE/Qwen3-Next maths) with
    the same weights, float32."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, num_experts=6, num_experts_per_token=2, moe_intermediate_size=24,
                           shared_expert_intermediate_size=40, shared_expert_gate=True)
    ours = _moe_with_shared_expert(cfg, seed=3)
    theirs = Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(
        hidden_size=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40)).eval()

    def tensor(x):
        return torch.tensor(np.asarray(x))

    with torch.no_grad():
        theirs.gate.weight.copy_(tensor(ours.router.get_value().T))
        theirs.experts.gate_up_proj.copy_(torch.cat([tensor(ours.gate_proj.get_value()).transpose(1, 2),
                                                     tensor(ours.up_proj.get_value()).transpose(1, 2)], dim=1))
        theirs.experts.down_proj.copy_(tensor(ours.down_proj.get_value()).transpose(1, 2))
        for proj in ("gate", "up", "down"):
            getattr(theirs.shared_expert, f"{proj}_proj").weight.copy_(
                tensor(getattr(ours.shared_expert, f"{proj}_proj").get_value().T))
        theirs.shared_expert_gate.weight.copy_(tensor(ours.shared_expert_gate.get_value()[None, :] * 4))
    ours.shared_expert_gate.set_value(ours.shared_expert_gate.get_value() * 4)  # gates away from 1/2: a real test
    x = np.random.default_rng(0).normal(size=(2, 7, 64)).astype(np.float32)
    got, routing = ours(jnp.asarray(x), None)
    with torch.no_grad():
        expected = theirs(torch.tensor(x)).numpy()
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)
    assert routing.expert_ids.shape == (2, 7, 2)


def test_ungated_shared_expert_adds_the_dense_mlp_and_counts_its_parameters():
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, shared_expert_intermediate_size=48)
    moe = _moe_with_shared_expert(cfg, seed=1)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 64)).astype(np.float32))
    got, _ = moe(x, None)
    shared = moe.shared_expert
    moe.shared_expert = None
    routed, _ = moe(x, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(routed + shared(x, None)), atol=1e-6)
    plain = ModelConfig.tiny(Architecture.QWEN3_MOE)
    assert cfg.num_params() - plain.num_params() == cfg.num_layers * 3 * 64 * 48
    gated = cfg.replace(shared_expert_gate=True)
    assert gated.num_params() - cfg.num_params() == cfg.num_layers * 64
    model = Decoder(gated, rngs=nnx.Rngs(0))
    names = {layout.name for layout in tensor_layouts(gated)}
    assert {"model.layers.0.mlp.shared_expert.down_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= names
    from rpegjax.models.hf_layout import hf_tensors_to_state, params_to_hf_tensors

    tensors = params_to_hf_tensors(model)
    restored = nnx.merge(nnx.graphdef(model), hf_tensors_to_state(tensors, gated))
    np.testing.assert_array_equal(restored(jnp.zeros((1, 3), jnp.int32)), model(jnp.zeros((1, 3), jnp.int32)))
    with pytest.raises(ValueError, match="shared_expert_gate"):
        plain.replace(shared_expert_gate=True)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.tiny(Architecture.QWEN3, shared_expert_intermediate_size=8)
    from rpegjax.models.hf import save_pretrained

    with pytest.raises(Exception, match="shared expert"):
        save_pretrained(model, gated, "/nonexistent/never-written")
