"""The reward runner: values, errors, timeouts (a hanging function must not hang it), async submit."""

import concurrent.futures
import sys
import time
import types

import numpy as np
import pytest
import reward_fns_for_tests as fns

from rpegjax.data.example import Example
from rpegjax.rewards.math import math_reward
from rpegjax.rewards.runner import Isolation, ResourceLimits, RewardRunner, RewardRunnerConfig, RewardStats
from rpegjax.rewards.tasks import make_task

EXAMPLE = Example(id="e", prompt="q", answer="1/2", task="math")


def runner(fn, isolation, timeout_s=0.5, workers=2):
    return RewardRunner(fn, RewardRunnerConfig(timeout_s=timeout_s, workers=workers, isolation=isolation))


@pytest.mark.parametrize("isolation", list(Isolation))
def test_values_in_order(isolation):
    texts = [f"x{'y' * i}" for i in range(23)]
    with runner(fns.text_length, isolation, timeout_s=30, workers=3) as reward_runner:
        rewards, stats = reward_runner.score(texts, [EXAMPLE] * len(texts))
        empty, empty_stats = reward_runner.score([], [])
    assert rewards.dtype == np.float32
    np.testing.assert_array_equal(rewards, [fns.text_length(t, EXAMPLE) for t in texts])
    assert stats.count == 23 and stats.errors == 0 and stats.timeouts == 0
    assert stats.mean_reward == pytest.approx(np.mean([len(t) for t in texts]))
    assert empty.shape == (0,) and empty_stats.count == 0


@pytest.mark.parametrize("isolation", list(Isolation))
def test_errors_and_timeouts_give_zero_and_are_counted(isolation):
    texts = ["ok", "raise", "none", "nan", "string", "ok", "hang", "ok"]
    if isolation is Isolation.PROCESS:
        texts.append("die")  # a worker process that exits is replaced; a thread's os._exit would end pytest
    timeout_s = 0.5
    with runner(fns.misbehave, isolation, timeout_s=timeout_s) as reward_runner:
        reward_runner.score(["ok"] * 2, [EXAMPLE] * 2)  # warm: workers started
        start = time.monotonic()
        rewards, stats = reward_runner.score(texts, [EXAMPLE] * len(texts))
        elapsed = time.monotonic() - start
        again, again_stats = reward_runner.score(["ok"] * 4, [EXAMPLE] * 4)  # the runner still works
        _, raised = reward_runner.score(["raise"], [EXAMPLE])
    assert raised.errors == 1 and raised.first_error == "RuntimeError: deliberate failure"
    expected = [1.0 if t == "ok" else 0.0 for t in texts]
    np.testing.assert_array_equal(rewards, expected)
    assert stats.timeouts == 1
    assert stats.errors == len(texts) - 4  # everything but the three "ok" and the "hang"
    assert stats.first_error  # the first failure in time; which one depends on scheduling
    assert timeout_s <= elapsed < timeout_s + 3.0  # the hang cost one timeout, not an hour
    np.testing.assert_array_equal(again, [1.0] * 4)
    assert again_stats.errors == again_stats.timeouts == 0
    metrics = stats.metrics()
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/error_fraction"] == stats.errors / len(texts)


def test_math_reward_in_processes_survives_a_hostile_power():
    texts = ["\\boxed{0.5}", "\\boxed{9^{9^{9}}}", "1/2", "0.3"]
    with runner(math_reward, Isolation.PROCESS, timeout_s=1.5) as reward_runner:
        rewards, stats = reward_runner.score(texts, [EXAMPLE] * len(texts))
    np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0, 0.0])
    assert stats.timeouts == 1 and stats.errors == 0


def test_unparsable_gold_counts_as_an_error_not_a_reward():
    bad = Example(id="bad", prompt="q", answer="{", task="math", source="train.jsonl:3")
    with runner(math_reward, Isolation.THREAD, timeout_s=10.0) as reward_runner:
        rewards, stats = reward_runner.score(["{", "\\boxed{1}"], [bad, bad])
    np.testing.assert_array_equal(rewards, [0.0, 0.0])
    assert stats.errors == 2 and "train.jsonl:3" in stats.first_error


def test_submit_overlaps_with_the_caller():
    with runner(fns.slow, Isolation.THREAD, timeout_s=5.0, workers=1) as reward_runner:
        start = time.monotonic()
        first = reward_runner.submit(["a", "b"], [EXAMPLE] * 2)
        second = reward_runner.submit(["c"], [EXAMPLE])
        submitted = time.monotonic() - start
        assert isinstance(first, concurrent.futures.Future)
        assert submitted < 0.2 and not first.done()  # scoring takes >= 0.4 s
        (rewards, stats), (rewards_2, _) = first.result(timeout=10), second.result(timeout=10)
    np.testing.assert_array_equal(rewards, [1.0, 1.0])
    np.testing.assert_array_equal(rewards_2, [1.0])
    assert isinstance(stats, RewardStats) and stats.seconds >= 0.4


