"""The versioned parameter store: which weights generation may read, and the bookkeeping of staleness."""

from __future__ import annotations

import threading
from typing import Any


class RuntimeStopped(RuntimeError):
    """Raised in a waiting thread when the runtime shuts down (another stage failed or the run ended)."""


class ParameterStore:
    """Generation-layout weights by version, shared by the trainer (writer) and the rollout worker (reader).

    Version v is the actor after v updates; version 0 is the initial checkpoint. `get(v)` blocks until
    version v is published, so a rollout can never run ahead of what the asynchrony bound allows, and
    `prune(v)` drops every version older than v once no pending rollout can still need it.
    """

    def __init__(self) -> None:
        self._versions: dict[int, Any] = {}
        self._condition = threading.Condition()
        self._stopped: BaseException | None = None

    def put(self, version: int, params: Any) -> None:
        with self._condition:
            self._versions[version] = params
            self._condition.notify_all()

    def get(self, version: int, *, timeout: float | None = None) -> Any:
        with self._condition:
            ready = self._condition.wait_for(lambda: version in self._versions or self._stopped is not None, timeout)
            if self._stopped is not None:
                raise RuntimeStopped(f"stopped while waiting for weights version {version}") from self._stopped
            if not ready:
                raise TimeoutError(f"weights version {version} were not published within {timeout} s")
            return self._versions[version]

    def newest(self, newer_than: int, at_most: int) -> tuple[int, Any] | None:
        """The newest published version in (`newer_than`, `at_most`] and its weights, or None (never waits)."""
        with self._condition:
            candidates = [v for v in self._versions if newer_than < v <= at_most]
            return None if not candidates else (max(candidates), self._versions[max(candidates)])

    def prune(self, keep_from: int) -> None:
        with self._condition:
            for version in [v for v in self._versions if v < keep_from]:
                del self._versions[version]

    def versions(self) -> tuple[int, ...]:
        with self._condition:
            return tuple(sorted(self._versions))

    def items(self) -> list[tuple[int, Any]]:
        with self._condition:
            return sorted(self._versions.items())

    def stop(self, reason: BaseException) -> None:
        with self._condition:
            self._stopped = reason
            self._condition.notify_all()


def generation_version(step: int, async_bound: int) -> int:
    """The weights version that generation of `step` reads: step - k, clamped at the initial version 0."""
    return max(0, step - async_bound)
