"""Sequence packing: the packer's layout, and packed == unpacked for log-probs, values, losses and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.learners.batch import TrainBatch, pack_rollouts
from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.objective import policy_denominators
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.packing import first_fit_decreasing, pack_batch, plan_packing, unpack_tokens
from rpegjax.learners.ppo import PPOConfig, PPOLearner
from rpegjax.learners.scoring import score_sequences
from rpegjax.learners.trainable import join_frozen
from rpegjax.learners.update import UpdateLayout, split_rows
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.lora import LoRAConfig
from rpegjax.sharding import ShardingRules, make_mesh

LENGTH, BUDGET, TOLERANCE = 32, 40, 1e-5


def make_batch(seed=0, rows=8):
    """Mixed lengths: prompts of 2-5 tokens, responses of 1-24 (two groups of 4)."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 128, size=rng.integers(2, 6))) for _ in range(rows)]
    responses = [list(rng.integers(1, 128, size=rng.integers(1, 25))) for _ in range(rows)]
    behaviour = [rng.normal(-4.8, 0.3, size=len(r)) for r in responses]
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], np.float32)[:rows]
    return pack_rollouts(prompts, responses, behaviour, pad_id=0, length=LENGTH, rewards=rewards)


def test_first_fit_decreasing_fills_bins_in_order():
    np.testing.assert_array_equal(first_fit_decreasing(np.array([3, 7, 5, 2, 4]), 10), [0, 0, 1, 2, 1])
    np.testing.assert_array_equal(first_fit_decreasing(np.array([10, 10]), 10), [0, 1])


@pytest.mark.parametrize("minibatches, shards", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_the_plan_places_every_sequence_once_in_its_minibatch(minibatches, shards):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 30, size=24)
    plan = plan_packing(lengths, 32, minibatches=minibatches, shards=shards)
    assert plan.num_rows % (minibatches * shards) == 0
    sequence, column, real = plan.sources()
    assert real.sum() == lengths.sum()  # every token placed once, rows never overfull
    for k, length in enumerate(lengths):
        here = real & (sequence == k)
        assert here.sum() == length and np.all(here.nonzero()[0] == plan.rows[k])
        np.testing.assert_array_equal(column[here], np.arange(length))
    # split_rows deals packed row r to mini-batch j: it must be the mini-batch of its sequences (k mod M)
    micro = plan.num_rows // (minibatches * shards)
    dealt = split_rows(np.arange(plan.num_rows), UpdateLayout(num_minibatches=minibatches, num_microbatches=micro))
    minibatch_of_row = np.empty(plan.num_rows, int)
    for j in range(minibatches):
        minibatch_of_row[np.asarray(dealt[j]).ravel()] = j
    np.testing.assert_array_equal(minibatch_of_row[plan.rows], np.arange(len(lengths)) % minibatches)
    segments = plan.segment_ids()
    assert segments[~real].max(initial=0) == 0 and segments[real].min() >= 1


