"""The samplers record a mixture-of-experts model's routing (router replay): every token's experts equal what a
full forward of the same tokens routes (float32), for both KV-cache layouts, and recording changes no token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig
from rpegjax.models import Architecture, Decoder, ModelConfig

CFG = ModelConfig.tiny(Architecture.QWEN3_MOE, num_layers=3, mlp_only_layers=(1,), num_experts=6, eos_token_id=None)
PROMPTS = [[5, 9, 17, 3, 88], [41, 2], [7, 7, 100, 64, 31, 12, 90], [120]]
CACHES = {"contiguous": None, "paged": CacheConfig.paged(page_size=4, prefill_chunk=4)}


@pytest.fixture(scope="module")
def moe_model() -> Decoder:
    return Decoder(CFG, rngs=nnx.Rngs(3))


def _generate(model: Decoder, cache, record: bool):
    graphdef, params = nnx.split(model)
    # 4 slots for 4 prompts x 2 samples: slots are refilled, so a slot's earlier sequence must not leak
    # one decode bucket (live_buckets=False: the routing's gather and scatter around a chunk run all the same)
    sampler = Sampler(CFG, graphdef, num_slots=4, max_prompt_len=8, max_new_tokens=7, chunk_steps=3, cache=cache,
                      record_routing=record, live_buckets=False)
    sampling = SamplingConfig(max_new_tokens=7, temperature=1.0)
    budgets = [7, 3, 5, 6]
    return sampler.generate(params, PROMPTS, sampling, group_size=2, key=jax.random.key(4), budgets=budgets)


@pytest.mark.slow  # two more samplers to compile (~2 minutes on the loaded machine)
@pytest.mark.parametrize("layout", sorted(CACHES))
def test_recording_changes_no_token(moe_model, layout):
    recorded = _generate(moe_model, CACHES[layout], record=True)
    plain = _generate(moe_model, CACHES[layout], record=False)
    for with_routing, without in zip(recorded, plain, strict=True):
        assert without.expert_ids is None
        np.testing.assert_array_equal(with_routing.response_ids, without.response_ids)
        np.testing.assert_array_equal(with_routing.behaviour_logprobs, without.behaviour_logprobs)


@pytest.mark.parametrize("layout", sorted(CACHES))
def test_recorded_routing_equals_the_full_forward(moe_model, layout):
    recorded = _generate(moe_model, CACHES[layout], record=True)
    # one full forward of every sequence, right-padded (causal: padding changes no real token's routing)
    sequences = [np.concatenate([c.prompt_ids, c.response_ids]) for c in recorded]
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, : sequence.size] = sequence
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    routed = np.asarray(moe_model.routed_hidden_states(jnp.asarray(tokens), positions)[2].expert_ids)
    for row, (completion, sequence) in enumerate(zip(recorded, sequences, strict=True)):
        ids = completion.expert_ids
        assert ids.shape == (sequence.size, 2, 2) and ids.dtype == np.int16
        # every token a pass fed (prompt: prefill; response: the decode step that fed it) routes as the full
        # forward does; the last sampled token was never fed: -1 (replay then lets the router choose)
        np.testing.assert_array_equal(ids[:-1], routed[row, : sequence.size - 1])
        assert np.all(ids[-1] == -1)


def test_recording_needs_a_mixture_of_experts_model_and_is_absent_when_off():
    cfg = ModelConfig.tiny()
    graphdef = nnx.graphdef(Decoder(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Sampler(cfg, graphdef, num_slots=2, max_prompt_len=4, max_new_tokens=4, record_routing=True)
    for cache in CACHES.values():  # off (the default): the decode state carries no routing, so no program does
        for model_cfg in (cfg, CFG):
            graph = nnx.graphdef(Decoder(model_cfg, rngs=nnx.Rngs(0)))
            state = Sampler(model_cfg, graph, num_slots=2, max_prompt_len=4, max_new_tokens=4, cache=cache).abstract_state()
            assert state.routing is None
    recording = Sampler(CFG, nnx.graphdef(Decoder(CFG, rngs=nnx.Rngs(0))), num_slots=2, max_prompt_len=4,
                        max_new_tokens=4, record_routing=True).abstract_state()
    assert recording.routing.shape == (2, 8, 2, 2) and recording.routing.dtype == jnp.int16
