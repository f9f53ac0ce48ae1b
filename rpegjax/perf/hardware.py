"""Hardware specs for the performance model: one device type inside a GPU -> node -> rack -> cluster hierarchy.

A `HardwareSpec` is a device (peak FLOP/s per dtype, memory capacity and bandwidth, fixed overheads) and an
ordered tuple of `Level`s, innermost first. Level i groups `levels[i].size` consecutive device indices
(a node, a rack, the cluster); a transfer between two devices uses the innermost level that contains both.
Collective costs (α–β, hierarchical) live in `rpegjax.perf.collectives`.

Peak figures are vendor datasheet numbers (cited beside each preset). Efficiency factors and per-kernel
overheads are *assumptions* (stated where they are set), never fitted to the validation figures;
`rpegjax.perf.calibration` measures the local machine instead, and `rpegjax.perf.profile` puts its
measurements in place of a preset's assumptions.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
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


# ------------------------------------------------------------------------------------------- presets
# Sources:
# [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16/FP16, 494 TFLOP/s dense TF32,
#        80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s bidirectional (450 GB/s per direction).
# [H200] NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s,
#        NVLink 900 GB/s bidirectional.
# [DGX-H100] NVIDIA DGX H100 user guide: 8 GPUs on four NVSwitch chips; 8 ConnectX-7 at 400 Gb/s, one per GPU
#        (= 50 GB/s per direction per GPU to the network); 2 TB of system memory (256 GB per GPU), each GPU on a
#        PCIe Gen5 x16 link to the host (64 GB/s per direction); DGX H200 the same.
# [GH200] NVIDIA GH200 Grace Hopper Superchip datasheet / whitepaper: H100 with 96 GB HBM3 at 4 TB/s,
#        989 TFLOP/s dense BF16, NVLink-C2C 900 GB/s bidirectional (450 GB/s per direction) to Grace memory.
# [GH200-quad] HPE Cray EX254n blade as deployed at CSCS Alps (CSCS user documentation, "GH200 nodes"):
#        4 GH200 per node, all-to-all NVLink between the four GPUs at 150 GB/s per direction per pair (no
#        NVSwitch), 120 GB LPDDR5X per Grace, 4 Slingshot-11 NICs at 200 Gb/s = 25 GB/s per direction per GPU.
# [NVL32] NVIDIA GH200 NVL32 (DGX GH200 NVL32 / AWS Ceiba) product brief: 32 GH200 (144 GB HBM3e at 4.9 TB/s)
#        in one NVLink Switch domain at 900 GB/s bidirectional per GPU; one ConnectX-7 400 Gb/s per superchip.
# [GB200-NVL72] NVIDIA GB200 NVL72 datasheet (specification table, per GB200 superchip = 1 Grace + 2 Blackwell
#        GPUs; tensor figures there are with sparsity, dense is half): 10 PFLOP/s FP16/BF16 and 5 PFLOP/s TF32 per
#        superchip = 2.5 and 1.25 PFLOP/s dense per GPU; 372 GB HBM3e at 16 TB/s = 186 GB at 8 TB/s per GPU (the
#        rack: 13.4 TB at 576 TB/s over 72 GPUs); NVLink 5 at 3.6 TB/s per superchip = 1.8 TB/s bidirectional
#        (900 GB/s per direction) per GPU, 72 GPUs in one NVLink Switch domain; 480 GB LPDDR5X per Grace (240 GB
#        per GPU) on NVLink-C2C at 900 GB/s bidirectional per superchip (225 GB/s per direction per GPU, the two
#        GPUs sharing it: an assumption); compute trays of 4 GPUs with one 400 Gb/s ConnectX-7 per GPU (50 GB/s per
#        direction) to the network beyond the rack.
# [A100] NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB): 312 TFLOP/s dense BF16, 156 TFLOP/s TF32,
#        80 GB HBM2e at 2,039 GB/s, NVLink 3 at 600 GB/s bidirectional (300 GB/s per direction).
# [DGX-A100] NVIDIA DGX A100 user guide / Selene SuperPOD: 8 GPUs on NVSwitch, 8 HDR InfiniBand 200 Gb/s
#        (= 25 GB/s per direction per GPU).
# Latencies are assumptions of the usual order for NCCL: ~2 µs per step over NVLink, ~5 µs inside a rack's
# network (one switch hop), ~10 µs across the cluster (three hops). Efficiencies (0.7 of peak for large
# matmuls, 0.8 of HBM bandwidth for streaming kernels) and overheads (5 µs per kernel, 50 µs per program
# dispatch) are assumptions of the same order as commonly reported figures; they are not fitted to anything.

_HOPPER_FLOPS = {"bfloat16": 989 * TFLOPS, "float16": 989 * TFLOPS, "float32": 494 * TFLOPS}  # [H100]/[GH200]; f32 = TF32


def _network_levels(node: Level, *, per_gpu_bandwidth: float, rack_size: int, num_devices: int) -> tuple[Level, ...]:
    rack = Level(name="rack", size=rack_size, bandwidth=per_gpu_bandwidth, latency=5e-6)
    cluster_size = max(num_devices, 2 * rack_size)
    cluster_size = -(-cluster_size // rack_size) * rack_size
    cluster = Level(name="cluster", size=cluster_size, bandwidth=per_gpu_bandwidth, latency=10e-6)
    return node, rack, cluster


def gh200_quad(num_devices: int = 256) -> HardwareSpec:
    """Nodes of 4 GH200 (96 GB HBM3) with an NVLink full mesh inside the node [GH200], [GH200-quad]."""
    device = DeviceSpec(name="GH200-96GB", peak_flops=_HOPPER_FLOPS, memory_bytes=96 * GB, memory_bandwidth=4000 * GB,
                        host_memory_bytes=120 * GB, host_bandwidth=450 * GB)
    node = Level(name="node", size=4, bandwidth=150 * GB, latency=2e-6, topology=Topology.FULL_MESH)
    levels = _network_levels(node, per_gpu_bandwidth=25 * GB, rack_size=32, num_devices=num_devices)
    return HardwareSpec(name="gh200", device=device, num_devices=num_devices, levels=levels)


def gh200_nvl32(num_devices: int = 32) -> HardwareSpec:
    """GH200 NVL32 racks: 32 GPUs in one NVLink switch domain [NVL32]."""
    device = DeviceSpec(name="GH200-144GB", peak_flops=_HOPPER_FLOPS, memory_bytes=144 * GB, memory_bandwidth=4900 * GB,
                        host_memory_bytes=480 * GB, host_bandwidth=450 * GB)
    domain = Level(name="nvlink", size=32, bandwidth=450 * GB, latency=3e-6)
    cluster_size = max(64, -(-num_devices // 32) * 32)
    cluster = Level(name="cluster", size=cluster_size, bandwidth=50 * GB, latency=10e-6)
    return HardwareSpec(name="gh200-nvl32", device=device, num_devices=num_devices, levels=(domain, cluster))


def gb200_nvl72(num_devices: int = 72) -> HardwareSpec:
    """GB200 NVL72 racks: 72 Blackwell GPUs in one NVLink switch domain, racks joined by 50 GB/s per GPU [GB200-NVL72]."""
    device = DeviceSpec(name="GB200-186GB", peak_flops={"bfloat16": 2500 * TFLOPS, "float16": 2500 * TFLOPS,
                                                        "float32": 1250 * TFLOPS},  # f32 = TF32
                        memory_bytes=186 * GB, memory_bandwidth=8000 * GB, host_memory_bytes=240 * GB,
                        host_bandwidth=225 * GB)
    domain = Level(name="nvlink", size=72, bandwidth=900 * GB, latency=3e-6)
    cluster_size = max(144, -(-num_devices // 72) * 72)
    cluster = Level(name="cluster", size=cluster_size, bandwidth=50 * GB, latency=10e-6)
    return HardwareSpec(name="gb200-nvl72", device=device, num_devices=num_devices, levels=(domain, cluster))


# An H100 SXM 80GB HBM3's memory as the CUDA runtime reports it (XLA's GPU spec of the device; 79.1 GiB)
H100_CUDA_MEMORY_BYTES = 84_942_979_072


def h100_node(num_devices: int = 8) -> HardwareSpec:
    """DGX H100-style nodes: 8 H100 SXM on NVSwitch, 50 GB/s per GPU to the network, PCIe to the host [H100], [DGX-H100]."""
    device = DeviceSpec(name="H100-SXM-80GB", peak_flops=_HOPPER_FLOPS, memory_bytes=80 * GB, memory_bandwidth=3350 * GB,
                        host_memory_bytes=256 * GB, host_bandwidth=64 * GB, cuda_memory_bytes=H100_CUDA_MEMORY_BYTES)
    node = Level(name="node", size=8, bandwidth=450 * GB, latency=2e-6)
    return HardwareSpec(name="h100", device=device, num_devices=num_devices,
                        levels=_network_levels(node, per_gpu_bandwidth=50 * GB, rack_size=32, num_devices=num_devices))


def h200_node(num_devices: int = 8) -> HardwareSpec:
    """HGX H200-style nodes: 8 H200 SXM on NVSwitch, 50 GB/s per GPU to the network [H200], [DGX-H100]."""
    device = DeviceSpec(name="H200-SXM-141GB", peak_flops=_HOPPER_FLOPS, memory_bytes=141 * GB, memory_bandwidth=4800 * GB,
                        host_memory_bytes=256 * GB, host_bandwidth=64 * GB)
    node = Level(name="node", size=8, bandwidth=450 * GB, latency=2e-6)
    return HardwareSpec(name="h200", device=device, num_devices=num_devices,
                        levels=_network_levels(node, per_gpu_bandwidth=50 * GB, rack_size=32, num_devices=num_devices))


def a100_node(num_devices: int = 8) -> HardwareSpec:
    """DGX A100 80 GB nodes (NVIDIA Selene): 8 A100 on NVSwitch, 25 GB/s per GPU to the network [A100], [DGX-A100]."""
    device = DeviceSpec(name="A100-SXM-80GB", peak_flops={"bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS,
                                                          "float32": 156 * TFLOPS},
                        memory_bytes=80 * GB, memory_bandwidth=2039 * GB)
    node = Level(name="node", size=8, bandwidth=300 * GB, latency=2e-6)
    return HardwareSpec(name="a100", device=device, num_devices=num_devices,
                        levels=_network_levels(node, per_gpu_bandwidth=25 * GB, rack_size=32, num_devices=num_devices))


PRESETS: Mapping[str, Callable[[int], HardwareSpec]] = MappingProxyType({
    "gh200": gh200_quad,
    "gh200-nvl32": gh200_nvl32,
    "gb200-nvl72": gb200_nvl72,
    "h100": h100_node,
    "h200": h200_node,
    "a100": a100_node,
})


def preset(name: str, num_devices: int) -> HardwareSpec:
    """A preset by name (`gh200`, `gh200-nvl32`, `gb200-nvl72`, `h100`, `h200`, `a100`) with `num_devices` devices."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(PRESETS)}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"hardware preset {name!r}: number of devices must be a positive integer, got {num_devices!r}")
    return PRESETS[name](num_devices)
