"""Calibration on this machine: the float32 spec, the profile it writes (rates per dtype, the all-reduce over the 8
virtual devices fitted to the α–β formula), the CLI; on a GPU, the profile fits its preset."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from rpegjax.perf.model import collectives
from rpegjax.perf.model.collectives import Group
from rpegjax.perf.reference import calibration, presets, profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_calibrate_measures_this_machine_and_writes_its_profile(tmp_path):
    path = str(tmp_path / "profile.json")
    spec, measured = calibration.calibrate(sizes=calibration.Sizes.smoke(), repeats=3, profile=path)
    for value in (measured.matmul_flops, measured.layer_matmul_flops, measured.memory_bandwidth, measured.small_matmul_flops,
                  measured.attention_flops):
        assert math.isfinite(value) and value > 1e6
    assert 0 < measured.backward_efficiency <= 1 and spec.device.backward_efficiency == measured.backward_efficiency
    assert spec.device.attention_seconds(1e9, "float32") == pytest.approx(
        1e9 / min(measured.attention_flops, spec.device.flops("float32")))
    assert 0 < measured.dispatch_overhead_s < 0.1 and 0 <= measured.kernel_overhead_s < 0.01
    peak = max(measured.matmul_flops, measured.layer_matmul_flops)
    assert spec.device.flops("float32") == peak
    # a layer's matmuls take flops / (peak x efficiency) = flops / the measured layer rate
    assert spec.device.matmul_seconds(1e9, "float32") == pytest.approx(1e9 / measured.layer_matmul_flops)
    assert spec.device.memory_bandwidth == measured.memory_bandwidth
    assert spec.num_devices == 1

    written = profile.load_profile(path)
    assert written.platform == "cpu" and written.device_kind == "cpu" and written.devices == 8
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert written.memory_bytes == pytest.approx(ram / 8)  # the 8 virtual devices share the host's memory
    assert set(written.rates) == {"float32", "bfloat16"}
    assert written.rates["float32"] == profile.DtypeRates(**{f.name: getattr(measured, f.name)
                                                             for f in dataclasses.fields(profile.DtypeRates)})
    assert all(r.matmul_flops > 1e6 for r in written.rates.values())
    # the all-reduce over the 8 devices: the ring formula with the fitted α, β gives back both measured times
    all_reduce = written.all_reduce
    assert all_reduce is not None and all_reduce.devices == 8 and all_reduce.bandwidth > 0 and all_reduce.latency_s >= 0
    planned = profile.spec_from_profile(written, dtype="float32", num_devices=8)
    for num_bytes, seconds in all_reduce.samples:
        assert collectives.all_reduce_seconds(num_bytes, planned, Group(size=8)) == pytest.approx(seconds, rel=1e-9, abs=1e-9)
    assert profile.load_profile(path) == written  # the file round-trips


def test_the_median_calibration_ignores_one_disturbed_measurement():
    fields = [f.name for f in dataclasses.fields(calibration.Calibration)]
    quiet = calibration.Calibration(**{name: 1.0 for name in fields})
    disturbed = calibration.Calibration(**{name: 0.1 for name in fields})
    assert calibration.median_calibration([quiet, disturbed, quiet]) == quiet
    two = calibration.median_calibration([quiet, disturbed])
    assert all(getattr(two, name) == pytest.approx(0.55) for name in fields)
    with pytest.raises(ValueError, match="at least one"):
        calibration.median_calibration([])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        calibration.calibrate(rounds=0)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        calibration.measure_profile(rounds=0)


@pytest.mark.slow  # ~30 s on 2 shared cores (JAX start-up and a dozen compilations); the library path is tested above
def test_the_cli_writes_a_profile(tmp_path):
    path = tmp_path / "profile.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    module = "rpegjax.perf.reference.calibration"
    done = subprocess.run([sys.executable, "-m", module, "--out", str(path), "--dtypes", "bfloat16",
                           "--rounds", "1", "--repeats", "2", "--sizes", "smoke"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "all-reduce over 2 devices" in done.stdout and f"written: {path}" in done.stdout
    written = profile.load_profile(str(path))
    assert set(written.rates) == {"bfloat16"} and written.devices == 2
    bad = subprocess.run([sys.executable, "-m", module, "--out", str(path), "--dtypes", "int3"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "--dtypes: ['int3'] given" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.gpu
def test_a_gpu_profile_fits_its_preset_and_the_planner_takes_it(tmp_path):
    import jax

    measured = calibration.measure_profile(dtypes=("float32", "bfloat16"), repeats=3, sizes=calibration.Sizes.gpu())
    device = jax.devices()[0]
    assert measured.platform == "gpu" and measured.device_kind == device.device_kind
    assert measured.rates["bfloat16"].matmul_flops > measured.rates["float32"].matmul_flops
    name = profile.preset_for_device_kind(device.device_kind)
    if name is None:
        pytest.skip(f"no preset for {device.device_kind!r}")
    spec = profile.with_profile(presets.preset(name, 8), measured, dtype="bfloat16")  # refuses rates over the datasheet
    assert 0 < spec.device.matmul_efficiency <= 1 and 0 < spec.device.memory_efficiency <= 1
    # the planner takes it: scripts/plan.py on this GPU's preset with the measured figures
    path = tmp_path / "profile.json"
    measured.write(str(path))
    plan = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), "--model", "qwen2.5-0.5b",
                           "--hardware", name, "--hardware-profile", str(path), "--gpus", "8", "--prompts", "16",
                           "--group-size", "4", "--prompt-tokens", "256", "--response-mean", "512", "--response-max",
                           "2048", "--top", "0", "--json"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["plans"][0]["prediction"]["fits"]
