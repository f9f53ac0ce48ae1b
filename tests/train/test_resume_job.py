"""The main job's run directory across runs (as a subprocess, like a user runs it): a directory in use is
refused to a second run, and `--resume` keeps every step once, refuses what would train nothing, and names the
settings that keep a checkpoint from restoring."""

import json
import os
import shutil

import pytest
from test_train_job import metrics, run_job

from rpegjax.train.checkpoint import Checkpointer
from rpegjax.train.config import RunConfig
from rpegjax.train.run_directory import claim_run_directory


def test_a_run_directory_in_use_is_refused_to_a_new_run_and_to_a_resume(tmp_path):
    fresh, earlier = tmp_path / "fresh", tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text(RunConfig().to_json())
    for run_dir, flags in ((fresh, ("--steps=1",)), (earlier, ("--resume", str(earlier)))):
        with claim_run_directory(run_dir, resume=True, overwrite=False):  # a live run holds it
            result = run_job(run_dir, *flags)
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"error: run directory {run_dir} is in use by another run (held by pid {os.getpid()} on host " \
               in result.stderr and "Traceback" not in result.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == sorted({".lock", *(["config.json"] if run_dir == earlier
                                                                                 else [])})


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steps(records) -> list[tuple[int, bool]]:
    """(step, is a training record) of each record: an evaluation alone has no loss."""
    return [(r["step"], "loss" in r) for r in records]


@pytest.mark.slow  # five short jobs (~4 min on 2 busy cores)
def test_resume_keeps_each_step_once_and_refuses_what_it_cannot_do(tmp_path):
    run_dir = tmp_path / "run"
    first = run_job(run_dir, "--steps=2", "--checkpoint-every=1")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = {name: (run_dir / name).read_bytes() for name in ("config.json", "metrics.jsonl", "samples.jsonl")}

    # nothing to train: refused before anything is written
    nothing = run_job(run_dir, "--resume", str(run_dir), "--steps=2")
    assert nothing.returncode == 2 and "its checkpoint is at step 2 and train.steps=2: nothing to train" in nothing.stderr
    # a setting that changes what the checkpoint holds: named with both values, the checkpoints not called damaged
    changed = run_job(run_dir, "--resume", str(run_dir), "--steps=3", "--lora-rank=4")
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "settings differ from those it was saved with: lora.rank 0 (saved) -> 4 (this run)" in changed.stderr
    assert "damaged" not in changed.stderr and not (run_dir / "damaged_checkpoints").exists()
    assert {name: (run_dir / name).read_bytes() for name in saved} == saved
    assert Checkpointer(run_dir / "checkpoints").all_steps() == [1, 2]

    # resumed from step 1 (the newer checkpoint gone): the earlier attempt's step 2 and final evaluation set aside
    shutil.rmtree(run_dir / "checkpoints" / "2")
    resumed = run_job(run_dir, "--resume", str(run_dir), "--steps=3", "--graph.async_bound=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 1" in resumed.stderr
    # what changed is named, with both values
    changed_line = next(line for line in resumed.stderr.splitlines() if "resuming with settings that differ" in line)
    assert "graph.async_bound 1 (saved) -> 0 (this run)" in changed_line, changed_line
    assert "train.steps 2 (saved) -> 3 (this run)" in changed_line, changed_line
    assert _steps(metrics(run_dir)) == [(0, False), (1, True), (2, True), (3, True), (3, False)]
    assert _steps(_records(run_dir / "metrics.dropped-at-resume-1.jsonl")) == [(2, True), (2, False)]
    assert f"moved to {run_dir / 'metrics.dropped-at-resume-1.jsonl'}" in resumed.stderr

    # no complete checkpoint: a restart from step 0, every earlier record set aside
    shutil.rmtree(run_dir / "checkpoints")
    restarted = run_job(run_dir, "--resume", str(run_dir))
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "no complete checkpoint" in restarted.stderr
    assert _steps(metrics(run_dir)) == [(0, False), (1, True), (2, True), (3, True), (3, False)]
    assert len(_records(run_dir / "metrics.dropped-at-resume-2.jsonl")) == 5
    samples, dropped = _records(run_dir / "samples.jsonl"), _records(run_dir / "samples.dropped-at-resume-2.jsonl")
    key = lambda s: (s["step"], s["source"], s["prompt"])
    assert len({key(s) for s in samples}) == len(samples)  # each sample once
    assert {key(s) for s in samples} <= {key(s) for s in dropped}  # the same data order: the restart redid them
