"""Pieces of the trainer that need no run: the Gantt chart's window of steady-state steps."""

from rpegjax.graph.trace import Trace, TraceEvent
from rpegjax.train.trainer import steady_window


def test_the_gantt_window_holds_the_last_steps_from_time_zero():
    events = [TraceEvent(stage=stage, step=step, version=step, devices="all", start=10.0 * step + offset,
                         end=10.0 * step + offset + 2.0, kind=stage)
              for step in range(5) for stage, offset in (("generate", 0.0), ("actor_update", 3.0))]
    window, first, last = steady_window(Trace.from_events(events, name="grpo"), 3)
    assert (first, last) == (2, 4) and window.name == "grpo"
    assert sorted((e.stage, e.step, e.start, e.end) for e in window.events) == sorted(
        (e.stage, e.step, e.start - 20.0, e.end - 20.0) for e in events if e.step >= 2)
    everything, first, last = steady_window(Trace.from_events(events[:4]), 3)
    assert (first, last) == (0, 1) and len(everything) == 4
    empty, _, _ = steady_window(Trace("none"), 3)
    assert len(empty) == 0
