"""`--resume`: which checkpoint a run continues from, and what it refuses.

- The newest checkpoint that restores is used; a damaged newer one is reported, set aside and passed over.
- A checkpoint that does not restore because this run's settings differ from those it was saved with (its
  metadata keeps the resolved config) is not damaged: the resume is refused naming each differing setting with
  both values (`lora.rank 4 (saved) -> 8 (this run)`), and the checkpoints are left as they are.
- A run resumed at step s with `train.steps` <= s would train nothing: refused.
- The records of steps after s (or all of them when no complete checkpoint exists: a restart from step 0) leave
  `metrics.jsonl` and `samples.jsonl` for a file named after the resume (`rpegjax.train.records`).
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

from rpegjax.train.checkpoint import Checkpointer, CheckpointError
from rpegjax.train.config_diff import describe, differences

# sections whose settings never change the structure of a checkpoint's arrays (how long and how the run goes,
# where its data come from); and those that never change the initial weights either
KEEP_STRUCTURE = ("train.", "distributed.", "graph.", "rollout.", "data.", "warm_start.")
KEEP_WEIGHTS = ("train.", "distributed.", "graph.", "rollout.")


def settings_changed(saved_config: dict[str, Any] | None, config_json: str, *, ignore: tuple[str, ...]) -> str:
    """The settings (outside the sections in `ignore`) in which this run differs from a checkpoint's saved
    config, described; empty when none differ (or the checkpoint kept no config)."""
    if not saved_config:
        return ""
    return describe(differences(saved_config, json.loads(config_json), ignore=ignore), "saved", "this run")


def restore_newest(checkpoints: Checkpointer, like: Callable[[list[int]], Any], *, config_json: str,
                   log: Callable[[str], None], damaged_dir: pathlib.Path | None) -> tuple[Any, dict[str, Any]]:
    """The arrays and metadata of the newest checkpoint that restores into `like(history_versions)` (the
    structure to restore). Damaged newer ones are moved under `damaged_dir` (None: left in place, for the
    processes that do not write). Raises CheckpointError naming the differing settings when a checkpoint does
    not restore and this run's settings differ from its own."""
    failures = []
    for step in reversed(checkpoints.all_steps()):
        try:
            meta = checkpoints.metadata(step)
            arrays, meta = checkpoints.restore(like(meta["history_versions"]), step)
        except (CheckpointError, KeyError, TypeError) as error:
            changed = settings_changed(_saved_config(checkpoints, step), config_json, ignore=KEEP_STRUCTURE)
            if changed:
                raise CheckpointError(
                    f"checkpoint {checkpoints.directory / str(step)} does not restore into this run, whose settings "
                    f"differ from those it was saved with: {changed}. Resume with the saved settings (the run's "
                    "config.json), or start a new run for the new ones") from error
            failures.append(step)
            log(f"checkpoint {checkpoints.directory / str(step)} is damaged and cannot be restored "
                f"({str(error)[:300]}); trying the previous one")
            continue
        if failures:
            log(f"falling back to checkpoint {step}: damaged newer checkpoint(s) {failures} are skipped")
            if damaged_dir is not None:  # out of the way of the new saves of those steps, kept for inspection
                for bad in failures:
                    moved = checkpoints.set_aside(bad, damaged_dir / f"{bad}-{time.time():.0f}")
                    log(f"moved damaged checkpoint {bad} to {moved}")
        return arrays, meta
    raise CheckpointError(f"{checkpoints.directory}: no checkpoint can be restored (damaged: {failures})")


def _saved_config(checkpoints: Checkpointer, step: int) -> dict[str, Any] | None:
    try:
        return checkpoints.metadata(step).get("config")
    except CheckpointError:
        return None


def check_steps(run_dir: pathlib.Path, steps: int, next_step: int) -> None:
    """Refuses to resume a run at `next_step` for `steps` steps in all when that trains nothing."""
    if steps <= next_step:
        raise ValueError(f"--resume {run_dir}: its checkpoint is at step {next_step} and train.steps={steps}: "
                         f"nothing to train. Give --steps N with N > {next_step} (the run's total, not the steps to "
                         "add), or evaluate the checkpoint with scripts/evaluate.py")
