"""Traces: recording (spans, threads), Chrome/Perfetto JSON export and exact reload, Gantt PNG, summaries."""

import json
import random
import threading

import pytest

from rpegjax.graph.trace import (
    Trace,
    TraceEvent,
    busy_time,
    gantt_figure,
    gantt_png,
    max_staleness,
    overlap_fraction,
    stage_summary,
    wall_time,
)


class _FakeClock:
    """A clock that advances only when told, so span times are exact."""

    def __init__(self, start=100.0):
        self.now = start

    def __call__(self):
        return self.now


def _event(stage, start, end, *, step=0, version=0, devices="all", kind=None, **kwargs):
    return TraceEvent(stage=stage, step=step, version=version, devices=devices, start=start, end=end,
                      kind=kind or stage, **kwargs)


def _sample_trace():
    trace = Trace("sample")
    for step in range(3):
        base = 10.0 * step
        trace.add(_event("generate", base, base + 4.0, step=step, version=max(step - 1, 0), devices=(0, 1)))
        trace.add(_event("reward", base + 4.0, base + 4.5, step=step, version=None, devices="host"))
        for piece in range(2):
            trace.add(_event("old_logprob", base + 4.5 + piece, base + 5.5 + piece, step=step, version=step,
                             devices=(2, 3), microbatch=piece))
        trace.add(_event("actor_update", base + 6.5, base + 9.0, step=step, version=step, devices=(2, 3)))
        trace.add(_event("weight_sync", base + 9.0, base + 9.25, step=step, version=step + 1, devices="all"))
    return trace


def test_span_records_times_relative_to_origin():
    clock = _FakeClock()
    trace = Trace("t", clock=clock)
    clock.now = 101.5
    with trace.span("generate", step=3, version=2, devices=(0, 1)):
        clock.now = 104.0
    with pytest.raises(RuntimeError):
        with trace.span("custom", step=3, version=None, devices="all", microbatch=1):
            clock.now = 105.0
            raise RuntimeError("stage failed")
    first, second = trace.events
    assert (first.start, first.end, first.duration) == (1.5, 4.0, 2.5)
    assert first.kind == "generate" and first.devices == (0, 1) and first.version == 2 and not first.predicted
    assert (second.start, second.end, second.kind, second.microbatch) == (4.0, 5.0, "other", 1)


def test_record_defaults_and_real_clock_is_monotonic():
    trace = Trace()
    event = trace.record(stage="reward", step=0, version=None, devices="host", start=0.5, end=0.75)
    assert event.kind == "reward" and len(trace) == 1
    assert trace.record(stage="fwd", step=0, version=0, devices="all", start=0, end=1, kind="old_logprob").kind == "old_logprob"
    with trace.span("advantage", 0, 0, "all"):
        pass
    spanned = [e for e in trace if e.stage == "advantage"][0]
    assert 0.0 <= spanned.start <= spanned.end <= trace.now()


def test_recording_is_thread_safe():
    trace = Trace()
    def work(index):
        for step in range(200):
            trace.record(stage=f"s{index}", step=step, version=step, devices=(index,), start=step, end=step + 0.5)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(trace) == 1600
    assert {stage: summary.count for stage, summary in stage_summary(trace).items()} == {f"s{i}": 200 for i in range(8)}


@pytest.mark.parametrize("bad, words", [
    (dict(end=0.5, start=1.0), "before start"),
    (dict(step=-1), "step"),
    (dict(version=1.5), "version"),
    (dict(devices=(0, -1)), "devices"),
    (dict(kind=""), "kind"),
    (dict(microbatch=-2), "microbatch"),
    (dict(start="0"), "start"),
])
def test_event_validation_names_the_stage(bad, words):
    fields = dict(stage="generate", step=0, version=0, devices="all", start=0.0, end=1.0, kind="generate") | bad
    with pytest.raises(ValueError) as info:
        TraceEvent(**fields)
    assert words in str(info.value) and ("'generate'" in str(info.value) or "stage" in str(info.value))


def test_chrome_json_is_valid_and_reloads_exactly(tmp_path):
    trace = _sample_trace()
    path = tmp_path / "trace.json"
    returned = trace.to_chrome_json(path)
    with open(path) as file:
        document = json.load(file)
    assert document == json.loads(json.dumps(returned))
    complete = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(trace) == 18
    for raw, event in zip(complete, trace.events):
        assert raw["name"] == event.stage and raw["cat"] == event.kind
        assert raw["ts"] == pytest.approx(event.start * 1e6, abs=1e-6)  # microseconds
        assert raw["dur"] == pytest.approx((event.end - event.start) * 1e6, abs=1e-6)
        assert isinstance(raw["pid"], int) and isinstance(raw["tid"], int)
    # one process per device set, one thread per stage within it, both named by metadata events
    pids = {}
    for raw, event in zip(complete, trace.events):
        assert pids.setdefault(event.devices, raw["pid"]) == raw["pid"]
    assert len(set(pids.values())) == 4
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    for raw in complete:
        assert names[(raw["pid"], raw["tid"])] == raw["name"]
    processes = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert processes[pids[(0, 1)]] == "devices 0,1" and processes[pids["host"]] == "host"

    again = Trace.from_chrome_json(path)
    assert again.events == trace.events and again.name == "sample"
    assert Trace.from_chrome_json(returned).events == trace.events


