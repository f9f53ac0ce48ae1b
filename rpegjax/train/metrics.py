"""Run metrics: one JSON line per step, TensorBoard scalars and text, and the PNG dashboard at the end."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rpegjax.train.records import set_aside_records
from rpegjax.train.samples import Sample, markdown


def _scalar(value: Any) -> float | int | str | None:
    if isinstance(value, str | int) and not isinstance(value, bool):
        return value
    try:
        number = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def require_wandb() -> Any:
    """The `wandb` module; a clear error when the optional package is missing."""
    try:
        import wandb
    except ImportError:
        raise ValueError("train.wandb=true needs the optional `wandb` package: pip install 'rpegjax[wandb]' "
                         "(or leave --train.wandb unset)") from None
    return wandb


class MetricsWriter:
    """Appends `{"step": s, ...}` records to `metrics.jsonl` and mirrors numeric ones to TensorBoard (and to
    Weights & Biases when `wandb` is given: `{"project", "mode", "config"}`, a run under `run_dir/wandb`).

    `enabled=False` (non-zero processes of a multi-host run) makes every call a no-op. `purge_step` (a resumed
    run: the step it continues from) hides the TensorBoard events of later steps an earlier attempt wrote.
    """

    def __init__(self, run_dir: str | pathlib.Path, *, enabled: bool = True, tensorboard: bool = True,
                 wandb: Mapping[str, Any] | None = None, purge_step: int | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if wandb is not None:
            module = require_wandb()
            self._wandb_module = module
            self._wandb = module.init(project=wandb["project"], mode=wandb["mode"], dir=str(self.run_dir),
                                      name=self.run_dir.name, config=dict(wandb.get("config", {})))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

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
            if self._wandb is not None:
                self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        return record

    def log_samples(self, step: int, samples: Sequence[Sample]) -> None:
        """Sample completions as a TensorBoard text table (Markdown, in the TEXT tab; tag samples/<source>) and
        a W&B table."""
        if not self.enabled or not samples:
            return
        tag = f"samples/{samples[0].source}"
        if self._tb is not None:
            self._tb.add_text(tag, markdown(samples), step)
        if self._wandb is not None:
            columns = ["prompt", "response", "answer", "reward", "correct", "finish_reason"]
            rows = [[getattr(s, c) for c in columns] for s in samples]
            self._wandb.log({tag: self._wandb_module.Table(columns=columns, data=rows)}, step=int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def set_aside_later_metrics(run_dir: str | pathlib.Path, next_step: int) -> pathlib.Path | None:
    """Sets aside the records of `metrics.jsonl` that a run resumed at `next_step` writes again (in the file
    returned; `rpegjax.train.records`). Records are numbered by steps completed: the checkpoint's own step keeps
    its training record (it has `staleness`), not the final evaluation of a run that ended there; a restart from
    scratch (`next_step` 0) sets aside every record, its start evaluation included."""
    return set_aside_records(pathlib.Path(run_dir) / "metrics.jsonl", lambda record: 0 < next_step and (
        record["step"] < next_step or (record["step"] == next_step and "staleness" in record)))


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


# The dashboard's panels: (title, [(metric, label)], smoothed). A panel is drawn when one of its metrics was
# logged; smoothed panels show the raw values faintly under a trailing moving average.
DASHBOARD: tuple[tuple[str, tuple[tuple[str, str], ...], bool], ...] = (
    ("reward (training rollouts)", (("reward", "reward"), ("accuracy", "reward >= 1")), True),
    ("held-out accuracy (greedy)", (("eval/accuracy", "held-out accuracy"),), False),
    ("KL", (("kl_loss", "KL(policy || reference)"), ("approx_kl", "KL(old || policy), per update")), True),
    ("clip fraction", (("clip_fraction", "clipped tokens"),), True),
    ("gradient norm", (("grad_norm", "before clipping"),), True),
    ("policy entropy (nats per token)", (("entropy", "entropy"),), True),
    ("response length (tokens)", (("response_length", "mean length"),), True),
    ("throughput", (("tokens_per_second", "generated tokens / s"),), True),
)


def smooth(values: Iterable[float], window: int) -> np.ndarray:
    """Trailing moving average: point i is the mean of values[max(0, i - window + 1) : i + 1]."""
    values = np.asarray(list(values), np.float64)
    sums = np.cumsum(np.concatenate([[0.0], values]))
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - window, 0)
    return (sums[index] - sums[start]) / (index - start)


def plot_dashboard(records: Iterable[Mapping[str, Any]], path: str | pathlib.Path, *, title: str = "") -> list[str]:
    """The run's dashboard as one PNG: the DASHBOARD panels that have data, in a grid of two columns. Returns
    the titles of the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    panels = [(name, [(key, label) for key, label in series if any(key in r for r in records)], smoothed)
              for name, series, smoothed in DASHBOARD]
    panels = [panel for panel in panels if panel[1]]
    if not panels:
        return []
    rows = -(-len(panels) // 2)
    figure, axes = plt.subplots(rows, 2, figsize=(12, 2.8 * rows), squeeze=False)
    for axis, (name, series, smoothed) in zip(axes.flat, panels):
        for number, (key, label) in enumerate(series):
            points = [(r["step"], r[key]) for r in records if key in r]
            steps, values = [p[0] for p in points], [p[1] for p in points]
            colour = f"C{number}"
            if smoothed and len(values) > 2:
                window = max(2, min(25, len(values) // 10))
                axis.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
                axis.plot(steps, smooth(values, window), color=colour, label=f"{label} (mean of {window})")
            else:  # measured points (evaluations): each one marked, joined by lines
                axis.plot(steps, values, color=colour, marker="o", markersize=4, label=label)
        axis.set_title(name, fontsize=10)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
        axis.set_xlabel("step", fontsize=8)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [panel[0] for panel in panels]
