"""Hardware specs for the performance model: one device type inside a GPU -> node -> rack -> cluster hierarchy.

A `HardwareSpec` is a device (peak FLOP/s per dtype, memory capacity and bandwidth, fixed overheads) and an
ordered tuple of `Level`s, innermost first. Level i groups `levels[i].size` consecutive device indices
(a node, a rack, the cluster); a transfer between two devices uses the innermost level that contains both.
Collective costs (α–β, hierarchical) live in `rpegjax.perf.model.collectives`.

The clusters themselves, with their datasheet figures, are the presets of `rpegjax.perf.reference.presets`;
`rpegjax.perf.reference.calibration` measures the local machine instead, and `rpegjax.perf.reference.profile`
puts its measurements in place of a preset's assumptions.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from types import MappingProxyType

GB = 1e9
TFLOPS = 1e12
GIB = 1024**3


class Topology(enum.StrEnum):
    """How the devices of one unit of a level are wired."""

    SWITCH = "switch"  # every device reaches every other through a switch at `bandwidth` (NVSwitch, fat tree)
    FULL_MESH = "full_mesh"  # a direct link per device pair at `bandwidth`, no switch (GH200 quad node)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Level:
    """One level of the hierarchy.

    size: devices in one unit of this level (a node of 4, a rack of 32, a cluster of 256).
    bandwidth: bytes/s per direction available to one device for traffic at this level — per device for a
      switch, per device *pair* for a full mesh (a device then drives `peers` links at once).
    latency: α, seconds per message (per ring step) at this level.
    """

    name: str
    size: int
    bandwidth: float
    latency: float
    topology: Topology = Topology.SWITCH

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", Topology(self.topology))
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Level {self.name!r}: size must be a positive integer, got {self.size!r}")
        if self.bandwidth <= 0:
            raise ValueError(f"Level {self.name!r}: bandwidth must be positive, got {self.bandwidth!r}")
        if self.latency < 0:
            raise ValueError(f"Level {self.name!r}: latency must be >= 0, got {self.latency!r}")

    def device_bandwidth(self, peers: int) -> float:
        """Bytes/s per direction one device sustains while exchanging with `peers` others at this level."""
        if self.topology is Topology.FULL_MESH:
            return self.bandwidth * max(1, peers)
        return self.bandwidth


PLATFORMS = ("gpu", "tpu", "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU host treated as a device).

    peak_flops: dense FLOP/s per compute dtype name ("float32", "bfloat16", "float16").
    matmul_efficiency: fraction of peak that large matmuls reach in practice (assumption).
    attention_efficiency: fraction of peak that the attention score and value matmuls reach; None = as matmuls.
    backward_efficiency: rate of backward-pass matmul FLOPs relative to forward ones (1 = the same rate).
    memory_efficiency: fraction of `memory_bandwidth` that streaming kernels reach (assumption).
    kernel_overhead_s: fixed cost of one kernel inside a compiled program (launch, small-op floor).
    dispatch_overhead_s: fixed cost of dispatching one jit-compiled program from the host.
    host_memory_bytes / host_bandwidth: host memory reachable from the device and its per-direction link.
    cuda_memory_bytes: device memory as the CUDA runtime reports it (`cudaMemGetInfo`'s total), which a serving
      engine's memory fraction applies to (vLLM's `gpu_memory_utilization`); None where no such figure is recorded
      (`reported_memory_bytes` then says the datasheet's `memory_bytes`).
    platform: the JAX backend that runs on it ("gpu", "tpu" or "cpu"): which kernels the runtime can use there.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float = 0.7
    attention_efficiency: float | None = None
    backward_efficiency: float = 1.0
    memory_efficiency: float = 0.8
    kernel_overhead_s: float = 5e-6
    dispatch_overhead_s: float = 50e-6
    host_memory_bytes: float = 0.0
    host_bandwidth: float = 0.0
    cuda_memory_bytes: float | None = None
    platform: str = "gpu"

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"DeviceSpec {self.name!r}: platform must be one of {PLATFORMS}, got {self.platform!r}")
        if not self.peak_flops:
            raise ValueError(f"DeviceSpec {self.name!r}: peak_flops needs at least one dtype")
        for dtype, value in self.peak_flops.items():
            if value <= 0:
                raise ValueError(f"DeviceSpec {self.name!r}: peak_flops[{dtype!r}] must be positive, got {value!r}")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        for name in ("memory_bytes", "memory_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {name} must be positive, got {getattr(self, name)!r}")
        for name in ("matmul_efficiency", "memory_efficiency", "backward_efficiency", "attention_efficiency"):
            if name == "attention_efficiency" and self.attention_efficiency is None:
                continue
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"DeviceSpec {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("kernel_overhead_s", "dispatch_overhead_s", "host_memory_bytes", "host_bandwidth"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.cuda_memory_bytes is not None and not self.cuda_memory_bytes > 0:
            raise ValueError(f"DeviceSpec {self.name!r}: cuda_memory_bytes must be positive or None, "
                             f"got {self.cuda_memory_bytes!r}")

    @property
    def reported_memory_bytes(self) -> float:
        """The memory a serving engine's fraction applies to: CUDA's total where recorded, else the datasheet's."""
        return self.memory_bytes if self.cuda_memory_bytes is None else self.cuda_memory_bytes

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for matmuls computed in `dtype`."""
        if dtype not in self.peak_flops:
            raise ValueError(f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; known: {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]

    def matmul_seconds(self, flops: float, dtype: str) -> float:
        return flops / (self.flops(dtype) * self.matmul_efficiency)

    def attention_seconds(self, flops: float, dtype: str) -> float:
        efficiency = self.matmul_efficiency if self.attention_efficiency is None else self.attention_efficiency
        return flops / (self.flops(dtype) * efficiency)

    def memory_seconds(self, num_bytes: float) -> float:
        return num_bytes / (self.memory_bandwidth * self.memory_efficiency)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """`num_devices` devices of one kind in a hierarchy of levels (innermost first, sizes dividing each other)."""

    name: str
    device: DeviceSpec
    num_devices: int
    levels: tuple[Level, ...]
    usable_memory_fraction: float = 0.9  # the rest is left to the runtime, allocator fragmentation and buffers

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"HardwareSpec {self.name!r}: num_devices must be a positive integer, got {self.num_devices!r}")
        if not self.levels:
            raise ValueError(f"HardwareSpec {self.name!r}: needs at least one level")
        for inner, outer in zip(self.levels, self.levels[1:]):
            if outer.size <= inner.size or outer.size % inner.size:
                raise ValueError(
                    f"HardwareSpec {self.name!r}: level {outer.name!r} (size {outer.size}) must be a larger multiple of "
                    f"level {inner.name!r} (size {inner.size})"
                )
        if self.levels[-1].size < self.num_devices:
            raise ValueError(
                f"HardwareSpec {self.name!r}: outermost level {self.levels[-1].name!r} holds {self.levels[-1].size} "
                f"devices, fewer than num_devices={self.num_devices}"
            )
        if not 0 < self.usable_memory_fraction <= 1:
            raise ValueError(f"HardwareSpec {self.name!r}: usable_memory_fraction must be in (0, 1], got {self.usable_memory_fraction!r}")

    @property
    def node_size(self) -> int:
        return self.levels[0].size

    @property
    def usable_memory_bytes(self) -> float:
        return self.device.memory_bytes * self.usable_memory_fraction

    def with_devices(self, num_devices: int) -> HardwareSpec:
        """The same hardware with `num_devices` devices; the outermost level grows when needed."""
        levels = list(self.levels)
        if levels[-1].size < num_devices:
            unit = levels[-2].size if len(levels) > 1 else 1
            size = -(-num_devices // unit) * unit
            levels[-1] = dataclasses.replace(levels[-1], size=size)
        return dataclasses.replace(self, num_devices=num_devices, levels=tuple(levels))

    def level_index(self, first: int, second: int) -> int:
        """Index of the innermost level whose unit contains both device indices."""
        for index, level in enumerate(self.levels):
            if first // level.size == second // level.size:
                return index
        return len(self.levels) - 1
