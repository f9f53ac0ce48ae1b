"""Timelines of stage executions, measured by the runtime or predicted by the performance model.

A `TraceEvent` is one execution of a stage (or one micro-batch of it): which step, which weight version it
used, on which devices, and when (seconds from the trace's origin). Measured and predicted timelines share
this type (`predicted=True` marks the latter), so they export, plot and summarise the same way.

Exports: Chrome/Perfetto trace JSON (`Trace.to_chrome_json`, loaded back exactly by `Trace.from_chrome_json`;
open in chrome://tracing or ui.perfetto.dev) and a Gantt chart PNG (`gantt_png`).

Note for recorders: JAX dispatches asynchronously, so a span around a jitted call measures dispatch only
unless the code inside the span blocks on its results (`jax.block_until_ready`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from rpegjax.graph.ir import StageKind

CHROME_FORMAT = "rpegjax-trace-1"

Devices = tuple[int, ...] | str  # explicit device indices, or a placement name


def _devices_label(devices: Devices) -> str:
    return devices if isinstance(devices, str) else "devices " + ",".join(map(str, devices))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One stage execution: [start, end) in seconds from the trace origin.

    `version` is the weight version the stage used (None for stages without a model); `step - version` is
    its staleness when it read weights through a cross-step edge. `kind` is a StageKind value or any other
    label (e.g. "checkpoint", "host"). `microbatch` numbers the piece of a micro-batched stage.
    """

    stage: str
    step: int
    version: int | None
    devices: Devices
    start: float
    end: float
    kind: str
    microbatch: int | None = None
    predicted: bool = False

    def __post_init__(self) -> None:
        where = f"trace event of stage {self.stage!r} (step {self.step})"
        if not isinstance(self.stage, str) or not self.stage:
            raise ValueError(f"TraceEvent.stage must be a non-empty string, got {self.stage!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"{where}: step must be an integer >= 0, got {self.step!r}")
        if self.version is not None and (isinstance(self.version, bool) or not isinstance(self.version, int)):
            raise ValueError(f"{where}: version must be an integer or None, got {self.version!r}")
        if isinstance(self.devices, str):
            object.__setattr__(self, "devices", str(self.devices))
        else:
            devices = tuple(self.devices)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices):
                raise ValueError(f"{where}: devices must be a placement name or device indices, got {self.devices!r}")
            object.__setattr__(self, "devices", devices)
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"{where}: kind must be a non-empty string, got {self.kind!r}")
        object.__setattr__(self, "kind", str(self.kind))  # StageKind members become plain str
        for field in ("start", "end"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}: {field} must be a number of seconds, got {value!r}")
            object.__setattr__(self, field, float(value))
        if self.end < self.start:
            raise ValueError(f"{where}: end {self.end} is before start {self.start}")
        if self.microbatch is not None and (isinstance(self.microbatch, bool) or not isinstance(self.microbatch, int)
                                            or self.microbatch < 0):
            raise ValueError(f"{where}: microbatch must be None or an integer >= 0, got {self.microbatch!r}")

    @property
    def duration(self) -> float:
        return self.end - self.start


_STAGE_KINDS = frozenset(kind.value for kind in StageKind)


def _default_kind(stage: str) -> str:
    return stage if stage in _STAGE_KINDS else "other"


