"""Timing shared by the benchmarks: contenders run alternately, so load from other processes on a shared
machine hits all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def time_interleaved(calls: Mapping[str, Callable[[], object]], runs: int | Mapping[str, int], *,
                     warmup: int = 0, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each call, run by run in turn: `runs` times each, or up to each contender's own count;
    after `warmup` untimed rounds. `clock`: wall time by default; `time.process_time` counts this process's CPU
    seconds (all threads), which waiting for a core on a loaded machine does not inflate."""
    counts = {name: runs for name in calls} if isinstance(runs, int) else dict(runs)
    for _ in range(warmup):
        for call in calls.values():
            call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(max(counts.values())):
        for name, call in calls.items():
            if index < counts[name]:
                start = clock()
                call()
                seconds[name].append(clock() - start)
    return seconds