@pytest.mark.parametrize("minibatches, shards", [(1, 1), (2, 2)])
def test_narrower_rows_pad_the_fewest_tokens_of_the_bucket_widths(minibatches, shards):
    """A tail batch (one long row, many short): of every width that is a multiple of the bucket (or the budget),
    the plan takes the one padding the fewest tokens, here well under the budget's."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[250], rng.integers(30, 90, size=15)])  # 1,052 tokens: 2 rows of 1,024
    full = plan_packing(lengths, 1024, minibatches=minibatches, shards=shards)
    plan = plan_packing(lengths, 1024, minibatches=minibatches, shards=shards, width_bucket=128)
    padded = {width: plan_packing(lengths, width, minibatches=minibatches, shards=shards).num_rows * width
              for width in (256, 384, 512, 640, 768, 896, 1024)}
    assert plan.num_rows * plan.row_tokens == min(padded.values()) < full.num_rows * full.row_tokens
    assert plan.row_tokens % 128 == 0 and plan.num_rows % (minibatches * shards) == 0
    sequence, _, real = plan.sources()
    assert real.sum() == lengths.sum() and all((real & (sequence == k)).sum() == n for k, n in enumerate(lengths))
    # a batch that fills the budget's rows keeps them
    assert plan_packing(np.full(4, 256), 1024, width_bucket=128).row_tokens == 1024


def test_a_sequence_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="sequence 1 has 50 tokens, more than max_tokens_per_micro_batch=40"):
        plan_packing(np.array([3, 50]), 40)


def test_pack_and_unpack_round_trip():
    batch = make_batch()
    plan = plan_packing(batch.token_mask.sum(-1), BUDGET)
    packed = pack_batch(batch, plan)
    assert packed.tokens.shape == (plan.num_rows, BUDGET) and plan.num_rows < batch.batch_size
    np.testing.assert_array_equal(unpack_tokens(packed.tokens, plan, LENGTH), batch.tokens * batch.token_mask)
    np.testing.assert_array_equal(unpack_tokens(packed.behaviour_logprobs, plan, LENGTH), batch.behaviour_logprobs)
    assert packed.response_mask.sum() == batch.response_mask.sum()


@pytest.mark.parametrize("attention, budget, bucket", [("dense", BUDGET, None), ("blockwise", BUDGET, None),
                                                       ("blockwise", 64, 8)])
def test_packed_scores_equal_unpacked(tiny_model, attention, budget, bucket):
    model = tiny_model.with_execution(attention=attention, attention_block_size=8)
    batch = make_batch()
    plan = plan_packing(batch.token_mask.sum(-1), budget, width_bucket=bucket)
    assert (plan.num_rows, plan.row_tokens) == ((4, 40) if bucket else (4, budget))  # 3 x 64 without the bucket
    packed = pack_batch(batch, plan)
    score = jax.jit(lambda tokens, mask, segments: score_sequences(
        model, tokens, mask, with_entropy=True, with_values=True, segment_ids=segments))
    expected = score(jnp.asarray(batch.tokens), jnp.asarray(batch.token_mask), None)
    ours = score(jnp.asarray(packed.tokens), jnp.asarray(packed.token_mask), jnp.asarray(packed.segment_ids))
    for name in ("logprobs", "entropy", "values"):
        np.testing.assert_allclose(unpack_tokens(np.asarray(getattr(ours, name)), plan, LENGTH),
                                   getattr(expected, name), atol=TOLERANCE, err_msg=name)


def _loss_and_grads(learner, batch):
    """The update's loss, metrics and gradients of one whole-batch step, from the batch the update would take."""
    inputs = jax.tree.map(jnp.asarray, learner._update_inputs(batch))
    denominators = (learner._denominators(inputs) if isinstance(learner, PPOLearner)
                    else policy_denominators(learner.cfg, inputs))

    def loss(params, inputs, denominators):
        return learner._loss(join_frozen(params, learner.frozen), inputs, denominators)

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(learner.params, inputs, denominators)
    return value, metrics, grads


def assert_close(ours, expected, err_msg="", floor=0.1):
    """Within TOLERANCE of the array's scale (its largest entry, at least `floor`): the losses sum terms of both
    signs and the embedding's gradient sums every occurrence of a token, in another order once packed."""
    scale = max(float(np.max(np.abs(expected))), floor)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=TOLERANCE * scale, err_msg=err_msg)


def _assert_same(unpacked, packed, keys):
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = unpacked, packed
    assert_close(loss_b, loss_a, "loss")
    for key in keys:
        assert_close(metrics_b[key], metrics_a[key], key)
    assert max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads_a)) > 0
    jax.tree.map(assert_close, grads_b, grads_a)


