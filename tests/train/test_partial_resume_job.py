"""The main job with partial rollouts, resumed from a checkpoint (as a subprocess, like a user runs it): the
groups in flight are saved with the checkpoint and continued, so the steps after the resume train exactly what
the uninterrupted run trained (no prompt skipped or repeated)."""

import pytest
from test_train_job import metrics, run_job

PARTIAL = ("--rollout.partial=true", "--checkpoint-every=1", "--async-bound=1")


def _trained(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir) if "loss" in r}


@pytest.mark.slow  # three short jobs (~3 min on 2 busy cores)
def test_a_resumed_partial_rollout_run_trains_the_same_steps(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run_dir, steps in ((whole, 4), (cut, 2)):
        result = run_job(run_dir, f"--steps={steps}", *PARTIAL)
        assert result.returncode == 0, result.stderr[-3000:]
    assert _trained(cut)[2]["partial/carried_groups"] > 0  # the checkpoint at step 2 holds groups in flight
    resumed = run_job(cut, "--resume", str(cut), "--steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stderr
    once, again = _trained(whole), _trained(cut)
    assert sorted(again) == [1, 2, 3, 4]
    for step in (3, 4):
        assert again[step] == once[step]
