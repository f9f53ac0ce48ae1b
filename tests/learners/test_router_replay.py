"""Router replay from the sampler's recorded routing: the learner's old-log-prob pass replays the rollout's experts
and equals the sampler's log-probs (float32), the update reports how much routing the replay overrides, and
packed rows carry each segment's routing (packed == unpacked)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.graph.ir import StageKind
from rpegjax.learners.batch import pack_rollouts
from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.runtime.training_programs import TrainingPrograms

G = 2
CFG = ModelConfig.tiny(Architecture.QWEN3_MOE, num_layers=3, mlp_only_layers=(1,), num_experts=6, eos_token_id=None)
PROMPTS = [[5, 9, 17, 3, 88], [41, 2, 7], [7, 100, 64, 31, 12, 90], [120, 4]]


@pytest.fixture(scope="module")
def rollout():
    """A float32 MoE model and its rollout with recorded routing, packed like the job's (rows of 16 tokens)."""
    model = Decoder(CFG, rngs=nnx.Rngs(5))
    graphdef, params = nnx.split(model)
    sampler = Sampler(CFG, graphdef, num_slots=8, max_prompt_len=6, max_new_tokens=10, chunk_steps=10,
                      record_routing=True)
    completions = sampler.generate(params, PROMPTS, SamplingConfig(max_new_tokens=10), group_size=G,
                                   key=jax.random.key(1), budgets=[10, 4, 7, 2])
    batch = pack_rollouts([c.prompt_ids for c in completions], [c.response_ids for c in completions],
                          [c.behaviour_logprobs for c in completions], pad_id=0, length=16,
                          rewards=np.arange(len(completions), dtype=np.float32) % 3,
                          expert_ids=[c.expert_ids for c in completions])
    return model, batch


def _programs(model, **changes) -> TrainingPrograms:
    return TrainingPrograms(GRPOLearner(GRPOConfig(group_size=G, decoupled=True, **changes), model))


def test_replayed_old_logprobs_equal_the_sampler_and_the_update_reports_the_override(rollout):
    model, batch = rollout
    assert batch.expert_ids.shape == (8, 16, 2, 2) and batch.expert_ids.dtype == np.int16
    programs = _programs(model, router_replay=True)
    state = programs.learner.init_state()
    old = np.asarray(programs.infer((StageKind.OLD_LOGPROB,), state, batch)["old_logprobs"])
    mask = batch.response_mask
    np.testing.assert_allclose(old[mask], batch.behaviour_logprobs[mask], rtol=0, atol=1e-5)
    filled, _ = programs.learner.compute_advantages(batch.replace(old_logprobs=old))
    _, metrics = programs.update((StageKind.ACTOR_UPDATE,), state, filled)
    # the learner's router agrees with the rollout's choices (same weights): the replay overrides nothing
    assert float(metrics["moe/replay_routing_differs"]) == 0
    assert float(metrics["mismatch/abs_logprob_diff_max"]) <= 1e-5


@pytest.mark.parametrize("replay", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_packed_rows_replay_each_segments_routing(rollout, replay):
    """Packed == unpacked, in the old-log-prob pass and the update, with another routing replayed (so that the
    replay changes the result, and a segment given a neighbour's routing would show)."""
    model, batch = rollout
    ids = batch.expert_ids
    other = np.where(ids >= 0, (ids + np.arange(16)[None, :, None, None]) % CFG.num_experts, -1).astype(np.int16)
    batch = batch.replace(expert_ids=other)
    results = {}
    for packing in (False, True):
        changes = dict(packing=True, max_tokens_per_micro_batch=32) if packing else {}
        programs = _programs(model, router_replay=replay, **changes)
        state = programs.learner.init_state()
        old = programs.infer((StageKind.OLD_LOGPROB,), state, batch)["old_logprobs"]
        filled, _ = programs.learner.compute_advantages(batch.replace(old_logprobs=old))
        filled = filled.replace(old_logprobs=jnp.asarray(batch.behaviour_logprobs))  # a ratio != 1
        _, metrics = programs.update((StageKind.ACTOR_UPDATE,), state, filled)
        results[packing] = np.asarray(old), {k: float(v) for k, v in metrics.items()}
    (old, metrics), (packed_old, packed_metrics) = results[False], results[True]
    np.testing.assert_allclose(packed_old, old, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed_metrics["loss"], metrics["loss"], rtol=1e-5, atol=1e-6)
    mask = batch.response_mask
    if replay:  # the replayed routing is not the model's own: the log-probs moved off the sampler's
        # (the share is a mean over micro-batches, so packed and unpacked runs, which cut them differently, differ)
        assert metrics["moe/replay_routing_differs"] > 0.5 and packed_metrics["moe/replay_routing_differs"] > 0.5
        assert np.abs(old[mask] - batch.behaviour_logprobs[mask]).max() > 1e-3
