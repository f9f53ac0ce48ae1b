"""Run reward functions under a timeout, off the training thread, without ever stopping training.

A reward function is `fn(text, example) -> float`, or a `TermedReward` (`rpegjax.rewards.scoring`) scored
term by term (a user's weighted sum: a failing term adds 0 and is counted in its `TermStats`, the other terms
keep their scores). `RewardRunner.score` applies it to a batch of completions; a call that raises, returns a
non-finite or non-numeric value, kills its worker, breaks its worker's pipe (writes into it, closes it: see
`rpegjax.rewards.channel`), or runs past `timeout_s` gives reward 0 and is counted (`RewardStats.errors`,
`.timeouts`); a broken worker is replaced. `submit` does the same on a background thread and returns a
`Future`, so the runtime can check rewards while the device works.

Why two isolations. Python threads cannot be killed, so a function that may hang (user code, SymPy on a
hostile `9^{9^{9}}`, whose big-integer power does not even return to the interpreter for a signal) runs in
`Isolation.PROCESS`: worker processes (fresh interpreters, see `rpegjax.rewards.workers`) fed over socket pipes; a worker
past its deadline is killed and a fresh one started, so a hang costs one timeout and one process start,
never the run. (Never forked: forking a process that runs JAX's threads is unsafe.) The built-in tasks'
verifiers are cheap, bounded pure-Python checks, so they use `Isolation.THREAD`: daemon threads in this
process, no process start and no pickling of the function; a call past its deadline is still scored 0 and
its thread is abandoned (it cannot be stopped, and is replaced), which is acceptable only for code that
cannot hang. Both isolations share one dispatcher: items go in chunks to idle workers, which answer item
by item (a batched reward's chunk at once, with `timeout_s` per item), and `multiprocessing.connection.wait`
on the workers' pipes wakes it for an answer or the nearest deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import pickle
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jaxtyping import Float

from rpegjax.data.example import Example
from rpegjax.rewards.channel import ChannelBroken
from rpegjax.rewards.scoring import NonFiniteReward, RewardFn, TermedReward, TermScores, checked_reward
from rpegjax.rewards.workers import Isolation, ResourceLimits, Worker, stop_all

__all__ = ["Isolation", "NonFiniteReward", "ResourceLimits", "RewardFn", "RewardRunner", "RewardRunnerConfig",
           "RewardStats", "TermStats", "checked_reward", "merge_terms", "term_metrics"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardRunnerConfig:
    """`timeout_s`: seconds one reward call may take; `workers`: calls run concurrently;
    `start_timeout_s`: seconds a worker process may take to start (interpreter and imports);
    `limits`: memory and CPU limits of worker processes (`Isolation.PROCESS`)."""

    timeout_s: float = 10.0
    workers: int = 2
    isolation: Isolation = Isolation.PROCESS
    start_timeout_s: float = 120.0
    limits: ResourceLimits = dataclasses.field(default_factory=ResourceLimits)

    def __post_init__(self) -> None:
        object.__setattr__(self, "isolation", Isolation(self.isolation))
        if not isinstance(self.limits, ResourceLimits):
            raise ValueError(f"RewardRunnerConfig.limits must be a ResourceLimits, got {self.limits!r}")
        for name in ("timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"RewardRunnerConfig.{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"RewardRunnerConfig.workers must be a positive integer, got {self.workers!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TermStats:
    """One term of a `TermedReward` over a batch: the sum and number of its successful (unweighted) scores,
    and how many of its calls failed (each such failure added 0 to its completion's reward)."""

    name: str
    total: float = 0.0
    scored: int = 0
    errors: int = 0

    def add(self, other: TermStats) -> TermStats:
        return TermStats(name=self.name, total=self.total + other.total, scored=self.scored + other.scored,
                         errors=self.errors + other.errors)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardStats:
    """What happened while scoring one batch. `first_error` is the first failure's message ('' if none).
    `errors` counts completions whose reward failed, wholly or in one of its terms; `terms` holds each term
    of a `TermedReward` (empty for a plain function)."""

    count: int
    errors: int
    timeouts: int
    mean_reward: float
    seconds: float
    first_error: str = ""
    nonfinite: int = 0  # of the errors: calls that returned NaN, inf or a value float32 cannot hold
    terms: tuple[TermStats, ...] = ()

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat metrics for the logger; errors and timeouts also as fractions of the batch; each term's
        mean and errors (`term_metrics`)."""
        count = max(self.count, 1)
        return {
            f"{prefix}mean": self.mean_reward,
            f"{prefix}errors": float(self.errors),
            f"{prefix}timeouts": float(self.timeouts),
            f"{prefix}nonfinite": float(self.nonfinite),
            f"{prefix}error_fraction": self.errors / count,
            f"{prefix}timeout_fraction": self.timeouts / count,
            f"{prefix}seconds": self.seconds,
            **term_metrics([self], prefix),
        }


def merge_terms(batches: Iterable[Sequence[TermStats]]) -> tuple[TermStats, ...]:
    """The terms of several batches (of the same reward) added up, term by term."""
    merged: dict[str, TermStats] = {}
    for terms in batches:
        for term in terms:
            merged[term.name] = merged[term.name].add(term) if term.name in merged else term
    return tuple(merged.values())


def term_metrics(stats: Sequence[RewardStats], prefix: str = "reward/") -> dict[str, float]:
    """`reward/<term>`: the term's mean unweighted score over the calls that succeeded (left out when none
    did), and `reward/<term>/errors`: its failed calls, as TRL logs each reward function."""
    metrics = {}
    for term in merge_terms(batch.terms for batch in stats):
        if term.scored:
            metrics[f"{prefix}{term.name}"] = term.total / term.scored
        metrics[f"{prefix}{term.name}/errors"] = float(term.errors)
    return metrics


class _BatchScores:
    """What the dispatcher learns while scoring one batch, folded into rewards and `RewardStats` at the end."""

    def __init__(self, size: int, term_names: tuple[str, ...]) -> None:
        self.rewards = np.zeros(size, np.float32)
        self.errors = self.timeouts = self.nonfinite = 0
        self.first_error = ""
        self.term_names = term_names
        self.term_totals = np.zeros(len(term_names), np.float64)
        self.term_scored = np.zeros(len(term_names), np.int64)
        self.term_errors = np.zeros(len(term_names), np.int64)

    def fail(self, message: str, *, timeout: bool = False, nonfinite: bool = False) -> None:
        self.timeouts += timeout
        self.errors += not timeout
        self.nonfinite += nonfinite
        self.first_error = self.first_error or message

    def answer(self, index: int, status: object, value: object) -> None:
        """Records a worker's answer for item `index`; ValueError when it is not a valid answer."""
        if status == "ok" and isinstance(value, (int, float)) and not isinstance(value, bool):
            self.rewards[index] = value
        elif status in ("error", "nonfinite") and isinstance(value, str):
            self.fail(value, nonfinite=status == "nonfinite")
        elif status == "terms" and self.term_names:
            scores = TermScores.from_message(value, len(self.term_names))
            self.rewards[index] = scores.total
            failed = [error for error in scores.errors if error]
            if failed:
                self.fail(failed[0], nonfinite=scores.nonfinite > 0)
            for term, (score, error) in enumerate(zip(scores.values, scores.errors)):
                self.term_errors[term] += bool(error)
                if score is not None and not error:
                    self.term_totals[term] += score
                    self.term_scored[term] += 1
        else:
            raise ValueError(f"not an answer: {[index, status, value]!r:.120}")

    def stats(self, seconds: float) -> RewardStats:
        terms = tuple(TermStats(name=name, total=float(total), scored=int(scored), errors=int(errors))
                      for name, total, scored, errors in zip(self.term_names, self.term_totals, self.term_scored,
                                                             self.term_errors))
        return RewardStats(count=len(self.rewards), errors=self.errors, timeouts=self.timeouts,
                           mean_reward=float(self.rewards.mean()) if len(self.rewards) else 0.0, seconds=seconds,
                           first_error=self.first_error, nonfinite=self.nonfinite, terms=terms)


