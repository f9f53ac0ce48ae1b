"""Hardware profiles: the file round-trips, bad files are refused naming the file and field, a profile replaces a
preset's assumed efficiencies and overheads (and the node level's α, β when it measured an all-reduce), and a
profile from another device is refused."""

import dataclasses
import json

import pytest

from rpegjax.models import ModelConfig
from rpegjax.perf.model import collectives, step_model
from rpegjax.perf.model.collectives import Group
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.reference import presets, profile
from rpegjax.perf.reference.profile import AllReduce, DtypeRates, HardwareProfile, ProfileError

H100_BF16 = 989e12


def h100_profile(*, matmul=0.6, attention=0.4, memory=0.75, all_reduce: AllReduce | None = None) -> HardwareProfile:
    """A profile as an H100 would measure it (rates as fractions of the datasheet's bf16 peak and HBM bandwidth)."""
    bf16 = DtypeRates(matmul_flops=0.8 * H100_BF16, layer_matmul_flops=matmul * H100_BF16, small_matmul_flops=3e13,
                      attention_flops=attention * H100_BF16, backward_efficiency=0.9)
    f32 = dataclasses.replace(bf16, matmul_flops=3e14, layer_matmul_flops=2.5e14, attention_flops=1e14)
    return HardwareProfile(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", devices=1 if all_reduce is None else
                           all_reduce.devices, memory_bytes=79e9, jax_version="0.10.2",
                           rates={"bfloat16": bf16, "float32": f32}, memory_bandwidth=memory * 3350e9,
                           dispatch_overhead_s=30e-6, kernel_overhead_s=4e-6, all_reduce=all_reduce)


def test_a_profile_round_trips_through_its_file(tmp_path):
    path = str(tmp_path / "p.json")
    original = h100_profile(all_reduce=AllReduce(devices=8, latency_s=3e-6, bandwidth=3e11,
                                                 samples=((4, 4.2e-5), (268435456, 1.6e-3))))
    original.write(path)
    document = json.loads(open(path).read())
    assert document["format"] == 1 and document["platform"] == "gpu" and "measured" in document
    assert profile.load_profile(path) == original
    single = h100_profile()
    single.write(path)
    assert profile.load_profile(path) == single and json.load(open(path))["measured"]["all_reduce"] is None


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format=2), "format 2 is not supported"),
    (lambda d: d.pop("device_kind"), "missing field 'device_kind'"),
    (lambda d: d.update(platform="fpga"), "field 'platform' must be"),
    (lambda d: d["measured"]["rates"]["bfloat16"].update(matmul_flops=-1.0), "'measured.rates.bfloat16.matmul_flops' must be positive"),
    (lambda d: d["measured"]["rates"]["bfloat16"].update(attention_flops="fast"), "'measured.rates.bfloat16.attention_flops' must be a finite number"),
    (lambda d: d["measured"]["rates"]["float32"].pop("backward_efficiency"), "missing field 'measured.rates.float32.backward_efficiency'"),
    (lambda d: d["measured"]["rates"]["float32"].update(backward_efficiency=1.5), "backward_efficiency' must be <= 1"),
    (lambda d: d["measured"].update(rates={}), "'measured.rates' names no dtype"),
    (lambda d: d["measured"].update(dispatch_overhead_s=None), "'measured.dispatch_overhead_s' must be a finite number"),
    (lambda d: d["measured"].update(all_reduce={"devices": 1, "latency_s": 0.0, "bandwidth": 1.0, "samples": []}),
     "'measured.all_reduce.devices' must be >= 2"),
    (lambda d: d.update(measured=[]), "field 'measured' must be dict"),
])
def test_bad_profiles_are_refused_naming_the_file_and_the_field(tmp_path, change, message):
    path = tmp_path / "bad.json"
    document = h100_profile().to_dict()
    change(document)
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileError, match=message) as error:
        profile.load_profile(str(path))
    assert str(path) in str(error.value)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ProfileError, match=r"missing.json: cannot be read"):
        profile.load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ProfileError, match="broken.json: not valid JSON"):
        profile.load_profile(str(tmp_path / "broken.json"))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ProfileError, match="list.json: the document must be a JSON object"):
        profile.load_profile(str(tmp_path / "list.json"))


