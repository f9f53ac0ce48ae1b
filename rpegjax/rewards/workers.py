"""A reward worker, a process or a daemon thread, and the runner's end of its pipe (`rpegjax.rewards.channel`):
how it is started, fed chunks, timed, killed and stopped. The dispatching is `rpegjax.rewards.runner`'s."""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from rpegjax.data.example import Example
from rpegjax.rewards.channel import ChannelBroken, MessageReader, send_frame
from rpegjax.rewards.scoring import RewardFn, serve


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


class Worker:
    """One worker (process or daemon thread) and the runner's end of its pipe (`channel.MessageReader`).

    A process is a fresh interpreter started with `subprocess`, not `multiprocessing`: spawn and forkserver
    re-import the parent's `__main__` (a training script importing JAX) in every worker; this imports only
    the scoring module and the reward function's. The parent's `sys.path` is passed on so the function's
    module resolves as it did here.
    """

    def __init__(self, fn: RewardFn, isolation: Isolation, payload: bytes, limits: ResourceLimits | None = None) -> None:
        self.isolation = isolation
        self.ready = False
        self.pending: collections.deque[int] = collections.deque()  # sent, not answered; the first is running
        self.deadline = math.inf
        self.started = time.monotonic()
        ours, theirs = socket.socketpair()
        self.sock = ours
        if isolation is Isolation.PROCESS:
            fd = theirs.detach()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            limits = limits or ResourceLimits(memory_mb=None, cpu_s=None)
            command = [sys.executable, "-c", "from rpegjax.rewards.scoring import serve_process; "
                       f"serve_process({fd}, memory_mb={limits.memory_mb!r}, cpu_s={limits.cpu_s!r})"]
            self.handle: Any = subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env)
            os.close(fd)  # so that a dead child reads as EOF here
            send_frame(self.sock, payload)
        else:
            self.handle = threading.Thread(target=serve, args=(theirs, fn), daemon=True, name="rpegjax-reward")
            self.handle.start()
        self.reader = MessageReader(self.sock)  # non-blocking from here on

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def send(self, chunk: list[tuple[int, str, Example]], timeout_s: float) -> None:
        """Sends `chunk`; its first answer is due within `timeout_s` (a batched reward's: `timeout_s` per item)."""
        self.sock.setblocking(True)
        self.sock.settimeout(timeout_s)  # a worker that stopped reading must not block the runner
        try:
            send_frame(self.sock, pickle.dumps(chunk))
        finally:
            self.sock.setblocking(False)
        self.pending.extend(index for index, _, _ in chunk)
        self.deadline = time.monotonic() + timeout_s

    def answered(self, index: object, timeout_s: float) -> None:
        if not self.pending or self.pending[0] != index:
            raise ChannelBroken(f"the worker answered item {index!r:.40}, expected {list(self.pending)[:1]}")
        self.pending.popleft()
        self.deadline = time.monotonic() + timeout_s if self.pending else math.inf

    def kill(self) -> None:
        """Stop now: a process is killed; a thread cannot be, so it is abandoned (its pipe closed)."""
        self.sock.close()
        if self.isolation is Isolation.PROCESS:
            self.handle.kill()
            self.handle.wait(timeout=5)

    def request_stop(self) -> None:
        """Ask the worker to finish; one still starting has nothing to finish and is killed."""
        if not self.ready:
            self.kill()
            return
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(1.0)
            send_frame(self.sock, pickle.dumps(None))
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
        self.sock.close()

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


def stop_all(workers: list[Worker]) -> None:
    """Stop all workers together: ask each, then give them one second in all to exit."""
    running = [worker for worker in workers if not worker.closed]
    for worker in running:
        worker.request_stop()
    deadline = time.monotonic() + 1.0
    for worker in running:
        worker.finish_stop(deadline)