GRPO_CASES = {
    "token-mean, KL, entropy, blockwise": dict(aggregation="token-mean", kl_coef=0.1, entropy_coef=0.01),
    "seq-mean-token-mean, sequence TIS": dict(aggregation="seq-mean-token-mean", decoupled=True,
                                              correction="sequence-tis", importance_cap=2.0),
    "seq-mean-token-sum-norm, geometric mask": dict(aggregation="seq-mean-token-sum-norm", max_length=LENGTH,
                                                    decoupled=True, correction="geometric-mask", geometric_low=0.5,
                                                    geometric_high=1.2),
    "gspo": dict(loss="gspo", clip_low=0.01, clip_high=0.01),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_packed_loss_and_gradients_equal_unpacked(tiny_model, case):
    options = dict(group_size=4, **GRPO_CASES[case])
    unpacked = GRPOLearner(GRPOConfig(**options), tiny_model)
    packed_model = tiny_model.with_execution(attention="blockwise", attention_block_size=8) if "blockwise" in case \
        else tiny_model
    packed = GRPOLearner(GRPOConfig(**options, packing=True, max_tokens_per_micro_batch=BUDGET), packed_model)
    batch, _ = unpacked.compute_advantages(make_batch())
    logprobs = np.asarray(unpacked.logprobs(unpacked.params, batch))
    rng = np.random.default_rng(2)
    batch = batch.replace(ref_logprobs=logprobs * 1.01, old_logprobs=logprobs + rng.normal(0, 0.05, logprobs.shape),
                          behaviour_logprobs=logprobs + rng.normal(0, 0.1, logprobs.shape))
    expected = _loss_and_grads(unpacked, batch)
    keys = [k for k in ("policy_loss", "kl_loss", "entropy_loss") if k in expected[1]]
    _assert_same(expected, _loss_and_grads(packed, batch), keys)


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_ppo_packed_loss_and_gradients_equal_unpacked(tiny_model, tiny_critic, critic):
    aggregation = "seq-mean-token-mean" if critic == "shared" else "token-mean"
    options = dict(critic=critic, aggregation=aggregation, kl_coef=0.05)
    critic_model = tiny_critic if critic == "separate" else None
    unpacked = PPOLearner(PPOConfig(**options), tiny_model, critic_model)
    packed = PPOLearner(PPOConfig(**options, packing=True, max_tokens_per_micro_batch=BUDGET), tiny_model, critic_model)
    batch = make_batch(3)
    logprobs = np.asarray(unpacked.logprobs(unpacked.actor_params(unpacked.params), batch))
    values = np.random.default_rng(4).normal(0, 0.5, batch.tokens.shape).astype(np.float32) * batch.token_mask
    batch = batch.replace(ref_logprobs=logprobs * 1.01, old_logprobs=logprobs, values=values)
    batch, _ = unpacked.compute_advantages(batch)
    _assert_same(_loss_and_grads(unpacked, batch), _loss_and_grads(packed, batch), ["policy_loss", "value_loss"])


def test_lora_packed_loss_and_gradients_equal_unpacked():
    model = Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0)).with_lora(LoRAConfig(rank=4, alpha=8.0), seed=1)
    options = dict(group_size=4, kl_coef=0.1)
    unpacked = GRPOLearner(GRPOConfig(**options), model)
    packed = GRPOLearner(GRPOConfig(**options, packing=True, max_tokens_per_micro_batch=BUDGET), model)
    batch, _ = unpacked.compute_advantages(make_batch(5))
    batch = batch.replace(ref_logprobs=np.asarray(unpacked.logprobs(unpacked.reference_params(), batch)) * 1.01)
    _assert_same(_loss_and_grads(unpacked, batch), _loss_and_grads(packed, batch), ["policy_loss", "kl_loss"])


@pytest.mark.parametrize("bucket", [None, 4])
def test_a_packed_update_equals_the_unpacked_one(tiny_model, bucket):
    """Two epochs of two mini-batches: packed rows in token-budget micro-batches (narrower ones with a bucket) step
    the optimiser as unpacked rows."""
    options = dict(group_size=4, kl_coef=0.1, aggregation="seq-mean-token-mean", epochs=2, num_minibatches=2,
                   # steps that change later steps' losses; eps far above float noise in the gradients, so that Adam
                   # does not blow an entry's rounding noise up to a whole step (g / sqrt(v) of a near-zero g)
                   optimizer=OptimizerConfig(learning_rate=1e-2, eps=0.1))
    unpacked = GRPOLearner(GRPOConfig(**options), tiny_model)
    packed = GRPOLearner(GRPOConfig(**options, packing=True, max_tokens_per_micro_batch=LENGTH, length_bucket=bucket),
                         tiny_model)
    batch, _ = unpacked.compute_advantages(make_batch(6))
    logprobs = np.asarray(unpacked.logprobs(unpacked.params, batch))
    batch = batch.replace(ref_logprobs=logprobs * 1.01, old_logprobs=logprobs)
    inputs = packed._update_inputs(batch)
    assert inputs.batch_size > 2 * 2  # several micro-batches per mini-batch
    assert inputs.length == (LENGTH if bucket is None else 28)
    state_a, metrics_a = unpacked.update(unpacked.init_state(), batch)
    state_b, metrics_b = packed.update(packed.init_state(), batch)
    for key in ("loss", "kl_loss", "grad_norm"):
        assert_close(metrics_b[key], metrics_a[key], key)
    jax.tree.map(assert_same_steps, state_b.params, state_a.params, unpacked.params)
    assert packed.update_traces == 1


