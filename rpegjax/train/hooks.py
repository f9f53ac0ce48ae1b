"""The trainer's side jobs as hooks: after each training step the trainer runs a list of hooks in order, each
when its period says so (levanter-style `every N steps`, plus the few steps a job also or never runs at).

A hook is a `Hook(name, run, period)`: `run(info)` reads the finished step (`StepInfo`: its number, result,
state and the metrics record being built) and may add to the record; the hooks after it see what it added (the
metrics hook writes the record the earlier hooks filled). The trainer's list, in order: adapter versions,
step timing, samples, evaluation, non-finite check, metrics, reward errors, progress, checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from rpegjax.runtime.controller import StepResult
from rpegjax.train.health import NonFiniteGuard
from rpegjax.train.metrics import MetricsWriter


@dataclasses.dataclass(frozen=True, kw_only=True)
class Period:
    """When a hook runs, by steps completed: every `every` steps (0: never by period), also at the steps in
    `also`, never at the steps in `skip`."""

    every: int = 1
    also: frozenset[int] = frozenset()
    skip: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"Period.every must be an integer >= 0, got {self.every!r}")

    def due(self, step: int) -> bool:
        if step in self.skip:
            return False
        return step in self.also or (self.every > 0 and step % self.every == 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInfo:
    """A finished training step as the hooks see it: `step` steps are complete (numbered from 1), `record` the
    metrics record of that step that the hooks fill before the metrics hook writes it."""

    step: int
    result: StepResult
    state: Any
    record: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hook:
    name: str
    run: Callable[[StepInfo], None]
    period: Period = Period()


def run_hooks(hooks: Sequence[Hook], result: StepResult, state: Any) -> StepInfo:
    """Runs the due hooks of `hooks` in order after `result`'s step; returns what they saw."""
    info = StepInfo(step=result.step + 1, result=result, state=state, record=dict(result.metrics))
    for hook in hooks:
        if hook.period.due(info.step):
            hook.run(info)
    return info


class Console:
    """The run's messages and its progress bar: lines are printed above the bar, which is drawn again below."""

    def __init__(self, log: Callable[[str], None], progress: Any):
        self.log = log
        self.progress = progress

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.progress.clear()
        try:
            yield
        finally:
            self.progress.refresh()


class AdapterVersions:
    """With LoRA, the adapters of the weights versions generation may still read (a copy per step, small):
    checkpoints save those instead of generation copies of the whole model. Keeps the last `async_bound` + 1."""

    def __init__(self, async_bound: int):
        self.async_bound = async_bound
        self.versions: dict[int, Any] = {}

    def keep(self, version: int, params: Any) -> None:
        self.versions[version] = jax.tree.map(jnp.copy, params)

    def __call__(self, info: StepInfo) -> None:
        self.keep(info.step, info.state.params)
        for old in [v for v in self.versions if v < info.step - self.async_bound]:
            del self.versions[old]


class StepTimer:
    """Adds `seconds` (wall time since the previous step ended) and `tokens_per_second` to each record."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, info: StepInfo) -> None:
        now = time.perf_counter()
        info.record["seconds"] = now - self.started
        info.record["tokens_per_second"] = info.result.metrics["tokens"] / max(now - self.started, 1e-9)
        self.started = now


class NonFiniteCheck:
    """Counts steps with non-finite watched metrics (`nonfinite_steps` in each record); says which; the guard
    stops the run past `train.max_nonfinite_steps`."""

    def __init__(self, tolerated: int, console: Console):
        self.guard = NonFiniteGuard(tolerated)
        self.console = console

    def __call__(self, info: StepInfo) -> None:
        bad = self.guard.observe(info.step, info.record)
        if bad:
            self.console.log(f"step {info.step}: non-finite {', '.join(bad)} ({self.guard.count} such steps; "
                             f"train.max_nonfinite_steps={self.guard.tolerated})")
        info.record["nonfinite_steps"] = self.guard.count


def metrics_hook(metrics: MetricsWriter) -> Hook:
    return Hook(name="metrics", run=lambda info: metrics.log(info.step, info.record))


def reward_errors_hook(last_error: Callable[[], str], console: Console) -> Hook:
    """Says when a reward function failed on some completions of the step (they are scored 0)."""
    def report(info: StepInfo) -> None:
        errors = info.record.get("reward/errors", 0)
        if last_error() and errors > 0:
            console.log(f"step {info.step}: reward function failed on {int(errors)} completions (scored 0): "
                        f"{last_error()}")

    return Hook(name="reward errors", run=report)


def progress_hook(console: Console) -> Hook:
    def advance(info: StepInfo) -> None:
        record = info.record
        console.progress.update(1)
        console.progress.set_postfix(reward=f"{record.get('reward', 0):.3f}", acc=f"{record.get('accuracy', 0):.3f}",
                                     tok_s=f"{record['tokens_per_second']:.0f}", stale=int(record["staleness"]))

    return Hook(name="progress", run=advance)
