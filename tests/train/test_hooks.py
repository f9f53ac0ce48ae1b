"""rpegjax.train.hooks: when a side job runs, and in which order the trainer's hooks see a step."""

import pytest

from rpegjax.runtime.controller import StepResult
from rpegjax.train.hooks import AdapterVersions, Hook, Period, run_hooks


def test_a_period_runs_every_n_steps_plus_its_extra_steps_minus_its_skipped_ones():
    assert [s for s in range(1, 11) if Period(every=3).due(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if Period(every=4, also=frozenset({1, 10})).due(s)] == [1, 4, 8, 10]
    assert [s for s in range(1, 11) if Period(every=5, skip=frozenset({10})).due(s)] == [5]
    assert [s for s in range(1, 11) if Period(every=0, also=frozenset({7})).due(s)] == [7]
    with pytest.raises(ValueError, match="Period.every must be an integer >= 0, got -1"):
        Period(every=-1)


def test_hooks_run_in_order_and_see_what_the_earlier_ones_recorded():
    seen = []

    def first(info):
        info.record["added"] = info.step * 10

    hooks = [Hook(name="first", run=first),
             Hook(name="every second", run=lambda info: seen.append(("second", info.step)), period=Period(every=2)),
             Hook(name="last", run=lambda info: seen.append(("last", info.step, info.record["added"],
                                                                 info.record["loss"])))]
    for step in range(3):  # StepResult.step counts from 0; hooks see the steps completed
        run_hooks(hooks, StepResult(step=step, version=step, metrics={"loss": float(step)}, data_state={},
                                    completions=[]), state=None)
    assert seen == [("last", 1, 10, 0.0), ("second", 2), ("last", 2, 20, 1.0), ("last", 3, 30, 2.0)]


def test_adapter_versions_keep_what_generation_may_still_read():
    versions = AdapterVersions(async_bound=1)
    versions.keep(0, {"a": 0.0})

    class State:
        def __init__(self, value):
            self.params = {"a": value}

    for step in (1, 2, 3):
        run_hooks([Hook(name="adapters", run=versions)], StepResult(step=step - 1, version=step - 1, metrics={},
                                                                    data_state={}, completions=[]), State(float(step)))
    assert sorted(versions.versions) == [2, 3] and float(versions.versions[3]["a"]) == 3.0
