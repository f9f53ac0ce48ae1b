"""The run's JSON-lines record files (`metrics.jsonl`, `samples.jsonl`) across a resume: the records of steps
the resumed run trains again leave the live file (so no step appears twice) and are kept, in their order, in a
file named after the resume (`metrics.dropped-at-resume-1.jsonl`, then `-2`...), never lost."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

DROPPED_INFIX = "dropped-at-resume"


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename: a full disk leaves the old file whole."""
    staging = path.with_name(f".{path.name}.tmp")
    try:
        staging.write_text(text)
        staging.replace(path)
    finally:
        staging.unlink(missing_ok=True)


def dropped_path(path: pathlib.Path) -> pathlib.Path:
    """The first free `<stem>.dropped-at-resume-<n><suffix>` beside `path` (n from 1: one per resume that
    dropped records)."""
    number = 1
    while True:
        candidate = path.with_name(f"{path.stem}.{DROPPED_INFIX}-{number}{path.suffix}")
        if not candidate.exists():
            return candidate
        number += 1


def set_aside_records(path: pathlib.Path, keep: Callable[[dict[str, Any]], bool]) -> pathlib.Path | None:
    """Keeps in `path` the records (JSON lines) `keep` accepts and moves the others to `dropped_path(path)`,
    written first (a crash between the two writes leaves a copy, never a loss); returns that file, or None when
    nothing was dropped (or `path` does not exist)."""
    if not path.exists():
        return None
    kept, dropped = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON record ({error.msg}); the run's records are damaged") from None
        (kept if keep(record) else dropped).append(line + "\n")
    if not dropped:
        return None
    target = dropped_path(path)
    target.write_text("".join(dropped))
    write_atomically(path, "".join(kept))
    return target