class Trace:
    """A thread-safe recorder of `TraceEvent`s; times are seconds since the trace was created.

    Use `span` around a stage execution, `record` for known start/end times, `add` for ready events
    (e.g. a predicted timeline).
    """

    def __init__(self, name: str = "", *, clock: Callable[[], float] = time.perf_counter,
                 events: Iterable[TraceEvent] = ()):
        self.name = name
        self._clock = clock
        self._origin = clock()
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = list(events)

    @classmethod
    def from_events(cls, events: Iterable[TraceEvent], name: str = "") -> Trace:
        return cls(name, events=events)

    @property
    def origin(self) -> float:
        """The clock's reading at the trace origin (with `clock=time.time`, traces of several processes of one
        host share a timeline: event time + origin)."""
        return self._origin

    def now(self) -> float:
        """Seconds since the trace origin."""
        return self._clock() - self._origin

    def add(self, event: TraceEvent) -> TraceEvent:
        if not isinstance(event, TraceEvent):
            raise TypeError(f"Trace.add takes a TraceEvent, got {type(event).__name__}")
        with self._lock:
            self._events.append(event)
        return event

    def record(self, *, stage: str, step: int, version: int | None, devices: Devices, start: float, end: float,
               kind: str | None = None, microbatch: int | None = None, predicted: bool = False) -> TraceEvent:
        """Adds one event; `kind` defaults to the stage name when that is a StageKind, else "other"."""
        return self.add(TraceEvent(stage=stage, step=step, version=version, devices=devices, start=start, end=end,
                                   kind=kind or _default_kind(stage), microbatch=microbatch, predicted=predicted))

    @contextlib.contextmanager
    def span(self, stage: str, step: int, version: int | None, devices: Devices, *, kind: str | None = None,
             microbatch: int | None = None) -> Iterator[None]:
        """Times the body and records it, also when the body raises (a failed stage still took that time)."""
        start = self.now()
        try:
            yield
        finally:
            self.record(stage=stage, step=step, version=version, devices=devices, start=start, end=self.now(),
                        kind=kind, microbatch=microbatch)

    @property
    def events(self) -> tuple[TraceEvent, ...]:
        """A snapshot sorted by start time (then end, stage)."""
        with self._lock:
            events = list(self._events)
        return tuple(sorted(events, key=lambda e: (e.start, e.end, e.stage, e.microbatch or 0)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    # ---------------------------------------------------------------------------------- chrome format
    def to_chrome_json(self, path: str | os.PathLike | None = None) -> dict[str, Any]:
        """The Chrome/Perfetto trace (JSON object format): one process per device set or placement, one
        thread per stage, "X" complete events with ts/dur in microseconds; exact seconds and all event fields
        ride in `args`. Written to `path` when given; returned either way."""
        events = self.events
        pids: dict[Devices, int] = {}
        tids: dict[tuple[Devices, str], int] = {}
        for event in events:
            pid = pids.setdefault(event.devices, len(pids) + 1)
            tids.setdefault((event.devices, event.stage), sum(1 for key in tids if key[0] == event.devices) + 1)
        chrome: list[dict[str, Any]] = []
        for devices, pid in pids.items():
            chrome.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": _devices_label(devices)}})
        for (devices, stage), tid in tids.items():
            chrome.append({"name": "thread_name", "ph": "M", "pid": pids[devices], "tid": tid, "args": {"name": stage}})
        for event in events:
            chrome.append({
                "name": event.stage, "cat": event.kind, "ph": "X",
                "ts": event.start * 1e6, "dur": event.duration * 1e6,
                "pid": pids[event.devices], "tid": tids[(event.devices, event.stage)],
                "args": {
                    "step": event.step, "version": event.version,
                    "devices": event.devices if isinstance(event.devices, str) else list(event.devices),
                    "microbatch": event.microbatch, "predicted": event.predicted, "kind": event.kind,
                    "start_s": event.start, "end_s": event.end,
                },
            })
        document = {"traceEvents": chrome, "displayTimeUnit": "ms",
                    "otherData": {"format": CHROME_FORMAT, "name": self.name, "origin": self._origin}}
        if path is not None:
            with open(path, "w") as file:
                json.dump(document, file)
        return document

    @classmethod
    def from_chrome_json(cls, source: str | os.PathLike | Mapping[str, Any]) -> Trace:
        """Loads a trace written by `to_chrome_json` (a path or the parsed object); foreign Chrome traces load
        from their "X" events with step 0 and no version."""
        if isinstance(source, Mapping):
            document = source
        else:
            with open(source) as file:
                document = json.load(file)
        if not isinstance(document, Mapping) or not isinstance(document.get("traceEvents"), list):
            raise ValueError(f"{source if not isinstance(source, Mapping) else 'trace'}: not a Chrome trace object "
                             "(expected a JSON object with a 'traceEvents' list)")
        events = []
        for index, raw in enumerate(document["traceEvents"]):
            if raw.get("ph") != "X":
                continue
            try:
                args = raw.get("args", {})
                devices = args.get("devices", f"pid {raw['pid']}")
                events.append(TraceEvent(
                    stage=raw["name"], step=args.get("step", 0), version=args.get("version"),
                    devices=devices if isinstance(devices, str) else tuple(devices),
                    start=args.get("start_s", raw["ts"] / 1e6),
                    end=args.get("end_s", (raw["ts"] + raw["dur"]) / 1e6),
                    kind=args.get("kind", raw.get("cat") or "other"), microbatch=args.get("microbatch"),
                    predicted=args.get("predicted", False)))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"Chrome trace event #{index} ({raw.get('name')!r}) is malformed: {error}") from None
        return cls.from_events(events, name=document.get("otherData", {}).get("name", ""))


# ------------------------------------------------------------------------------------------ summaries
@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSummary:
    count: int
    total: float
    mean: float
    min: float
    max: float


def stage_summary(trace: Trace | Sequence[TraceEvent]) -> dict[str, StageSummary]:
    """Per stage: number of events and total/mean/min/max durations in seconds, in order of first start."""
    durations: dict[str, list[float]] = {}
    for event in _events(trace):
        durations.setdefault(event.stage, []).append(event.duration)
    return {
        stage: StageSummary(count=len(values), total=sum(values), mean=sum(values) / len(values),
                            min=min(values), max=max(values))
        for stage, values in durations.items()
    }


def wall_time(trace: Trace | Sequence[TraceEvent]) -> float:
    """Last end minus first start (0 for an empty trace)."""
    events = _events(trace)
    return max(e.end for e in events) - min(e.start for e in events) if events else 0.0


def _coverage(events: Sequence[TraceEvent]) -> tuple[float, float]:
    """(time covered by >= 1 event, time covered by >= 2 events), by a sweep over start/end points."""
    points = sorted([(e.start, 1) for e in events] + [(e.end, -1) for e in events], key=lambda p: (p[0], p[1]))
    busy = overlapped = 0.0
    active, previous = 0, None
    for time_point, delta in points:
        if previous is not None:
            span = time_point - previous
            busy += span if active >= 1 else 0.0
            overlapped += span if active >= 2 else 0.0
        active += delta
        previous = time_point
    return busy, overlapped


def busy_time(trace: Trace | Sequence[TraceEvent]) -> float:
    """Length of the union of all event intervals."""
    return _coverage(_events(trace))[0]


def overlap_fraction(trace: Trace | Sequence[TraceEvent]) -> float:
    """Share of busy time during which at least two events run at once: 0 for a serial timeline, 1 when
    everything overlaps. 0 for an empty trace."""
    busy, overlapped = _coverage(_events(trace))
    return overlapped / busy if busy > 0 else 0.0


def max_staleness(trace: Trace | Sequence[TraceEvent], kind: str = StageKind.GENERATE) -> int | None:
    """Largest `step - version` over events of `kind` that carry a version (None when there are none)."""
    lags = [e.step - e.version for e in _events(trace) if e.kind == kind and e.version is not None]
    return max(lags) if lags else None


def _events(trace: Trace | Sequence[TraceEvent]) -> Sequence[TraceEvent]:
    return trace.events if isinstance(trace, Trace) else tuple(trace)


# ------------------------------------------------------------------------------------------- drawing
_KIND_COLOURS = {
    StageKind.GENERATE: "#1b9e77", StageKind.REWARD: "#e6ab02", StageKind.REF_LOGPROB: "#7570b3",
    StageKind.OLD_LOGPROB: "#d95f02", StageKind.CRITIC_VALUE: "#1f78b4", StageKind.ADVANTAGE: "#a6761d",
    StageKind.ACTOR_UPDATE: "#66a61e", StageKind.CRITIC_UPDATE: "#e7298a", StageKind.WEIGHT_SYNC: "#666666",
}
_OTHER_COLOURS = ("#8dd3c7", "#fb8072", "#80b1d3", "#fdb462", "#bc80bd", "#ccebc5")


_LEGEND_ROW_INCHES = 0.3  # one row of the kind legend under the plots
_TITLE_LINE_INCHES = 0.25  # one line of the figure title


def gantt_png(traces: Trace | Sequence[Trace], path: str | os.PathLike, *, title: str | None = None,
              first_step_number: int = 0) -> None:
    """Writes `gantt_figure(traces, title=..., first_step_number=...)` to a PNG at `path`."""
    gantt_figure(traces, title=title, first_step_number=first_step_number).savefig(path, format="png", dpi=100)


def gantt_figure(traces: Trace | Sequence[Trace], *, title: str | None = None, first_step_number: int = 0):
    """One Gantt panel per trace (stacked, shared time axis): one row per stage, bars coloured by kind,
    predicted events hatched, step numbers written inside wide-enough bars (trace step s shown as
    s + `first_step_number`, so a chart can number steps as the run's other outputs do). The title is wrapped to
    the figure's width above the panels and the legend sits below them, so neither covers the other.

    Uses matplotlib's Agg canvas directly, so it needs no display and leaves pyplot's state alone.
    """
    import textwrap

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    traces = [traces] if isinstance(traces, Trace) else list(traces)
    if not traces:
        raise ValueError("gantt_png needs at least one trace")
    panels = [t.events for t in traces]
    rows = [list(dict.fromkeys(e.stage for e in events)) for events in panels]
    heights = [max(len(r), 1) for r in rows]
    used = sorted({e.kind for events in panels for e in events})
    columns = min(len(used), 5) or 1
    legend_rows = -(-len(used) // columns)
    lines = textwrap.wrap(title, 150) if title else []
    height = 1.2 + 0.35 * sum(heights) + 0.6 * len(panels) + _LEGEND_ROW_INCHES * legend_rows \
        + _TITLE_LINE_INCHES * len(lines)
    figure = Figure(figsize=(12, height))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    colours: dict[str, str] = {str(k): c for k, c in _KIND_COLOURS.items()}
    span = max((wall_time(events) + min((e.start for e in events), default=0.0) for events in panels), default=0.0)
    for axis, trace, events, stages in zip(axes, traces, panels, rows):
        index = {stage: i for i, stage in enumerate(stages)}
        for event in events:
            colour = colours.setdefault(event.kind, _OTHER_COLOURS[len(colours) % len(_OTHER_COLOURS)])
            row = index[event.stage]
            axis.barh(row, event.duration, left=event.start, height=0.7, color=colour, edgecolor="black",
                      linewidth=0.3, hatch="//" if event.predicted else None)
            if span and event.duration > 0.04 * span:
                axis.text(event.start + event.duration / 2, row, str(event.step + first_step_number), ha="center",
                          va="center", fontsize=7)
        axis.set_yticks(range(len(stages)), stages, fontsize=8)
        axis.set_ylim(len(stages) - 0.5 if stages else 0.5, -0.5)
        label = trace.name or ("predicted" if events and all(e.predicted for e in events) else "measured")
        axis.set_title(label, fontsize=9, loc="left")
        axis.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds")
    bottom = (_LEGEND_ROW_INCHES * legend_rows + 0.05) / height if used else 0.0
    top = 1 - (_TITLE_LINE_INCHES * len(lines) + 0.1) / height if lines else 1.0
    if used:
        figure.legend(handles=[Patch(color=colours[k], label=k) for k in used], loc="lower center", fontsize=7,
                      ncol=columns, frameon=False, bbox_to_anchor=(0.5, 0.0))
    if lines:
        figure.suptitle("\n".join(lines), x=0.01, y=1 - 0.05 / height, ha="left", va="top", fontsize=10)
    figure.tight_layout(rect=(0, bottom, 1, top))
    return figure