def assert_same_steps(ours, expected, before):
    """Parameters after the same optimiser steps: within TOLERANCE of the largest step, plus two float32 spacings
    of the parameter itself (a step below that is rounded into the parameter either way)."""
    ours, expected, before = (np.asarray(x, np.float64) for x in (ours, expected, before))
    allowed = TOLERANCE * np.max(np.abs(expected - before)) + 2 * np.spacing(np.abs(expected).astype(np.float32))
    assert np.all(np.abs(ours - expected) <= allowed), float(np.max(np.abs(ours - expected) - allowed))


def test_packing_options_are_checked():
    with pytest.raises(ValueError, match="packing needs max_tokens_per_micro_batch"):
        GRPOConfig(group_size=4, packing=True)
    with pytest.raises(ValueError, match="needs packing=True"):
        GRPOConfig(group_size=4, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="num_microbatches=2 does not apply with packing=True"):
        GRPOConfig(group_size=4, packing=True, max_tokens_per_micro_batch=64, num_microbatches=2)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm' needs max_length"):
        GRPOConfig(group_size=4, packing=True, max_tokens_per_micro_batch=64, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="length_bucket=64 narrows packed rows of max_tokens_per_micro_batch=64"):
        GRPOConfig(group_size=4, packing=True, max_tokens_per_micro_batch=64, length_bucket=64)


def test_a_packed_update_lowers_for_abstract_rows_as_full_rows(tiny_model):
    """The dry run's path: an abstract batch packs as if every row were full (8 rows of 32 -> 4 rows of 64)."""
    learner = GRPOLearner(GRPOConfig(group_size=4, packing=True, max_tokens_per_micro_batch=64), tiny_model)
    per_token = lambda dtype: jax.ShapeDtypeStruct((8, LENGTH), dtype)  # noqa: E731
    batch = TrainBatch(tokens=per_token(jnp.int32), token_mask=per_token(jnp.bool_), response_mask=per_token(jnp.bool_),
                       advantages=jax.ShapeDtypeStruct((8,), jnp.float32))
    inputs = learner._update_inputs(batch)
    assert inputs.tokens.shape == inputs.segment_ids.shape == inputs.advantages.shape == (4, 64)
    assert learner.lower_update(learner.init_state(), batch).compile().memory_analysis() is not None
    small = GRPOLearner(GRPOConfig(group_size=4, packing=True, max_tokens_per_micro_batch=16), tiny_model)
    with pytest.raises(ValueError, match="rows of 32 tokens do not fit max_tokens_per_micro_batch=16"):
        small.lower_update(small.init_state(), batch)


def test_a_sharded_packed_update_equals_the_unsharded_unpacked_one(tiny_model):
    """data 2 x fsdp 2 x tensor 2: packed rows a multiple of the 4 row shards, one per shard per micro-batch."""
    options = dict(group_size=4, kl_coef=0.1, aggregation="seq-mean-token-mean", num_minibatches=2,
                   optimizer=OptimizerConfig(learning_rate=1e-2, eps=0.1))  # eps: see the test above
    unpacked = GRPOLearner(GRPOConfig(**options), tiny_model)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    packed = GRPOLearner(GRPOConfig(**options, packing=True, max_tokens_per_micro_batch=LENGTH), tiny_model, mesh=mesh,
                         rules=ShardingRules.fsdp_tp())
    batch, _ = unpacked.compute_advantages(make_batch(7))
    logprobs = np.asarray(unpacked.logprobs(unpacked.params, batch))
    batch = batch.replace(ref_logprobs=logprobs * 1.01, old_logprobs=logprobs)
    assert packed._update_inputs(batch).batch_size % (2 * 4) == 0
    state_a, metrics_a = unpacked.update(unpacked.init_state(), batch)
    state_b, metrics_b = packed.update(packed.init_state(), batch)
    for key in ("loss", "kl_loss", "grad_norm"):
        assert_close(metrics_b[key], metrics_a[key], key)
    jax.tree.map(assert_same_steps, state_b.params, state_a.params, unpacked.params)
