"""Inference in row micro-batches: equal to the whole batch (sharded and not), micro-batch choice from a budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.learners.batch import pack_rollouts
from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.inference import GIB, InferenceMicroBatching, map_micro_batches
from rpegjax.learners.scoring import sequence_logprobs
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.memory import forward_bytes_per_row, forward_fixed_bytes
from rpegjax.sharding import make_mesh


def make_batch(rows=16, length=24, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 128, size=rng.integers(2, 6))) for _ in range(rows)]
    responses = [list(rng.integers(1, 128, size=rng.integers(1, length - 6))) for _ in range(rows)]
    return pack_rollouts(prompts, responses, pad_id=0, length=length)


@pytest.mark.parametrize("sharded", [False, True])
def test_micro_batched_log_probs_equal_the_whole_batch(tiny_model, sharded):
    mesh = make_mesh({"fsdp": 4, "tensor": 2}) if sharded else None
    learner = GRPOLearner(GRPOConfig(group_size=4), tiny_model, mesh=mesh)
    batch = make_batch()
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.token_mask)
    if sharded:
        tokens, mask = jax.device_put(tokens, learner.rows), jax.device_put(mask, learner.rows)

    def run(micro_batches):
        return jax.jit(lambda p, t, m: map_micro_batches(lambda t, m: learner.logprobs_fn(p, t, m), micro_batches, t, m,
                                                         sharding=learner.rows))(learner.params, tokens, mask)

    whole = np.asarray(run(1))
    for micro_batches in (2, 4) if sharded else (2, 4, 16):
        got = run(micro_batches)
        # matmuls of another row count may round differently: a few float32 ulps of log-probs around -6
        np.testing.assert_allclose(np.asarray(got), whole, rtol=1e-6, atol=1e-6)
    if sharded:  # rows stay where they were: each micro-batch over all 4 row shards
        assert got.sharding.is_equivalent_to(learner.rows, 2)


def test_micro_batches_fit_the_rows_and_the_budget():
    cfg = ModelConfig.tiny()
    per_row = forward_bytes_per_row(cfg, 64, logprob_chunk=32)
    fixed = forward_fixed_bytes(cfg)
    plan = InferenceMicroBatching(rows=4)
    assert plan.micro_batches(16, 64, cfg, logprob_chunk=32) == 4
    assert plan.micro_batches(6, 64, cfg, logprob_chunk=32) == 2  # at most 4 rows: 3 divide 6
    assert InferenceMicroBatching(rows=12).micro_batches(24, 64, cfg, logprob_chunk=32, shards=8) == 3  # 8 rows each
    with pytest.raises(ValueError, match=r"no micro-batch of at most 4 rows splits 16 rows into equal parts over 8 row "
                                         r"shards; give InferenceMicroBatching.rows as a multiple of 8"):
        plan.micro_batches(16, 64, cfg, logprob_chunk=32, shards=8)
    assert InferenceMicroBatching().micro_batches(16, 64, cfg, logprob_chunk=32) == 1
    # a budget of 3 rows per device over 2 devices: 6 rows a micro-batch at most, so 4 of 4 rows (even over devices)
    budget = InferenceMicroBatching(memory_gib=(fixed + 3.5 * per_row) / GIB)
    assert budget.micro_batches(16, 64, cfg, logprob_chunk=32, shards=2) == 4
    assert budget.micro_batches(16, 64, cfg, logprob_chunk=32, shards=1) == 8
    with pytest.raises(ValueError, match=r"8 rows per micro-batch \(4 per device\) of 64 tokens need an estimated"):
        InferenceMicroBatching(rows=8, memory_gib=(fixed + 3.5 * per_row) / GIB).micro_batches(16, 64, cfg, logprob_chunk=32, shards=2)


def test_a_row_that_does_not_fit_the_budget_is_refused_with_the_estimate_and_the_budget():
    cfg = ModelConfig.qwen2p5("7b")
    plan = InferenceMicroBatching(memory_gib=1.0)
    with pytest.raises(ValueError, match=r"ref: one row of 16384 tokens needs an estimated \d+\.\d+ GiB per device "
                                         r"\(\d+\.\d+ per row \+ \d+\.\d+ of gathered weights\), more than the "
                                         r"memory budget of 1.0 GiB"):
        plan.micro_batches(8, 16384, cfg, logprob_chunk=256, where="ref")


@pytest.mark.parametrize("field, value", [("rows", 0), ("rows", True), ("memory_gib", 0.0), ("memory_gib", -1.0)])
def test_bad_micro_batching_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"InferenceMicroBatching.{field}"):
        InferenceMicroBatching(**{field: value})
    with pytest.raises(ValueError, match=f"GRPOConfig: InferenceMicroBatching.{field}"):
        GRPOConfig(group_size=2, **{f"inference_{field}": value})


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_the_estimate_bounds_what_xla_allocates_for_one_row(attention):
    """The budget check must not let through a row XLA would need more for: estimate >= compiled temporaries
    (and not wildly above them, or budgets would waste memory)."""
    cfg = ModelConfig.tiny(vocab_size=512, attention=attention, attention_block_size=32, scan_layers=True)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    length, chunk = 256, 64
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, length), jnp.bool_)
    forward = jax.jit(lambda s, t, m: sequence_logprobs(nnx.merge(graphdef, s), t, m, chunk_size=chunk))
    measured = forward.lower(state, tokens, mask).compile().memory_analysis().temp_size_in_bytes
    estimate = forward_bytes_per_row(cfg, length, logprob_chunk=chunk) + forward_fixed_bytes(cfg)
    assert measured <= estimate <= 4 * measured, (measured, estimate)
