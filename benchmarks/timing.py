"""Timing shared by the benchmarks: contenders run alternately, so load from other processes on a shared
machine hits all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def time_interleaved(calls: Mapping[str, Callable[[], object]], runs: int | Mapping[str, int], *,
                     warmup: int = 0) -> dict[str, list[float]]:
    """Seconds of each call, run by run in turn: `runs` times each, or up to each contender's own count;
    after `warmup` untimed rounds."""
    counts = {name: runs for name in calls} if isinstance(runs, int) else dict(runs)
    for _ in range(warmup):
        for call in calls.values():
            call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(max(counts.values())):
        for name, call in calls.items():
            if index < counts[name]:
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    return seconds
