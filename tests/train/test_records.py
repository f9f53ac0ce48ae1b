"""rpegjax.train.records and the resume rules of metrics.jsonl / samples.jsonl: records of steps a resumed run
trains again leave the live files (no step twice) for a file named after the resume (nothing lost)."""

import json

import pytest

from rpegjax.data.example import Example
from rpegjax.train.evaluation import Answer
from rpegjax.train.metrics import MetricsWriter, read_metrics, set_aside_later_metrics
from rpegjax.train.records import set_aside_records
from rpegjax.train.samples import SampleLog, evaluation_samples


def _attempt(run_dir, steps: int) -> None:
    """The metrics of a run of `steps` steps: the start evaluation, a record per step, the final evaluation."""
    writer = MetricsWriter(run_dir, tensorboard=False)
    writer.log(0, {"eval/accuracy": 0.1})
    for step in range(1, steps + 1):
        writer.log(step, {"loss": float(step), "staleness": 1})
    writer.log(steps, {"eval/accuracy": 0.5})
    writer.close()


def test_a_resume_sets_aside_the_records_of_the_steps_it_trains_again(tmp_path):
    _attempt(tmp_path, 4)
    before = read_metrics(tmp_path / "metrics.jsonl")
    moved = set_aside_later_metrics(tmp_path, 2)  # resumed from the checkpoint of step 2
    assert moved == tmp_path / "metrics.dropped-at-resume-1.jsonl"
    kept, dropped = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(moved)
    assert [(r["step"], "loss" in r) for r in kept] == [(0, False), (1, True), (2, True)]
    assert [(r["step"], "loss" in r) for r in dropped] == [(3, True), (4, True), (4, False)]
    assert sorted(map(json.dumps, kept + dropped)) == sorted(map(json.dumps, before))  # nothing lost
    # the resumed attempt ends at step 3; a restart from scratch then sets aside everything, in a second file
    _attempt(tmp_path, 3)
    moved = set_aside_later_metrics(tmp_path, 0)
    assert moved == tmp_path / "metrics.dropped-at-resume-2.jsonl"
    assert (tmp_path / "metrics.jsonl").read_text() == "" and len(read_metrics(moved)) == 3 + 5
    assert set_aside_later_metrics(tmp_path, 0) is None  # nothing left to set aside: no third file


def test_samples_of_steps_trained_again_are_set_aside(tmp_path):
    example = Example(id="0", prompt="p", answer="a", task="t")
    log = SampleLog(tmp_path)
    for step in (0, 2, 4):
        log.write(evaluation_samples(step, [Answer(example, f"r{step}", True, "eos")], count=1))
    moved = log.truncate(0)  # a restart from scratch
    assert moved == tmp_path / "samples.dropped-at-resume-1.jsonl"
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert [json.loads(line)["step"] for line in moved.read_text().splitlines()] == [0, 2, 4]


def test_a_damaged_record_file_is_named_not_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "loss"\n')
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON record"):
        set_aside_records(path, lambda record: False)
    assert path.read_text() == '{"step": 0}\n{"step": 1, "loss"\n'
    assert not list(tmp_path.glob("*dropped*"))

