"""benchmarks/bench_gpu.py (the GPU check's measurements): the references it divides by, its table, and the whole
benchmark run small (on the CPU here, on the GPU under `-m gpu`)."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from test_profile import H100_BF16, h100_profile

from rpegjax.perf.reference import presets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "benchmarks", "bench_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_references_are_the_datasheet_of_the_devices_preset_else_the_measured_rates():
    bench = _bench()
    peak, bandwidth, source = bench.references(h100_profile())
    assert (peak, bandwidth) == (H100_BF16, presets.h100_node(1).device.memory_bandwidth) and "H100" in source
    unknown = dataclasses.replace(h100_profile(), device_kind="NVIDIA L4")
    rates = unknown.rates["bfloat16"]
    assert bench.references(unknown) == (max(rates.matmul_flops, rates.layer_matmul_flops), unknown.memory_bandwidth,
                                         "measured here (no preset)")


def test_the_table_shows_every_part_and_how_each_ended(tmp_path):
    bench = _bench()
    (tmp_path / "update.json").write_text(json.dumps([bench._row("update", "qwen2.5-0.5b MFU", 0.41, "", "of bf16 peak")]))
    (tmp_path / "decode.json").write_text(json.dumps([bench._row("decode", "qwen2.5-0.5b decode step", 7.5, "ms")]))
    (tmp_path / "update-1.5b.json").write_text(json.dumps([bench._row("update", "qwen2.5-1.5b MFU", 0.45)]))
    (tmp_path / "status.txt").write_text("gpu-tests 0 41\nupdate 0 95\ndecode 124 120\nvalidate 1 3\n"
                                         "update-1.5b 0 70\nextra skipped 0\n")
    lines = bench.table(str(tmp_path)).splitlines()
    assert [line.split()[:3] for line in lines[:6]] == [
        ["status", "gpu-tests", "ok"], ["status", "update", "ok"], ["status", "decode", "TIMED"],
        ["status", "validate", "FAILED"], ["status", "update-1.5b", "ok"], ["status", "extra", "skipped"]]
    assert "qwen2.5-0.5b MFU" in lines[6] and "0.41" in lines[6] and "7.5" in lines[7] and "0.45" in lines[8]
    assert len(lines) == 9


def _run_small(out):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--small", "--part", "all",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [row for part in ("calibrate", "update", "decode", "validate")
            for row in json.loads((out / f"{part}.json").read_text())]
    return done.stdout, {row["metric"]: row for row in rows}


@pytest.mark.slow  # 100-200 s on 2 shared cores: a calibration, a GRPO update, two decode lengths, two runtime steps
def test_the_benchmark_runs_small_on_this_cpu(tmp_path):
    table, rows = _run_small(tmp_path)
    for metric in ("matmul bfloat16", "memory bandwidth", "all-reduce latency (2 devices)", "tiny GRPO update",
                   "tiny MFU", "tiny decode step", "tiny HBM roofline fraction", "tiny grpo step", "median |error|"):
        assert metric in rows and metric in table, metric
    assert 0 < rows["tiny MFU"]["value"] <= 1
    # no datasheet here: the reference is the stream rate measured on 8 MiB, and the tiny model's weights sit in the
    # CPU's caches, so a decode step can beat it; it must be a real, positive rate
    assert rows["tiny HBM roofline fraction"]["value"] > 0 and rows["tiny decode step"]["value"] > 0
    assert "measured here" in rows["tiny MFU"]["note"]


@pytest.mark.gpu
def test_the_benchmark_runs_small_on_the_gpu_against_its_datasheet(tmp_path):
    _, rows = _run_small(tmp_path)
    assert 0 < rows["tiny MFU"]["value"] <= 1 and 0 < rows["tiny HBM roofline fraction"]["value"] <= 1
    assert "datasheet" in rows["tiny MFU"]["note"] or "no preset" in rows["tiny MFU"]["note"]
