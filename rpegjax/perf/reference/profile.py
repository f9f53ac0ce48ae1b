"""Hardware profiles: what `rpegjax.perf.reference.calibration` measured on one machine, as a versioned JSON file,
and the spec that puts those measurements in place of a preset's assumed efficiencies and overheads.

File (format 1):

    {"format": 1, "platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "devices": 1,
     "memory_bytes": ... (per device; a CPU's RAM split over its virtual devices), "jax_version": "0.10.2",
     "measured": {"rates": {"bfloat16": {"matmul_flops": ..., "layer_matmul_flops": ..., "small_matmul_flops": ...,
                                         "attention_flops": ..., "backward_efficiency": ...}, "float32": {...}},
                  "memory_bandwidth": ..., "dispatch_overhead_s": ..., "kernel_overhead_s": ...,
                  "all_reduce": null | {"devices": 8, "latency_s": ..., "bandwidth": ...,
                                        "samples": [[bytes, seconds], [bytes, seconds]]}}}

Units: FLOP/s, bytes/s, bytes, seconds. `all_reduce` is null on a machine with one device: nothing was measured,
and a preset's levels stay as they are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from rpegjax.perf.model.hardware import DeviceSpec, HardwareSpec, Level, Topology

if TYPE_CHECKING:
    from rpegjax.perf.reference.calibration import Calibration

FORMAT = 1

# The token a preset's device has in JAX's `device_kind` ("NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", ...).
PRESET_DEVICE_KINDS: Mapping[str, str] = MappingProxyType({
    "gh200": "GH200", "gh200-nvl32": "GH200", "gb200-nvl72": "GB200", "h100": "H100", "h200": "H200", "a100": "A100"})


class ProfileError(ValueError):
    """A profile file that cannot be read or does not fit the hardware it is applied to."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DtypeRates:
    """Measured FLOP/s with operands in one dtype (see `calibration.Calibration`)."""

    matmul_flops: float
    layer_matmul_flops: float
    small_matmul_flops: float
    attention_flops: float
    backward_efficiency: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduce:
    """The ring all-reduce over `devices` local devices: α (seconds per step) and β (bytes/s per device), fitted
    to `samples` = ((bytes per device, seconds), ...) less one dispatch."""

    devices: int
    latency_s: float
    bandwidth: float
    samples: tuple[tuple[float, float], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One machine as `rpegjax.perf.reference.calibration` measured it: its first device's rates per dtype, memory
    bandwidth and overheads, `devices` local devices of `memory_bytes` each, and the all-reduce over them (None with one)."""

    platform: str
    device_kind: str
    devices: int
    memory_bytes: float
    jax_version: str
    rates: Mapping[str, DtypeRates]
    memory_bandwidth: float
    dispatch_overhead_s: float
    kernel_overhead_s: float
    all_reduce: AllReduce | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", MappingProxyType(dict(self.rates)))

    @classmethod
    def from_calibrations(cls, calibrations: Mapping[str, Calibration], *, shared: Calibration, **fields: Any
                          ) -> HardwareProfile:
        """The rates of each dtype's calibration; bandwidth and overheads from `shared`."""
        rates = {dtype: DtypeRates(**{f.name: getattr(c, f.name) for f in dataclasses.fields(DtypeRates)})
                 for dtype, c in calibrations.items()}
        return cls(rates=rates, memory_bandwidth=shared.memory_bandwidth, dispatch_overhead_s=shared.dispatch_overhead_s,
                   kernel_overhead_s=shared.kernel_overhead_s, **fields)

    # ------------------------------------------------------------------------------------------- file
    def to_dict(self) -> dict[str, Any]:
        measured = {"rates": {dtype: dataclasses.asdict(r) for dtype, r in self.rates.items()},
                    "memory_bandwidth": self.memory_bandwidth, "dispatch_overhead_s": self.dispatch_overhead_s,
                    "kernel_overhead_s": self.kernel_overhead_s,
                    "all_reduce": None if self.all_reduce is None else {
                        "devices": self.all_reduce.devices, "latency_s": self.all_reduce.latency_s,
                        "bandwidth": self.all_reduce.bandwidth, "samples": [list(s) for s in self.all_reduce.samples]}}
        return {"format": FORMAT, "platform": self.platform, "device_kind": self.device_kind, "devices": self.devices,
                "memory_bytes": self.memory_bytes, "jax_version": self.jax_version, "measured": measured}

    def write(self, path: str) -> None:
        with open(path, "w") as file:
            json.dump(self.to_dict(), file, indent=1, allow_nan=False)
            file.write("\n")

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "profile") -> HardwareProfile:
        """Checks every field (the message names `where` and the field) and builds the profile."""
        fields = _Fields(data, where)
        version = fields.get("format", int)
        if version != FORMAT:
            raise ProfileError(f"{where}: format {version} is not supported (this rpegjax reads format {FORMAT})")
        platform = fields.get("platform", str)
        if platform not in ("gpu", "tpu", "cpu"):
            raise ProfileError(f"{where}: field 'platform' must be 'gpu', 'tpu' or 'cpu', got {platform!r}")
        measured = fields.section("measured")
        rates_section = measured.section("rates")
        if not rates_section.data:
            raise ProfileError(f"{where}: field 'measured.rates' names no dtype")
        rates = {}
        for dtype in rates_section.data:
            entry = rates_section.section(dtype)
            rates[dtype] = DtypeRates(**{f.name: entry.positive(f.name) for f in dataclasses.fields(DtypeRates)})
            if rates[dtype].backward_efficiency > 1:
                raise ProfileError(f"{where}: field 'measured.rates.{dtype}.backward_efficiency' must be <= 1, "
                                   f"got {rates[dtype].backward_efficiency!r}")
        all_reduce = None
        if measured.data.get("all_reduce") is not None:
            section = measured.section("all_reduce")
            devices = section.get("devices", int)
            if devices < 2:
                raise ProfileError(f"{where}: field 'measured.all_reduce.devices' must be >= 2, got {devices!r}")
            samples = section.get("samples", list)
            if not all(isinstance(s, list) and len(s) == 2 and all(_number(x) for x in s) for s in samples):
                raise ProfileError(f"{where}: field 'measured.all_reduce.samples' must be a list of [bytes, seconds]")
            all_reduce = AllReduce(devices=devices, latency_s=section.non_negative("latency_s"),
                                   bandwidth=section.positive("bandwidth"), samples=tuple(tuple(s) for s in samples))
        return cls(platform=platform, device_kind=fields.get("device_kind", str), devices=fields.get("devices", int),
                   memory_bytes=fields.positive("memory_bytes"), jax_version=fields.get("jax_version", str),
                   rates=rates, memory_bandwidth=measured.positive("memory_bandwidth"),
                   dispatch_overhead_s=measured.non_negative("dispatch_overhead_s"),
                   kernel_overhead_s=measured.non_negative("kernel_overhead_s"), all_reduce=all_reduce)

    # ------------------------------------------------------------------------------------- reading it
    def dtype_rates(self, dtype: str) -> DtypeRates:
        if dtype not in self.rates:
            raise ProfileError(f"the hardware profile ({self.device_kind}) has no measured rates for dtype {dtype!r}; "
                               f"measured: {sorted(self.rates)}")
        return self.rates[dtype]

    def summary(self) -> str:
        lines = [f"{self.devices} x {self.device_kind} ({self.platform}), JAX {self.jax_version}"]
        for dtype, r in self.rates.items():
            lines.append(f"  {dtype:9s} matmul {r.matmul_flops / 1e12:8.3f} TFLOP/s, layer matmuls "
                         f"{r.layer_matmul_flops / 1e12:8.3f}, attention {r.attention_flops / 1e12:8.3f}, decode-like "
                         f"{r.small_matmul_flops / 1e12:8.3f}, backward efficiency {r.backward_efficiency:.2f}")
        lines.append(f"  memory bandwidth {self.memory_bandwidth / 1e9:.1f} GB/s, dispatch "
                     f"{self.dispatch_overhead_s * 1e6:.1f} us, kernel {self.kernel_overhead_s * 1e6:.2f} us")
        if self.all_reduce is None:
            lines.append("  all-reduce: not measured (one device)")
        else:
            a = self.all_reduce
            lines.append(f"  all-reduce over {a.devices} devices: latency {a.latency_s * 1e6:.2f} us per step, "
                         f"bandwidth {a.bandwidth / 1e9:.2f} GB/s per device")
        return "\n".join(lines)