def test_foreign_chrome_trace_and_errors(tmp_path):
    foreign = {"traceEvents": [{"name": "gemm", "cat": "gpu", "ph": "X", "ts": 1500.0, "dur": 250.0, "pid": 7, "tid": 1},
                               {"name": "marker", "ph": "i", "ts": 3.0, "pid": 7, "tid": 1}]}
    (event,) = Trace.from_chrome_json(foreign).events
    assert (event.stage, event.kind, event.devices, event.step, event.version) == ("gemm", "gpu", "pid 7", 0, None)
    assert event.start == pytest.approx(1.5e-3) and event.end == pytest.approx(1.75e-3)
    with pytest.raises(ValueError, match="traceEvents"):
        Trace.from_chrome_json({"events": []})
    with pytest.raises(ValueError, match="#0 \\('bad'\\)"):
        Trace.from_chrome_json({"traceEvents": [{"name": "bad", "ph": "X", "pid": 1}]})


def test_gantt_png_is_written(tmp_path):
    measured = _sample_trace()
    predicted = Trace.from_events([TraceEvent(**{**e.__dict__, "predicted": True, "end": e.end * 1.1})
                                   for e in measured.events], name="predicted")
    for name, traces in (("one.png", measured), ("two.png", [measured, predicted]), ("empty.png", Trace())):
        path = tmp_path / name
        gantt_png(traces, path, title="W-small")
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    with pytest.raises(ValueError, match="at least one trace"):
        gantt_png([], tmp_path / "none.png")


@pytest.mark.parametrize("title", [
    "measured stage timeline of the last 3 steps (steps 4-6, numbered as in metrics.jsonl); the whole run is in "
    "trace.json",
    "qwen2.5-7b ppo on 256 x gh200 (predicted) " * 6,  # longer than the figure is wide: wrapped
])
def test_the_gantt_title_is_neither_covered_by_the_legend_nor_cut(title):
    """The title is drawn whole inside the figure and no legend entry overlaps it (every stage kind in use)."""
    kinds = ["generate", "reward", "ref_logprob", "old_logprob", "critic_value", "advantage", "actor_update",
             "critic_update", "weight_sync"]
    trace = Trace.from_events([_event(f"stage{i}", i, i + 1.0, kind=kind) for i, kind in enumerate(kinds)])
    figure = gantt_figure(trace, title=title)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    whole = figure.bbox
    heading = figure.get_suptitle() and figure._suptitle.get_window_extent(renderer)
    (legend,) = figure.legends
    legend_box = legend.get_window_extent(renderer)
    assert not heading.overlaps(legend_box)
    assert whole.x0 <= heading.x0 and heading.x1 <= whole.x1 and whole.y0 <= heading.y0 and heading.y1 <= whole.y1
    assert whole.x0 <= legend_box.x0 and legend_box.x1 <= whole.x1 and whole.y0 <= legend_box.y0
    for axis in figure.axes:  # and neither covers the panels
        panel = axis.get_window_extent(renderer)
        assert not panel.overlaps(heading) and not panel.overlaps(legend_box)


def test_gantt_step_numbers_can_follow_the_runs_numbering():
    trace = Trace.from_events([_event("generate", 0.0, 1.0, step=4), _event("actor_update", 1.0, 2.0, step=5)])
    shown = lambda figure: sorted(text.get_text() for axis in figure.axes for text in axis.texts)
    assert shown(gantt_figure(trace)) == ["4", "5"]
    assert shown(gantt_figure(trace, first_step_number=1)) == ["5", "6"]


def test_summaries_on_the_sample():
    trace = _sample_trace()
    summary = stage_summary(trace)
    assert list(summary) == ["generate", "reward", "old_logprob", "actor_update", "weight_sync"]
    assert summary["old_logprob"].count == 6 and summary["old_logprob"].total == pytest.approx(6.0)
    assert summary["generate"].mean == pytest.approx(4.0) and summary["weight_sync"].max == pytest.approx(0.25)
    assert wall_time(trace) == pytest.approx(29.25)
    assert busy_time(trace) == pytest.approx(3 * 9.25)
    assert overlap_fraction(trace) == 0.0  # the sample is serial
    assert max_staleness(trace) == 1 and max_staleness(trace, kind="reward") is None
    assert wall_time(Trace()) == 0.0 and overlap_fraction(Trace()) == 0.0


def test_overlap_fraction_matches_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        events = []
        for index in range(rng.randint(1, 6)):
            start = rng.randint(0, 40)
            events.append(_event(f"s{index}", start, start + rng.randint(0, 15)))
        # count integer cells [x, x+1) covered by one and by two or more events
        covered = [sum(e.start <= x < e.end for e in events) for x in range(60)]
        busy = sum(c >= 1 for c in covered)
        both = sum(c >= 2 for c in covered)
        assert busy_time(events) == pytest.approx(busy)
        assert overlap_fraction(events) == pytest.approx(both / busy if busy else 0.0)
