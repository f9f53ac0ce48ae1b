"""The dashboard: smoothing against a direct formula, panels drawn only for logged metrics, never twice."""

import numpy as np

from rpegjax.train.metrics import DASHBOARD, MetricsWriter, plot_dashboard, read_metrics, smooth


def test_smooth_is_a_trailing_moving_average():
    values = np.random.default_rng(0).normal(size=23)
    for window in (1, 2, 5, 30):
        expected = [values[max(0, i - window + 1): i + 1].mean() for i in range(len(values))]
        np.testing.assert_allclose(smooth(values, window), expected, rtol=1e-12)


def test_dashboard_draws_one_panel_per_logged_quantity(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log(0, {"eval/accuracy": 0.1})
    for step in range(1, 31):
        writer.log(step, {"reward": step / 30, "accuracy": 0.5, "approx_kl": 0.01, "clip_fraction": 0.1,
                          "grad_norm": 1.0, "entropy": 2.0, "response_length": 10})
    writer.log(30, {"eval/accuracy": 0.4})
    writer.close()
    drawn = plot_dashboard(read_metrics(tmp_path / "metrics.jsonl"), tmp_path / "training.png")
    assert drawn == ["reward (training rollouts)", "held-out accuracy (greedy)", "KL", "clip fraction",
                     "gradient norm", "policy entropy (nats per token)", "response length (tokens)"]
    assert (tmp_path / "training.png").stat().st_size > 10_000
    keys = [key for _, series, _ in DASHBOARD for key, _ in series]
    assert len(keys) == len(set(keys))  # no quantity on two panels
    assert plot_dashboard([{"step": 1, "loss": 0.0}], tmp_path / "none.png") == []


class _RecordingWandb:
    """Stands in for the `wandb` module: records what the writer asks of it."""

    def __init__(self):
        self.init_kwargs, self.logged, self.finished = None, [], False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


def test_weights_and_biases_logging_is_optional_and_mirrors_metrics_and_samples(tmp_path, monkeypatch):
    import sys

    import pytest

    from rpegjax.data.example import Example
    from rpegjax.train.evaluation import Answer
    from rpegjax.train.samples import evaluation_samples

    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
        with pytest.raises(ValueError, match=r"needs the optional `wandb` package: pip install 'rpegjax\[wandb\]'"):
            MetricsWriter(tmp_path / "missing", tensorboard=False, wandb={"project": "p", "mode": "offline"})
    fake = _RecordingWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, tensorboard=False, wandb={"project": "p", "mode": "offline", "config": {"x": 1}})
    assert fake.init_kwargs == {"project": "p", "mode": "offline", "dir": str(run_dir), "name": "run",
                                "config": {"x": 1}}
    writer.log(1, {"reward": 0.25, "eval/accuracy": 0.5, "nan": float("nan")})
    example = Example(id="0", prompt="Q:1+1", answer="2", task="t")
    writer.log_samples(1, evaluation_samples(1, [Answer(example, "A:2", True, "eos")], 1))
    assert not fake.finished
    writer.close()
    assert fake.finished
    (step, scalars), (sample_step, tables) = fake.logged
    assert (step, scalars) == (1, {"reward": 0.25, "eval/accuracy": 0.5})
    table = tables["samples/eval"]
    assert sample_step == 1 and table.columns[:2] == ["prompt", "response"]
    assert table.data == [["Q:1+1", "A:2", "2", None, True, "eos"]]  # held-out samples carry no reward


def test_weights_and_biases_offline_run_completes_with_the_real_package(tmp_path, monkeypatch):
    import pytest

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb={"project": "p", "mode": "offline"})
    writer.log(1, {"reward": 0.25})
    writer.close()
    # wandb-core flushes its record file asynchronously, so only the run directory is checked here.
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
