"""Run reward functions under a timeout, off the training thread, without ever stopping training.

A reward function is `fn(text, example) -> float`. `RewardRunner.score` applies it to a batch of
completions; a call that raises, returns a non-finite or non-numeric value, kills its worker, or runs past
`timeout_s` gives reward 0 and is counted (`RewardStats.errors`, `.timeouts`). `submit` does the same on a
background thread and returns a `Future`, so the runtime can check rewards while the device works.

Why two isolations. Python threads cannot be killed, so a function that may hang (user code, SymPy on a
hostile `9^{9^{9}}`, whose big-integer power does not even return to the interpreter for a signal) runs in
`Isolation.PROCESS`: worker processes (fresh interpreters, see `_Worker`) fed over socket pipes; a worker
past its deadline is killed and a fresh one started, so a hang costs one timeout and one process start,
never the run. (Never forked: forking a process that runs JAX's threads is unsafe.) The built-in tasks'
verifiers are cheap, bounded pure-Python checks, so they use `Isolation.THREAD`: daemon threads in this
process, no process start and no pickling of the function; a call past its deadline is still scored 0 and
its thread is abandoned (it cannot be stopped, and is replaced), which is acceptable only for code that
cannot hang. Both isolations share one dispatcher: items go in chunks to idle workers, which answer item
by item, and `multiprocessing.connection.wait` on the workers' pipes wakes it for an answer or the
nearest deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxtyping import Float

from rpegjax.data.example import Example

RewardFn = Callable[[str, Example], float]
_log = logging.getLogger(__name__)


class Isolation(enum.StrEnum):
    THREAD = "thread"  # daemon threads in this process: trusted, bounded verifiers (built-in tasks)
    PROCESS = "process"  # worker processes, killed and replaced on timeout: math-verify and user rewards


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResourceLimits:
    """Limits of each worker process (`resource.setrlimit`), so that a reward function cannot take the
    machine down: `memory_mb` caps the process's address space (RLIMIT_AS; an allocation past it raises
    MemoryError, a failed call), `cpu_s` the CPU seconds of one call (RLIMIT_CPU, raised before each call;
    past it the worker is killed by SIGXCPU, a failed call). None: no limit. Threads cannot be limited."""

    memory_mb: int | None = 4096
    cpu_s: int | None = 60

    def __post_init__(self) -> None:
        for name in ("memory_mb", "cpu_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ResourceLimits.{name} must be a positive integer or None, got {value!r}")


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
class RewardStats:
    """What happened while scoring one batch. `first_error` is the first failure's message ('' if none)."""

    count: int
    errors: int
    timeouts: int
    mean_reward: float
    seconds: float
    first_error: str = ""
    nonfinite: int = 0  # of the errors: calls that returned NaN, inf or a value float32 cannot hold

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat metrics for the logger; errors and timeouts also as fractions of the batch."""
        count = max(self.count, 1)
        return {
            f"{prefix}mean": self.mean_reward,
            f"{prefix}errors": float(self.errors),
            f"{prefix}timeouts": float(self.timeouts),
            f"{prefix}nonfinite": float(self.nonfinite),
            f"{prefix}error_fraction": self.errors / count,
            f"{prefix}timeout_fraction": self.timeouts / count,
            f"{prefix}seconds": self.seconds,
        }


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class NonFiniteReward(ValueError):
    """A reward function returned NaN, inf, or a number too large for the float32 rewards (1e300 -> inf)."""


def checked_reward(value: object, who: str = "reward function") -> float:
    """`value` as a float reward: a bool or a number float32 holds finitely; otherwise `TypeError`, or
    `NonFiniteReward` for NaN, inf or a magnitude past float32's, each naming `who`."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{who} returned {type(value).__name__} {value!r:.80}; expected a finite float")
    if not math.isfinite(value) or abs(float(value)) > _FLOAT32_MAX:
        raise NonFiniteReward(f"{who} returned {value!r}; rewards are float32, finite and at most "
                              f"{_FLOAT32_MAX:.3g} in magnitude")
    return float(value)


def _call(fn: RewardFn, text: str, example: Example) -> float:
    return checked_reward(fn(text, example))


def _serve(conn: multiprocessing.connection.Connection, fn: RewardFn,
           before_call: Callable[[], None] = lambda: None) -> None:
    """Worker loop (a worker process's main thread, or a daemon thread): score items until told to stop."""
    try:
        conn.send(("ready",))
        while (chunk := conn.recv()) is not None:
            for index, text, example in chunk:  # one reply per item: the runner times each call
                try:
                    before_call()
                    conn.send((index, "ok", _call(fn, text, example)))
                except NonFiniteReward as error:
                    conn.send((index, "nonfinite", str(error)[:500]))
                except Exception as error:  # a reward function's failure is data, not a crash
                    conn.send((index, "error", f"{type(error).__name__}: {error}"[:500]))
    except (EOFError, OSError):  # the runner closed our pipe (shutdown, or this worker was abandoned)
        pass
    finally:
        conn.close()