def test_a_profile_fits_only_its_own_device():
    measured = h100_profile()
    profile.fits_preset(measured, "h100")
    for preset in ("h200", "gh200", "a100"):
        with pytest.raises(ProfileError, match="measured on 'NVIDIA H100 80GB HBM3' \\(gpu\\), not on"):
            profile.fits_preset(measured, preset)
    gh200 = dataclasses.replace(measured, device_kind="NVIDIA GH200 480GB")
    profile.fits_preset(gh200, "gh200")
    profile.fits_preset(gh200, "gh200-nvl32")
    with pytest.raises(ProfileError):  # "GH200" is not an H200
        profile.fits_preset(gh200, "h200")
    with pytest.raises(ProfileError, match=r"'cpu' \(cpu\)"):
        profile.fits_preset(dataclasses.replace(measured, platform="cpu", device_kind="cpu"), "h100")
    assert profile.preset_for_device_kind("NVIDIA H200") == "h200"
    assert profile.preset_for_device_kind("NVIDIA A100-SXM4-80GB") == "a100"
    assert profile.preset_for_device_kind("NVIDIA L4") is None


def test_the_measured_figures_replace_the_presets_assumptions():
    preset = presets.h100_node(8)
    measured = h100_profile()
    spec = profile.with_profile(preset, measured, dtype="bfloat16")
    device = spec.device
    assert device.peak_flops == preset.device.peak_flops  # the datasheet stays the MFU denominator
    assert device.matmul_seconds(1e15, "bfloat16") == pytest.approx(1e15 / (0.6 * H100_BF16))
    assert device.attention_seconds(1e15, "bfloat16") == pytest.approx(1e15 / (0.4 * H100_BF16))
    assert device.memory_seconds(1e12) == pytest.approx(1e12 / measured.memory_bandwidth)
    assert (device.backward_efficiency, device.dispatch_overhead_s, device.kernel_overhead_s) == (0.9, 30e-6, 4e-6)
    assert spec.levels == preset.levels  # one device measured: the preset's NVLink and network stay
    with pytest.raises(ProfileError, match="no measured rates for dtype 'float16'"):
        profile.with_profile(preset, measured, dtype="float16")
    with pytest.raises(ProfileError, match="matmul rate exceeds H100-SXM-80GB's datasheet figure"):
        profile.with_profile(preset, h100_profile(matmul=1.2), dtype="bfloat16")


@pytest.mark.parametrize("preset", [presets.h100_node(16), presets.gh200_quad(16)])
def test_a_measured_all_reduce_times_the_node_level(preset):
    """Switch (H100 NVSwitch) or full mesh (GH200 quad): the node level reproduces the measured all-reduce."""
    n = preset.levels[0].size
    samples = tuple((size, 2 * (n - 1) * 3e-6 + 2 * (n - 1) / n * size / 2e11) for size in (4, 2**28))
    measured = dataclasses.replace(h100_profile(), device_kind="NVIDIA GH200 480GB" if n == 4 else "NVIDIA H100",
                                   devices=n, all_reduce=AllReduce(devices=n, latency_s=3e-6, bandwidth=2e11,
                                                                   samples=samples))
    spec = profile.with_profile(preset, measured, dtype="bfloat16")
    for num_bytes, seconds in samples:
        assert collectives.all_reduce_seconds(num_bytes, spec, Group(size=n)) == pytest.approx(seconds, rel=1e-12)
    assert spec.levels[1:] == preset.levels[1:]
    too_many = dataclasses.replace(measured.all_reduce, devices=2 * n)
    with pytest.raises(ProfileError, match=f"spans {2 * n} devices, more than one node"):
        profile.with_profile(preset, dataclasses.replace(measured, all_reduce=too_many), dtype="bfloat16")


def test_halving_the_measured_matmul_rate_slows_the_compute_bound_stages():
    model = ModelConfig.qwen2p5("1.5b")
    workload = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
    preset = presets.h100_node(8)

    def stages(measured):
        evaluator = step_model.Evaluator.for_runtime(model, workload, profile.with_profile(preset, measured, dtype="bfloat16"))
        from rpegjax.perf import planner

        plan = planner.verl_like(evaluator, algorithm="grpo", num_devices=8)
        return {s.name: s for s in plan.prediction.stages}, plan.prediction.step_seconds

    fast, fast_step = stages(h100_profile(matmul=0.6, attention=0.4))
    slow, slow_step = stages(h100_profile(matmul=0.3, attention=0.2))
    assert slow_step > fast_step
    updates = [name for name in fast if "update" in name]
    assert updates
    for name in updates:  # a training update is compute-bound: about twice as long
        assert slow[name].seconds > 1.5 * fast[name].seconds
    for name in fast:
        assert slow[name].seconds >= fast[name].seconds
    # the memory-bound decode does not care about the matmul rate as much as the update does
    assert slow["generate"].seconds / fast["generate"].seconds < min(slow[n].seconds / fast[n].seconds for n in updates)
