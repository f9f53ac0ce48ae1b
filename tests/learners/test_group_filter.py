"""DAPO's group filter and batch filler on controlled rewards: which groups are kept, how rounds fill the batch,
and what happens at the extra-round cap."""

import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.learners.advantages import grpo_advantages, rloo_advantages
from rpegjax.learners.group_filter import (
    DynamicSamplingConfig,
    DynamicSamplingError,
    GroupBatchFiller,
    informative_groups,
)


def test_informative_groups_are_those_whose_rewards_differ():
    rewards = np.array([1, 1, 1,  0, 1, 0,  0, 0, 0,  0.5, 0.5, 0.25,  -1, -1, -1], np.float32)
    keep = informative_groups(rewards, 3)
    np.testing.assert_array_equal(keep, [False, True, False, True, False])
    # exactly the groups whose GRPO and RLOO advantages are not all zero
    for advantages in (grpo_advantages(jnp.asarray(rewards), 3)[0], rloo_advantages(jnp.asarray(rewards), 3)[0]):
        nonzero = np.abs(np.asarray(advantages)).reshape(-1, 3).max(axis=1) > 0
        np.testing.assert_array_equal(keep, nonzero)


def test_informative_groups_refuse_bad_input():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        informative_groups(np.zeros(6), 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        informative_groups(np.array([0.0, np.nan]), 2)
    with pytest.raises(ValueError, match="one value per sequence"):
        informative_groups(np.zeros((2, 2)), 2)


def _round(pattern: str, start: int) -> tuple[np.ndarray, list[int]]:
    """Rewards of a round of groups of 2 from `pattern` ('k': rewards differ, 'd': all agree), items numbered."""
    rewards = np.concatenate([[0.0, 1.0] if p == "k" else [1.0, 1.0] for p in pattern]).astype(np.float32)
    return rewards, list(range(start, start + len(pattern)))


def test_rounds_fill_the_batch_in_sampling_order_and_discard_the_surplus():
    filler = GroupBatchFiller(4, 2, DynamicSamplingConfig(max_extra_rounds=5))
    filler.add_round(*_round("kddk", 0))
    assert filler.needs_more and filler.kept == [0, 3]
    filler.add_round(*_round("dkdd", 4))
    assert filler.needs_more
    filler.add_round(*_round("kkkd", 8))  # needs one: 8; 9 and 10 are surplus
    assert not filler.needs_more
    filled = filler.finish()
    assert filled.groups == [0, 3, 5, 8] and filled.trained.all()
    assert filled.metrics == {
        "dynamic_sampling/rounds": 3.0, "dynamic_sampling/extra_rounds": 2.0, "dynamic_sampling/sampled_groups": 12.0,
        "dynamic_sampling/dropped_groups": 6.0, "dynamic_sampling/kept_groups": 4.0,
        "dynamic_sampling/surplus_groups": 2.0, "dynamic_sampling/filler_groups": 0.0, "dynamic_sampling/cap_hit": 0.0}


def test_at_the_cap_the_batch_trains_on_what_was_found_and_says_so():
    filler = GroupBatchFiller(4, 2, DynamicSamplingConfig(max_extra_rounds=1))
    filler.add_round(*_round("dkdd", 0))
    filler.add_round(*_round("ddkd", 4))
    assert not filler.needs_more  # one extra round allowed, spent
    filled = filler.finish()
    assert filled.groups == [1, 6, 0, 2]  # the kept ones, then dropped ones as filler
    np.testing.assert_array_equal(filled.trained, [True, True, False, False])
    assert filled.metrics["dynamic_sampling/cap_hit"] == 1.0
    assert filled.metrics["dynamic_sampling/filler_groups"] == 2.0
    assert filled.metrics["dynamic_sampling/kept_groups"] == 2.0


def test_at_the_cap_an_error_is_raised_when_configured_so():
    filler = GroupBatchFiller(2, 2, DynamicSamplingConfig(max_extra_rounds=0, on_cap="error"), where="step 7: ")
    filler.add_round(*_round("dk", 0))
    with pytest.raises(DynamicSamplingError, match=r"step 7: .*1 of 2 groups.*max_extra_rounds=0"):
        filler.finish()


def test_no_extra_round_is_taken_when_the_first_fills_the_batch():
    filler = GroupBatchFiller(2, 2, DynamicSamplingConfig(max_extra_rounds=3))
    filler.add_round(*_round("kk", 0))
    assert not filler.needs_more
    assert filler.finish().metrics["dynamic_sampling/extra_rounds"] == 0.0


def test_config_and_filler_validate_their_arguments():
    with pytest.raises(ValueError, match="max_extra_rounds must be an integer >= 0"):
        DynamicSamplingConfig(max_extra_rounds=-1)
    with pytest.raises(ValueError, match="on_cap must be one of"):
        DynamicSamplingConfig(on_cap="retry")
    with pytest.raises(ValueError, match="target_groups must be a positive integer"):
        GroupBatchFiller(0, 2, DynamicSamplingConfig())
    filler = GroupBatchFiller(2, 2, DynamicSamplingConfig())
    with pytest.raises(ValueError, match="no round was added"):
        filler.finish()
    with pytest.raises(ValueError, match="2 groups of rewards but 3 items"):
        filler.add_round(np.zeros(4), [0, 1, 2])
    filler.add_round(*_round("kd", 0))
    with pytest.raises(ValueError, match="cap allows more rounds"):
        filler.finish()


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_filler_rows_with_an_empty_response_mask_change_neither_loss_nor_gradient(tiny_model, aggregation):
    """At the cap the batch keeps its shape: filler groups' rows are masked out. The loss and gradient must be
    those of the kept groups alone."""
    import jax

    from rpegjax.learners.batch import pack_rollouts
    from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
    from rpegjax.learners.objective import policy_denominators, update_inputs

    rng = np.random.default_rng(0)
    rows, group = 8, 2
    prompts = [list(rng.integers(1, 128, size=rng.integers(2, 6))) for _ in range(rows)]
    responses = [list(rng.integers(1, 128, size=rng.integers(2, 10))) for _ in range(rows)]
    rewards = np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float32)  # groups 2 and 3 agree: filler
    cfg = GRPOConfig(group_size=group, aggregation=aggregation, clip_high=0.28, entropy_coef=0.01)
    learner = GRPOLearner(cfg, tiny_model)

    @jax.jit
    def value_and_grads(params, batch):
        return jax.value_and_grad(lambda p: learner._loss(p, batch, policy_denominators(cfg, batch))[0])(params)

    def loss_and_grads(batch):
        batch, _ = learner.compute_advantages(batch)
        return value_and_grads(learner.params, update_inputs(batch, cfg))

    full = pack_rollouts(prompts, responses, pad_id=0, length=16, rewards=rewards)
    mask = np.array(full.response_mask)
    mask[4:] = False
    loss, grads = loss_and_grads(full.replace(response_mask=mask))
    kept = pack_rollouts(prompts[:4], responses[:4], pad_id=0, length=16, rewards=rewards[:4])
    kept_loss, kept_grads = loss_and_grads(kept)
    assert float(loss) == pytest.approx(float(kept_loss), abs=1e-6) and float(loss) != 0.0
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(kept_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