def serve_process(fd: int, memory_mb: int | None = None, cpu_s: int | None = None) -> None:
    """Entry point of a worker process: read the pickled reward function from socket `fd`, limit this
    process (see `ResourceLimits`; after the imports, which are not the user's doing), then serve."""
    import resource

    conn = multiprocessing.connection.Connection(fd)
    try:
        fn = pickle.loads(conn.recv_bytes())
        if memory_mb is not None:
            limit = memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        conn.close()
        return

    def before_call() -> None:
        # RLIMIT_CPU counts the process's whole life: move the soft limit to cpu_s past what is used now
        if cpu_s is not None:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            used = int(usage.ru_utime + usage.ru_stime) + 1
            _, hard = resource.getrlimit(resource.RLIMIT_CPU)
            soft = used + cpu_s
            resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))

    _serve(conn, fn, before_call)


class _Worker:
    """One worker (process or daemon thread) and the runner's end of its pipe.

    A process is a fresh interpreter started with `subprocess`, not `multiprocessing`: spawn and forkserver
    re-import the parent's `__main__` (a training script importing JAX) in every worker; this imports only
    this module and the reward function's. The parent's `sys.path` is passed on so the function's module
    resolves as it did here.
    """

    def __init__(self, fn: RewardFn, isolation: Isolation, payload: bytes, limits: ResourceLimits | None = None) -> None:
        self.isolation = isolation
        self.ready = False
        self.pending: collections.deque[int] = collections.deque()  # sent, not answered; the first is running
        self.deadline = math.inf
        self.started = time.monotonic()
        ours, theirs = socket.socketpair()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        if isolation is Isolation.PROCESS:
            fd = theirs.detach()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            limits = limits or ResourceLimits(memory_mb=None, cpu_s=None)
            command = [sys.executable, "-c", "from rpegjax.rewards.runner import serve_process; "
                       f"serve_process({fd}, memory_mb={limits.memory_mb!r}, cpu_s={limits.cpu_s!r})"]
            self.handle: Any = subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env)
            os.close(fd)  # so that a dead child reads as EOF here
            self.conn.send_bytes(payload)
        else:
            child = multiprocessing.connection.Connection(theirs.detach())
            self.handle = threading.Thread(target=_serve, args=(child, fn), daemon=True, name="rpegjax-reward")
            self.handle.start()

    def send(self, chunk: list[tuple[int, str, Example]], timeout_s: float) -> None:
        self.conn.send(chunk)
        self.pending.extend(index for index, _, _ in chunk)
        self.deadline = time.monotonic() + timeout_s

    def answered(self, index: int, timeout_s: float) -> None:
        if not self.pending or self.pending[0] != index:
            raise RuntimeError(f"reward worker answered item {index}, expected {list(self.pending)[:1]}")
        self.pending.popleft()
        self.deadline = time.monotonic() + timeout_s if self.pending else math.inf

    def kill(self) -> None:
        """Stop now: a process is killed; a thread cannot be, so it is abandoned (its pipe closed)."""
        self.conn.close()
        if self.isolation is Isolation.PROCESS:
            self.handle.kill()
            self.handle.wait(timeout=5)

    def request_stop(self) -> None:
        """Ask the worker to finish; one still starting has nothing to finish and is killed."""
        if not self.ready:
            self.kill()
            return
        try:
            self.conn.send(None)
        except OSError:
            pass

    def finish_stop(self, deadline: float) -> None:
        """Wait until `deadline` (monotonic) for a process to exit, then kill it."""
        if self.isolation is Isolation.PROCESS:
            try:
                self.handle.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.handle.kill()
                self.handle.wait(timeout=5)
        self.conn.close()

    def exit_detail(self) -> str:
        if self.isolation is Isolation.PROCESS:
            try:
                code = self.handle.wait(timeout=1)
            except subprocess.TimeoutExpired:
                return "process still running"
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
                why = {"SIGXCPU": ": past its CPU limit", "SIGKILL": ": killed (out of memory?)"}.get(name, "")
                return f"killed by {name}{why}"
            return f"exit code {code}"
        return "thread ended"


def _stop_all(workers: list[_Worker]) -> None:
    """Stop all workers together: ask each, then give them one second in all to exit."""
    running = [worker for worker in workers if not worker.conn.closed]
    for worker in running:
        worker.request_stop()
    deadline = time.monotonic() + 1.0
    for worker in running:
        worker.finish_stop(deadline)


