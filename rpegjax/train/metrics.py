"""Run metrics: one JSON line per step, TensorBoard scalars, and PNG plots at the end."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


def _scalar(value: Any) -> float | int | str | None:
    if isinstance(value, str | int) and not isinstance(value, bool):
        return value
    try:
        number = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class MetricsWriter:
    """Appends `{"step": s, ...}` records to `metrics.jsonl` and mirrors numeric ones to TensorBoard.

    `enabled=False` (non-zero processes of a multi-host run) makes every call a no-op.
    """

    def __init__(self, run_dir: str | pathlib.Path, *, enabled: bool = True, tensorboard: bool = True):
        self.run_dir = pathlib.Path(run_dir)
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": int(step)}
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is not None:
                record[key] = scalar
        if self.enabled:
            self._file.write(json.dumps(record) + "\n")
            if self._tb is not None:
                for key, value in record.items():
                    if key != "step" and isinstance(value, float | int):
                        self._tb.add_scalar(key, value, step)
        return record

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_metrics(records: Iterable[Mapping[str, Any]], keys: Iterable[str], path: str | pathlib.Path, *, title: str = "") -> None:
    """One PNG with a panel per key (x = step); keys absent from every record are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    keys = [key for key in keys if any(key in record for record in records)]
    if not keys:
        return
    figure, panels = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), squeeze=False)
    for panel, key in zip(panels[:, 0], keys):
        points = [(record["step"], record[key]) for record in records if key in record]
        panel.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 40 else None)
        panel.set_ylabel(key)
        panel.grid(alpha=0.3)
    panels[-1, 0].set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