class RewardRunner:
    """Scores completions with `fn` under `config`'s timeout and isolation (see the module docstring).

    `fn` is a reward function `fn(text, example) -> float` or a `TermedReward` (scored term by term, each
    term's mean and errors in `RewardStats.terms`). Use as a context manager or call `close()`; process
    workers are started at construction so their start-up overlaps whatever the caller does next.
    """

    def __init__(self, fn: RewardFn | TermedReward, config: RewardRunnerConfig | None = None) -> None:
        self.config = config if config is not None else RewardRunnerConfig()
        if not callable(fn) and not isinstance(fn, TermedReward):
            raise TypeError(f"RewardRunner needs a callable reward function, got {fn!r}")
        self._fn = fn
        self._terms = tuple(fn.term_names) if isinstance(fn, TermedReward) else ()
        self._batched = isinstance(fn, TermedReward) and fn.batched
        self._payload = b""  # what each worker process receives: the pickled function
        if self.config.isolation is Isolation.PROCESS:
            try:
                self._payload = pickle.dumps(fn)
            except Exception as error:
                raise TypeError(
                    f"reward function {fn!r} cannot be sent to a worker process ({error}); use a module-level "
                    "function or a picklable object, or Isolation.THREAD for trusted in-process verifiers"
                ) from None
        self._workers = [self._start_worker() for _ in range(self.config.workers)]
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rpegjax-reward")
        self._closed = False
        self.restarts = 0  # workers replaced after a timeout, a death or a broken pipe
        # Workers are stopped even if close() is never called (garbage collection or interpreter exit).
        self._finalizer = weakref.finalize(self, stop_all, self._workers)

    @classmethod
    def for_task(cls, task: Any, *, timeout_s: float = 10.0, workers: int = 2,
                 limits: ResourceLimits | None = None) -> RewardRunner:
        """A runner for `task.reward` with the isolation the task asks for (`task.isolation`)."""
        config = RewardRunnerConfig(timeout_s=timeout_s, workers=workers, isolation=task.isolation,
                                    limits=limits if limits is not None else ResourceLimits())
        return cls(task.reward, config)

    def _start_worker(self) -> Worker:
        return Worker(self._fn, self.config.isolation, self._payload, self.config.limits)

    def submit(self, texts: Sequence[str], examples: Sequence[Example]) -> concurrent.futures.Future:
        """Score in the background; the future holds `(rewards float32 [b], RewardStats)`.

        Batches are scored one after another in submission order.
        """
        if self._closed:
            raise RuntimeError("RewardRunner.submit called after close()")
        texts, examples = list(texts), list(examples)
        if len(texts) != len(examples):
            raise ValueError(f"RewardRunner: {len(texts)} texts but {len(examples)} examples")
        for index, (text, example) in enumerate(zip(texts, examples)):
            if not isinstance(text, str):
                raise TypeError(f"RewardRunner: texts[{index}] is {type(text).__name__}, expected str")
            if not isinstance(example, Example):
                raise TypeError(f"RewardRunner: examples[{index}] is {type(example).__name__}, expected Example")
        return self._executor.submit(self._score_batch, texts, examples)

    def score(self, texts: Sequence[str], examples: Sequence[Example]) -> tuple[Float[np.ndarray, "b"], RewardStats]:
        """Rewards `fn(texts[i], examples[i])` as float32 `[b]`, 0 where a call failed or timed out."""
        return self.submit(texts, examples).result()

    def _retire(self, position: int, todo: collections.deque[int], *, whole_chunk: bool = False) -> list[int]:
        """Kill and replace a worker; returns the items it was running (the first pending one, or all of a
        batched chunk when `whole_chunk`), and puts the others back at the front of `todo`."""
        worker = self._workers[position]
        running = [] if not worker.pending else list(worker.pending) if whole_chunk else [worker.pending.popleft()]
        if not whole_chunk:
            todo.extendleft(reversed(worker.pending))
        worker.kill()
        self._workers[position] = self._start_worker()
        self.restarts += 1
        return running

    def _dispatch(self, texts: list[str], examples: list[Example], todo: collections.deque[int]) -> None:
        """Sends chunks to idle workers, each about 1/(2 x workers) of what is left (large chunks save round
        trips, shrinking ones balance the load)."""
        for worker in self._workers:
            if worker.ready and not worker.pending and todo:
                size = -(-len(todo) // (2 * len(self._workers)))
                chunk = [todo.popleft() for _ in range(size)]
                timeout_s = self.config.timeout_s * (len(chunk) if self._batched else 1)
                try:
                    worker.send([(i, texts[i], examples[i]) for i in chunk], timeout_s)
                except OSError:  # a worker that stopped reading; the deadline check retires it
                    worker.pending.extend(chunk)
                    worker.deadline = time.monotonic()

    def _read(self, position: int, scores: _BatchScores, todo: collections.deque[int]) -> None:
        """Takes what worker `position` sent; a closed or broken pipe fails its running item(s) and replaces it."""
        worker = self._workers[position]
        messages, broken = worker.reader.read()
        try:
            for message in messages:
                if message[0] == "ready" and len(message) == 1 and not worker.ready:
                    worker.ready = True
                elif message[0] == "failed" and not worker.ready:
                    raise RuntimeError(
                        f"reward worker could not load the reward function {self._fn!r}: {message[1]}; it must be "
                        "importable in a fresh interpreter (defined in a module, not in __main__)")
                elif len(message) == 3 and worker.ready:
                    worker.answered(message[0], self.config.timeout_s)
                    try:
                        scores.answer(*message)
                    except ValueError as error:
                        worker.pending.appendleft(message[0])  # the item is failed with the broken worker
                        raise ChannelBroken(str(error)) from None
                else:
                    raise ChannelBroken(f"the worker sent {message!r:.80}, not a message")
            if broken is not None:
                raise broken
        except ChannelBroken as error:
            if not worker.ready:
                raise RuntimeError(
                    f"reward worker failed before it was ready ({error}; {worker.exit_detail()}); the reward "
                    f"function {self._fn!r} must be importable in a fresh interpreter") from None
            detail = worker.exit_detail() if worker.isolation is Isolation.PROCESS else "thread"
            for _ in self._retire(position, todo, whole_chunk=self._batched):
                scores.fail(f"reward worker broke: {error} ({detail}); it was replaced")

    def _score_batch(self, texts: list[str], examples: list[Example]) -> tuple[np.ndarray, RewardStats]:
        """The dispatcher: items go in chunks to idle workers, which answer item by item (a batched reward's
        chunk at once); every call is timed on its own, and `multiprocessing.connection.wait` on the workers'
        pipes wakes it for an answer or the nearest deadline."""
        start = time.monotonic()
        scores = _BatchScores(len(texts), self._terms)
        todo = collections.deque(range(len(texts)))
        timeout_s, start_timeout_s = self.config.timeout_s, self.config.start_timeout_s
        while todo or any(worker.pending for worker in self._workers):
            self._dispatch(texts, examples, todo)
            nearest = min(worker.deadline if worker.ready else worker.started + start_timeout_s for worker in self._workers)
            wait_s = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
            by_reader = {worker.reader: position for position, worker in enumerate(self._workers)}
            for reader in multiprocessing.connection.wait(list(by_reader), timeout=wait_s):
                self._read(by_reader[reader], scores, todo)
            now = time.monotonic()
            for position, worker in enumerate(self._workers):
                if worker.pending and now >= worker.deadline:
                    for _ in self._retire(position, todo, whole_chunk=self._batched):
                        scores.fail(f"reward call exceeded timeout_s={timeout_s}", timeout=True)
                elif not worker.ready and now >= worker.started + start_timeout_s:
                    raise RuntimeError(f"reward worker did not start within start_timeout_s={start_timeout_s}")
        if scores.errors or scores.timeouts:
            _log.warning("reward batch of %d: %d errors, %d timeouts; first: %s", len(texts), scores.errors,
                         scores.timeouts, scores.first_error)
        return scores.rewards, scores.stats(time.monotonic() - start)

    def close(self) -> None:
        """Finish queued batches, then stop the workers."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
