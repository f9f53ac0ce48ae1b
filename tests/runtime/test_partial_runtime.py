"""The runtime with partial rollouts (`Runtime(partial=...)`): the staleness bound per token over whole runs, the
version-lag metrics, and exact resume: a run restarted from a step's carry, data position and weights trains the
same batches as the uninterrupted run."""

import dataclasses

import jax
import numpy as np
import pytest

from rpegjax.data.iterator import DataIterator
from rpegjax.graph.trace import Trace
from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig, StalePolicy
from tiny_setup import TinySetup, built, run_runtime

SETUP = TinySetup(async_bound=1, max_new_tokens=12, chunk_steps=2)
LAG = 3


def _long_tailed(programs) -> None:
    """Stop tokens (a third of the vocabulary): response lengths from 1 to the budget, so groups finish apart."""
    vocab = programs.sampler.cfg.vocab_size
    programs.rollout.sampling = dataclasses.replace(programs.rollout.sampling, stop_ids=tuple(range(1, vocab, 3)))


def _partial(policy=StalePolicy.WAIT, inflight: bool = False) -> PartialRolloutConfig:
    """Weights in flight (`inflight`): the next version once half the groups a step lacks have completed, waiting
    for it (reproducible)."""
    return PartialRolloutConfig(max_token_lag=LAG, stale_policy=policy, inflight_weights=inflight)


@pytest.fixture(scope="module", params=[False, True], ids=["fixed", "inflight"])
def uninterrupted(request):
    """Five steps of the threaded runtime, without and with weights in flight."""
    return run_runtime(SETUP, 5, prepare=_long_tailed, partial=_partial(inflight=request.param))


def _inflight(run) -> bool:
    return run.runtime.partial.inflight_weights


def _assert_same_batches(runs, once_runs) -> None:
    """The same trained sequences, log-probs, versions and rewards, step by step."""
    for again, once in zip(runs, once_runs, strict=True):
        assert again.step == once.step
        assert again.examples == once.examples
        for a, b in zip(again.completions, once.completions, strict=True):
            np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
            np.testing.assert_array_equal(a.token_versions, b.token_versions)
            np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-6)
        np.testing.assert_allclose(again.rewards, once.rewards)


def test_every_trained_token_is_within_the_bound_and_the_lag_is_reported(uninterrupted):
    carried = 0
    for result in uninterrupted.results:
        assert len(result.completions) == SETUP.prompts_per_step * SETUP.group_size
        lags = np.concatenate([result.step - c.versions() for c in result.completions])
        assert lags.max() <= LAG
        assert result.metrics["version_lag/max"] == lags.max()
        assert result.metrics["version_lag/min"] == lags.min()
        if not _inflight(uninterrupted):  # in flight, a step's newest tokens may be of its own version
            assert lags.min() == result.step - result.version  # new tokens
        assert result.metrics["version_lag/mean"] == pytest.approx(lags.mean())
        carried += result.metrics["partial/carried_sequences"]
        assert 0 < result.metrics["generate/slot_occupancy"] <= result.metrics["generate/bucket_occupancy"] <= 1
        # the examples are the batch's, one per group, in row order
        assert len(result.examples) == SETUP.prompts_per_step
    assert carried > 0


def test_resume_from_a_step_trains_the_same_batches(uninterrupted):
    """Interrupted after step 2 (as a checkpoint would keep it: weights, older versions the next rollouts read,
    data position, carry), resumed for steps 3 and 4: the same trained sequences, log-probs and versions."""
    partial = _partial(inflight=_inflight(uninterrupted))
    first = run_runtime(SETUP, 3, prepare=_long_tailed, partial=partial)
    last = first.results[-1]
    history = [(v, p) for v, p in first.runtime.store.items() if v < 3]
    run = built(SETUP)
    rewards = RewardRunner(run.task.reward, RewardRunnerConfig(timeout_s=5.0, workers=1, isolation=run.task.isolation))
    programs = run.programs(rewards)
    _long_tailed(programs)
    data = DataIterator(run.train_examples, batch_size=SETUP.prompts_per_step, seed=0)
    data.restore(last.data_state)
    runtime = Runtime(run.graph, programs, data, prompt_ids=run.prompt_ids, key=jax.random.key(7), trace=Trace(),
                      partial=partial)
    resumed = []
    try:
        runtime.run(first.state, start_step=3, num_steps=2, history=history, carry=last.carry,
                    on_step=lambda result, _: resumed.append(result))
    finally:
        rewards.close()
    _assert_same_batches(resumed, uninterrupted.results[3:])


def test_weights_in_flight_at_a_share_of_the_batch_do_not_depend_on_thread_timing(uninterrupted):
    """With weights in flight once half a step's groups have completed (waiting for them), the threaded run
    (generation beside training) and the inline run (generation after the previous step's training: every version
    already there) train the same batches; tokens of a step's own version are trained, none beyond the bound."""
    if not _inflight(uninterrupted):
        pytest.skip("weights in flight only")
    inline = run_runtime(SETUP, 5, prepare=_long_tailed, partial=_partial(inflight=True), concurrent_rollout=False)
    _assert_same_batches(inline.results, uninterrupted.results)
    assert sum(r.metrics["partial/weight_updates_in_flight"] for r in uninterrupted.results) >= 1
    assert any(c.token_versions.max() == r.step for r in uninterrupted.results[1:] for c in r.completions if c.length)


def test_a_carry_without_partial_rollouts_is_refused(uninterrupted):
    """Resuming a checkpoint's groups in flight without partial rollouts would lose their prompts."""
    carry = uninterrupted.results[-1].carry
    assert carry["groups"], "the run must end with groups in flight"
    run = uninterrupted.run
    data = DataIterator(run.train_examples, batch_size=SETUP.prompts_per_step, seed=0)
    runtime = Runtime(run.graph, run.programs(None), data, prompt_ids=run.prompt_ids, key=jax.random.key(7))
    with pytest.raises(ValueError, match="resume with rollout.partial=true"):
        runtime.run(None, start_step=5, num_steps=1, carry=carry)