def load_profile(path: str) -> HardwareProfile:
    """Reads a profile written by `HardwareProfile.write`; a bad file is a `ProfileError` naming it and the field."""
    try:
        with open(path) as file:
            data = json.load(file)
    except OSError as error:
        raise ProfileError(f"hardware profile {path}: cannot be read ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"hardware profile {path}: not valid JSON ({error})") from None
    return HardwareProfile.from_dict(data, where=f"hardware profile {path}")


# ------------------------------------------------------------------------------------------- applying it
def fits_preset(profile: HardwareProfile, preset_name: str) -> None:
    """Refuses a profile measured on another device than the preset's (platform and device kind)."""
    if preset_name not in PRESET_DEVICE_KINDS:
        raise ProfileError(f"hardware preset {preset_name!r} names no device kind; known: {sorted(PRESET_DEVICE_KINDS)}")
    wanted = PRESET_DEVICE_KINDS[preset_name]
    if profile.platform != "gpu" or wanted.upper() not in _tokens(profile.device_kind):
        raise ProfileError(f"the hardware profile was measured on {profile.device_kind!r} ({profile.platform}), not on "
                           f"the {wanted} of preset {preset_name!r}")


def preset_for_device_kind(device_kind: str) -> str | None:
    """The first preset whose device this is (`h100` for "NVIDIA H100 80GB HBM3"), None when no preset fits."""
    tokens = _tokens(device_kind)
    return next((name for name, token in PRESET_DEVICE_KINDS.items() if token.upper() in tokens), None)


def with_profile(hardware: HardwareSpec, profile: HardwareProfile, *, dtype: str) -> HardwareSpec:
    """`hardware` (a datasheet preset) with the measured device figures: matmul, attention and memory efficiencies
    = the measured `dtype` rates over the datasheet peaks (kept, so that MFU stays against the datasheet), the
    measured backward efficiency and overheads; the innermost level's α and β from the measured all-reduce when
    there is one (more than one local device), else the preset's levels unchanged."""
    rates = profile.dtype_rates(dtype)
    device = hardware.device
    peak = device.flops(dtype)
    efficiencies = {"matmul_efficiency": rates.layer_matmul_flops / peak,
                    "attention_efficiency": rates.attention_flops / peak,
                    "memory_efficiency": profile.memory_bandwidth / device.memory_bandwidth}
    for name, value in efficiencies.items():
        if value > 1:
            raise ProfileError(f"the hardware profile's {name.replace('_efficiency', '')} rate exceeds {device.name}'s "
                               f"datasheet figure ({value:.2f} of it): the profile is not of this device")
    device = dataclasses.replace(device, **efficiencies, backward_efficiency=rates.backward_efficiency,
                                 kernel_overhead_s=profile.kernel_overhead_s,
                                 dispatch_overhead_s=profile.dispatch_overhead_s)
    levels = hardware.levels
    if profile.all_reduce is not None:
        inner = levels[0]
        if profile.all_reduce.devices > inner.size:
            raise ProfileError(f"the hardware profile's all-reduce spans {profile.all_reduce.devices} devices, more than "
                               f"one {inner.name} of {hardware.name!r} ({inner.size})")
        levels = (measured_level(inner, profile.all_reduce), *levels[1:])
    return dataclasses.replace(hardware, device=device, levels=levels)


def measured_level(level: Level, all_reduce: AllReduce) -> Level:
    """`level` with the α and β that make the ring all-reduce formula give the measured times (on a full mesh,
    β is shared by the n − 1 links a device drives)."""
    links = all_reduce.devices - 1 if level.topology is Topology.FULL_MESH else 1
    return dataclasses.replace(level, bandwidth=all_reduce.bandwidth / links, latency=all_reduce.latency_s)


def spec_from_profile(profile: HardwareProfile, *, dtype: str, num_devices: int = 1,
                      name: str | None = None) -> HardwareSpec:
    """A spec of this machine alone (no datasheet): peak per dtype = the faster of the square and the layer matmul
    rates, efficiencies relative to `dtype`'s peak, memory efficiency 1 (the stream rate is attained), one level of
    `num_devices` devices timed by the measured all-reduce (a plan on more devices than were measured is refused)."""
    rates = profile.dtype_rates(dtype)
    peaks = {d: max(r.matmul_flops, r.layer_matmul_flops) for d, r in profile.rates.items()}
    name = name or f"profiled-{profile.platform}"
    device = DeviceSpec(
        name=f"{profile.device_kind} (measured)", peak_flops=peaks, memory_bytes=profile.memory_bytes,
        memory_bandwidth=profile.memory_bandwidth, matmul_efficiency=rates.layer_matmul_flops / peaks[dtype],
        attention_efficiency=min(1.0, rates.attention_flops / peaks[dtype]), backward_efficiency=rates.backward_efficiency,
        memory_efficiency=1.0, kernel_overhead_s=profile.kernel_overhead_s,
        dispatch_overhead_s=profile.dispatch_overhead_s, platform=profile.platform)
    if num_devices == 1:
        level = Level(name="host", size=1, bandwidth=profile.memory_bandwidth, latency=0.0)
    elif profile.all_reduce is None or num_devices > profile.all_reduce.devices:
        measured = 1 if profile.all_reduce is None else profile.all_reduce.devices
        raise ProfileError(f"the hardware profile measured collectives over {measured} device(s); a plan on "
                           f"{num_devices} would extrapolate them")
    else:
        level = measured_level(Level(name="host", size=num_devices, bandwidth=1.0, latency=0.0), profile.all_reduce)
    return HardwareSpec(name=name, device=device, num_devices=num_devices, levels=(level,), usable_memory_fraction=0.9)


# ------------------------------------------------------------------------------------------- helpers
def _tokens(device_kind: str) -> set[str]:
    return set(re.split(r"[^A-Z0-9]+", device_kind.upper()))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class _Fields:
    """One JSON object of a profile and its path, for messages that name the field."""

    data: Any
    where: str
    path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.data, dict):
            raise ProfileError(f"{self.where}: {f'field {self.path!r}' if self.path else 'the document'} must be a "
                               f"JSON object, got {type(self.data).__name__}")

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: type) -> Any:
        if key not in self.data:
            raise ProfileError(f"{self.where}: missing field {self._name(key)!r}")
        value = self.data[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProfileError(f"{self.where}: field {self._name(key)!r} must be {kind.__name__}, got {value!r}")
        return value

    def section(self, key: str) -> _Fields:
        self.get(key, dict)
        return _Fields(self.data[key], self.where, self._name(key))

    def _number(self, key: str) -> float:
        if key not in self.data:
            raise ProfileError(f"{self.where}: missing field {self._name(key)!r}")
        value = self.data[key]
        if not _number(value):
            raise ProfileError(f"{self.where}: field {self._name(key)!r} must be a finite number, got {value!r}")
        return float(value)

    def positive(self, key: str) -> float:
        value = self._number(key)
        if value <= 0:
            raise ProfileError(f"{self.where}: field {self._name(key)!r} must be positive, got {value!r}")
        return value

    def non_negative(self, key: str) -> float:
        value = self._number(key)
        if value < 0:
            raise ProfileError(f"{self.where}: field {self._name(key)!r} must be >= 0, got {value!r}")
        return value
