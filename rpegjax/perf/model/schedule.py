"""Composes per-stage times into a predicted timeline under the graph's overlap rules.

Each execution unit (a fused group or a single stage) occupies its device set (or the host) for its duration.
Steps are unrolled; unit u of step t starts when

* every producer it reads over an edge of offset d has finished at step t − d (a micro-batched consumer of a
  producer with the same number of pieces waits only for the matching piece), and
* its devices are free: units sharing a device run in a fixed order — (step + delay, topological position)
  with delay 0 for generation and k (the asynchrony bound) for every other stage, i.e. generation runs k
  steps ahead — so colocated stages add up while disjoint placements and asynchronous steps overlap.

A fixed order makes the schedule a longest path in a DAG: every finish time is monotone in every duration.
The steady-state step time is the mean spacing of step completions over the second half of the unrolled steps,
and never less than the busiest resource's work per step (`resource_bound`), which the planner uses as a bound.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rpegjax.graph.ir import Graph, StageKind
from rpegjax.graph.trace import Trace, TraceEvent

HOST = "host"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unit:
    """One dispatchable unit of a step: its stages, where it runs and how long it takes."""

    stages: tuple[str, ...]
    devices: tuple[int, ...] | None  # None: the host
    seconds: float
    piece_fractions: tuple[float, ...] = (1.0,)  # cumulative completion of each piece, as fractions of `seconds`
    kind: str = "other"

    @property
    def label(self) -> str:
        return "+".join(self.stages)

    @property
    def pieces(self) -> int:
        return len(self.piece_fractions)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    events: tuple[TraceEvent, ...]
    step_seconds: float  # steady-state spacing of step completions
    step_latency: float  # first start to last end of the last simulated step
    steps: int


def _version(graph: Graph, stage: str, step: int) -> int | None:
    for edge in graph.in_edges(stage):
        if edge.is_params:
            return edge.read_version(step)
    return None


def simulate(graph: Graph, units: list[Unit], *, steps: int, num_devices: int) -> Schedule:
    """Unrolls `steps` steps of `units` (in the graph's execution order) and returns the predicted timeline."""
    if steps < 2:
        raise ValueError(f"schedule.simulate: needs at least 2 steps, got {steps}")
    unit_of = {stage: index for index, unit in enumerate(units) for stage in unit.stages}
    for stage in graph.stage_names:
        if stage not in unit_of:
            raise ValueError(f"schedule.simulate: stage {stage!r} belongs to no unit")
    deps: list[list[tuple[int, int]]] = []  # per unit: (producer unit, offset)
    for index, unit in enumerate(units):
        found = {(unit_of[e.src], e.version_offset) for s in unit.stages for e in graph.in_edges(s)
                 if not (unit_of[e.src] == index and e.version_offset == 0)}
        deps.append(sorted(found))
    device_free = np.zeros(num_devices)
    host_free = 0.0
    piece_ends: dict[tuple[int, int], list[float]] = {}
    events: list[TraceEvent] = []
    step_start = np.full(steps, np.inf)
    step_end = np.zeros(steps)
    # Issue order: generation of step t + k runs in the same round as the other stages of step t, so a shared
    # device (or the rollout devices receiving a weight sync) serves generate(t + k) before the rest of step t.
    delay = [0 if unit.kind == StageKind.GENERATE.value else graph.async_bound for unit in units]
    order = sorted((step + delay[index], index, step) for step in range(steps) for index in range(len(units)))
    for _, index, step in order:
        unit = units[index]
        ready = [0.0] * unit.pieces
        for producer, offset in deps[index]:
            if step - offset < 0:
                continue
            ends = piece_ends[(producer, step - offset)]
            if offset == 0 and len(ends) == unit.pieces and unit.pieces > 1:
                ready = [max(r, e) for r, e in zip(ready, ends)]
            else:
                ready = [max(r, ends[-1]) for r in ready]
        free = host_free if unit.devices is None else float(device_free[list(unit.devices)].max())
        cursor = max(free, ready[0])
        ends: list[float] = []
        uniform = unit.piece_fractions == tuple((j + 1) / unit.pieces for j in range(unit.pieces))
        first_start = cursor
        for piece in range(unit.pieces):
            if uniform:
                start = max(cursor, ready[piece])
                end = start + unit.seconds / unit.pieces
            else:  # one continuous run (generation) whose pieces complete at given fractions
                start = cursor
                end = first_start + unit.seconds * unit.piece_fractions[piece]
            for stage in unit.stages:
                events.append(TraceEvent(
                    stage=stage, step=step, version=_version(graph, stage, step),
                    devices=HOST if unit.devices is None else _placement_label(graph, stage),
                    start=start, end=end, kind=graph.stage(stage).kind.value,
                    microbatch=piece if unit.pieces > 1 else None, predicted=True))
            ends.append(end)
            cursor = end
        piece_ends[(index, step)] = ends
        if unit.devices is None:
            host_free = cursor
        else:
            device_free[list(unit.devices)] = cursor
        step_start[step] = min(step_start[step], first_start)
        step_end[step] = max(step_end[step], cursor)
    window = max(1, steps // 2)
    period = max((step_end[-1] - step_end[-1 - window]) / window, resource_bound(units, num_devices))
    return Schedule(events=tuple(events), step_seconds=float(period),
                    step_latency=float(step_end[-1] - step_start[-1]), steps=steps)


def resource_bound(units: list[Unit], num_devices: int) -> float:
    """The busiest resource's work per step: no schedule repeats faster than this."""
    busy = np.zeros(num_devices)
    host = 0.0
    for unit in units:
        if unit.devices is None:
            host += unit.seconds
        else:
            busy[list(unit.devices)] += unit.seconds
    return float(max(busy.max(), host))


def _placement_label(graph: Graph, stage: str) -> str:
    return graph.stage(stage).placement


def to_trace(schedule: Schedule, name: str = "predicted") -> Trace:
    return Trace.from_events(schedule.events, name=name)