class RewardRunner:
    """Scores completions with `fn` under `config`'s timeout and isolation (see the module docstring).

    Use as a context manager or call `close()`; process workers are started at construction so their
    start-up overlaps whatever the caller does next.
    """

    def __init__(self, fn: RewardFn, config: RewardRunnerConfig | None = None) -> None:
        self.config = config if config is not None else RewardRunnerConfig()
        if not callable(fn):
            raise TypeError(f"RewardRunner needs a callable reward function, got {fn!r}")
        self._fn = fn
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
        # Workers are stopped even if close() is never called (garbage collection or interpreter exit).
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    @classmethod
    def for_task(cls, task: Any, *, timeout_s: float = 10.0, workers: int = 2,
                 limits: ResourceLimits | None = None) -> RewardRunner:
        """A runner for `task.reward` with the isolation the task asks for (`task.isolation`)."""
        config = RewardRunnerConfig(timeout_s=timeout_s, workers=workers, isolation=task.isolation,
                                    limits=limits if limits is not None else ResourceLimits())
        return cls(task.reward, config)

    def _start_worker(self) -> _Worker:
        return _Worker(self._fn, self.config.isolation, self._payload, self.config.limits)

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

    def _retire(self, position: int, todo: collections.deque[int]) -> int | None:
        """Kill and replace a worker; its unstarted items go back to the front of `todo`; returns the
        item it was running (None if idle)."""
        worker = self._workers[position]
        running = worker.pending.popleft() if worker.pending else None
        todo.extendleft(reversed(worker.pending))
        worker.kill()
        self._workers[position] = self._start_worker()
        return running

    def _score_batch(self, texts: list[str], examples: list[Example]) -> tuple[np.ndarray, RewardStats]:
        """The dispatcher: items go in chunks to idle workers, each chunk about 1/(2 x workers) of what is
        left (large chunks save round trips, shrinking ones balance the load); every call is timed on its own."""
        start = time.monotonic()
        rewards = np.zeros(len(texts), np.float32)
        todo = collections.deque(range(len(texts)))
        errors, timeouts, nonfinite, first_error = 0, 0, 0, ""
        timeout_s, start_timeout_s = self.config.timeout_s, self.config.start_timeout_s
        while todo or any(worker.pending for worker in self._workers):
            for worker in self._workers:
                if worker.ready and not worker.pending and todo:
                    size = -(-len(todo) // (2 * len(self._workers)))
                    chunk = [todo.popleft() for _ in range(size)]
                    worker.send([(i, texts[i], examples[i]) for i in chunk], timeout_s)
            nearest = min(worker.deadline if worker.ready else worker.started + start_timeout_s for worker in self._workers)
            wait_s = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
            by_conn = {worker.conn: position for position, worker in enumerate(self._workers)}
            for conn in multiprocessing.connection.wait(list(by_conn), timeout=wait_s):
                position = by_conn[conn]
                worker = self._workers[position]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    if not worker.ready:
                        raise RuntimeError(
                            f"reward worker exited before it was ready ({worker.exit_detail()}); the reward "
                            f"function {self._fn!r} must be importable in a fresh interpreter"
                        ) from None
                    detail = worker.exit_detail()
                    if self._retire(position, todo) is not None:
                        errors += 1
                        first_error = first_error or f"reward worker died ({detail})"
                    continue
                if message[0] == "ready":
                    worker.ready = True
                    continue
                if message[0] == "failed":
                    raise RuntimeError(
                        f"reward worker could not load the reward function {self._fn!r}: {message[1]}; it must be "
                        "importable in a fresh interpreter (defined in a module, not in __main__)"
                    )
                index, status, value = message
                worker.answered(index, timeout_s)
                if status == "ok":
                    rewards[index] = value
                else:
                    errors += 1
                    nonfinite += status == "nonfinite"
                    first_error = first_error or value
            now = time.monotonic()
            for position, worker in enumerate(self._workers):
                if worker.pending and now >= worker.deadline:
                    timeouts += 1
                    first_error = first_error or f"reward call exceeded timeout_s={timeout_s}"
                    self._retire(position, todo)
                elif not worker.ready and now >= worker.started + start_timeout_s:
                    raise RuntimeError(f"reward worker did not start within start_timeout_s={start_timeout_s}")
        if errors or timeouts:
            _log.warning("reward batch of %d: %d errors, %d timeouts; first: %s", len(texts), errors, timeouts, first_error)
        stats = RewardStats(
            count=len(texts),
            errors=errors,
            timeouts=timeouts,
            mean_reward=float(rewards.mean()) if len(texts) else 0.0,
            seconds=time.monotonic() - start,
            first_error=first_error,
            nonfinite=nonfinite,
        )
        return rewards, stats

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
