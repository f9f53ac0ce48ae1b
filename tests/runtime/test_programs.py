"""Stage programs: inference in row micro-batches, trimmed to a length bucket, equals the whole padded batch."""

import copy
import dataclasses

import numpy as np
import pytest

from rpegjax.graph.ir import StageKind
from rpegjax.learners.batch import pack_rollouts
from tiny_setup import TinySetup, built


@pytest.fixture(scope="module")
def parts():
    return built(TinySetup(prompts_per_step=8, max_new_tokens=20))


def with_settings(parts, **changes):
    """The same learner (same parameters and jitted functions) with other inference/bucketing settings."""
    learner = copy.copy(parts.learner)
    learner.cfg = dataclasses.replace(learner.cfg, **changes)
    return dataclasses.replace(parts, learner=learner).programs(None)


def _mixed_lengths_batch(rows: int, *, seed: int):
    """`rows` rows of random prompts (2-11 tokens) and responses (1-8 tokens), padded to 32."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, 60, size=rng.integers(2, 12))) for _ in range(rows)]
    responses = [list(rng.integers(3, 60, size=rng.integers(1, 9))) for _ in range(rows)]
    return pack_rollouts(prompts, responses, pad_id=0, length=32)

def test_micro_batched_bucketed_inference_equals_the_whole_padded_batch(parts):
    rows = 16
    batch = _mixed_lengths_batch(rows, seed=0)
    kinds = (StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB)
    state = parts.learner.init_state()
    expected = with_settings(parts).infer(kinds, state, batch)
    programs = with_settings(parts, inference_rows=8, length_bucket=8)
    assert parts.learner.placement.mesh.devices.size == 8
    assert programs.learner.trimmed_length(batch.token_mask) in (16, 24)
    assert programs.learner.inference_micro_batches(rows, 16, shards=8) == 2
    got = programs.infer(kinds, state, batch)
    for field in expected:
        assert got[field].shape == (rows, 32)
        assert got[field].sharding.is_equivalent_to(expected[field].sharding, 2)
        np.testing.assert_allclose(np.asarray(got[field]), np.asarray(expected[field]), rtol=1e-6, atol=1e-6)


def test_a_row_over_the_inference_budget_is_refused_before_compiling(parts):
    programs = with_settings(parts, inference_memory_gib=1e-6)
    batch = pack_rollouts([[5, 6, 7]] * 8, [[8, 9]] * 8, pad_id=0, length=32)
    with pytest.raises(ValueError, match=r"GRPOLearner inference: one row of 32 tokens needs an estimated .* GiB per "
                                         r"device .*, more than the memory budget of 1e-06 GiB"):
        programs.infer((StageKind.REF_LOGPROB,), parts.learner.init_state(), batch)
    assert programs.training.compiled_inference_programs() == 0  # nothing was built


def test_weight_sync_casts_the_generation_copy_and_generation_runs_on_it(parts):
    import jax
    import jax.numpy as jnp

    from rpegjax.generate.sampling import SamplingConfig

    programs = parts.programs(None, generation_dtype="bfloat16")
    state = parts.learner.init_state()
    copy_ = programs.sync(state)
    shardings = jax.tree.leaves(parts.sampler.params_sharding)
    for trained, generated, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(copy_), shardings, strict=True):
        assert generated.dtype == jnp.bfloat16 and trained.dtype == jnp.float32
        assert generated.sharding.is_equivalent_to(sharding, generated.ndim)  # the generation layout
        np.testing.assert_array_equal(np.asarray(generated, np.float32), np.asarray(trained.astype(jnp.bfloat16), np.float32))
    completions = list(parts.sampler.stream(copy_, [[5, 6, 7]] * 2, SamplingConfig(max_new_tokens=4), group_size=2,
                                            key=jax.random.key(0), version=0))
    assert len(completions) == 4 and all(1 <= len(c.response_ids) <= 4 for c in completions)


def test_packed_inference_equals_the_padded_batch_and_lowers_for_abstract_rows(parts):
    """Sequences packed into rows of 32 tokens, one row per device per micro-batch, unpacked in the program."""
    rows = 16
    batch = _mixed_lengths_batch(rows, seed=1)
    kinds = (StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB)
    state = parts.learner.init_state()
    expected = with_settings(parts).infer(kinds, state, batch)
    programs = with_settings(parts, packing=True, max_tokens_per_micro_batch=32)
    plan = programs.learner.inference_packing(batch.token_mask, shards=8)
    assert plan.num_rows % 8 == 0 and plan.num_rows < rows
    got = programs.infer(kinds, state, batch)
    for field in expected:
        assert got[field].shape == (rows, 32)
        np.testing.assert_allclose(np.asarray(got[field]), np.asarray(expected[field]), rtol=1e-5, atol=1e-5)
    abstract = programs.training.abstract_rollout(rows, 32)
    compiled = programs.training.lower_inference(kinds, state, abstract).compile()
    assert compiled.memory_analysis() is not None