def test_for_task_uses_the_task_isolation():
    task = make_task("arithmetic")
    examples = task.eval_examples(8, seed=0)
    with RewardRunner.for_task(task) as reward_runner:
        assert reward_runner.config.isolation is Isolation.THREAD
        rewards, stats = reward_runner.score([task.reference_solution(e) for e in examples], examples)
    assert rewards.tolist() == [1.0] * 8 and stats.errors == 0


def test_bad_functions_and_inputs_fail_clearly():
    with pytest.raises(TypeError, match="cannot be sent to a worker process"):
        RewardRunner(lambda text, example: 1.0, RewardRunnerConfig(isolation="process"))
    # Picklable here, but its module exists only in this interpreter: the worker reports it.
    module = types.ModuleType("rpegjax_only_in_this_process")
    exec("def reward(text, example):\n    return 1.0", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with RewardRunner(module.reward, RewardRunnerConfig(isolation="process", workers=1)) as reward_runner:
            with pytest.raises(RuntimeError, match="could not load the reward function.*rpegjax_only_in_this_process"):
                reward_runner.score(["x"], [EXAMPLE])
    finally:
        del sys.modules[module.__name__]
    with runner(fns.text_length, Isolation.THREAD) as reward_runner:
        with pytest.raises(ValueError, match="2 texts but 1 examples"):
            reward_runner.score(["a", "b"], [EXAMPLE])
        with pytest.raises(TypeError, match=r"texts\[1\] is int"):
            reward_runner.score(["a", 3], [EXAMPLE, EXAMPLE])
        with pytest.raises(TypeError, match=r"examples\[0\] is dict"):
            reward_runner.score(["a"], [{"answer": "1"}])
    with pytest.raises(RuntimeError, match="after close"):
        reward_runner.submit(["a"], [EXAMPLE])


@pytest.mark.parametrize(
    "field, value",
    [("timeout_s", 0), ("timeout_s", float("inf")), ("workers", 0), ("workers", 1.5), ("isolation", "fork")],
)
def test_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field if field != "isolation" else "fork"):
        RewardRunnerConfig(**{field: value})


@pytest.mark.parametrize("isolation", list(Isolation))
def test_a_reward_float32_cannot_hold_is_an_error_not_inf(isolation):
    with runner(fns.huge, isolation, timeout_s=30) as reward_runner:
        rewards, stats = reward_runner.score(["huge", "ok"], [EXAMPLE] * 2)
    np.testing.assert_array_equal(rewards, [0.0, 1.0])
    assert stats.errors == 1 and stats.nonfinite == 1 and stats.metrics()["reward/nonfinite"] == 1.0
    assert "1e+300" in stats.first_error and "float32" in stats.first_error


def test_worker_processes_are_limited_and_a_limit_is_a_failed_reward():
    limits = ResourceLimits(memory_mb=1024, cpu_s=1)
    config = RewardRunnerConfig(timeout_s=20, workers=1, isolation=Isolation.PROCESS, limits=limits)
    with RewardRunner(fns.hog, config) as reward_runner:
        rewards, stats = reward_runner.score(["memory", "ok", "cpu", "ok"], [EXAMPLE] * 4)
    np.testing.assert_array_equal(rewards, [0.0, 1.0, 0.0, 1.0])
    assert stats.errors == 2 and stats.timeouts == 0  # the CPU limit (1 s) ends the loop, not the timeout (20 s)
    assert "MemoryError" in stats.first_error
    with pytest.raises(ValueError, match="ResourceLimits.memory_mb must be a positive integer or None, got 0"):
        ResourceLimits(memory_mb=0)


@pytest.mark.parametrize("how", ["garbage", "huge-header", "half-frame", "forged", "bad-answer", "close"])
def test_a_reward_that_breaks_its_worker_pipe_fails_that_call_and_the_run_goes_on(how):
    """Writing into the worker's pipe, or closing it, must not hang or crash the runner: the call fails
    (an error, or a timeout when the written frame never completes), the worker is replaced, scoring goes on."""
    texts = ["ok", how, "ok", "ok"]
    with runner(fns.channel_breaker, Isolation.PROCESS, timeout_s=3.0, workers=1) as reward_runner:
        start = time.monotonic()
        rewards, stats = reward_runner.score(texts, [EXAMPLE] * len(texts))
        elapsed = time.monotonic() - start
        again, again_stats = reward_runner.score(["ok"] * 3, [EXAMPLE] * 3)
        restarts = reward_runner.restarts
    assert rewards[0] == 1.0 and rewards[1] == 0.0
    assert stats.errors + stats.timeouts >= 1 and stats.first_error
    assert restarts >= 1 and elapsed < 30
    np.testing.assert_array_equal(again, [1.0] * 3)
    assert again_stats.errors == again_stats.timeouts == 0
