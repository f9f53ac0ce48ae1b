"""Hardware presets: the clusters the planner plans for, from vendor datasheets (cited beside each figure).

Each preset is a `HardwareSpec` (`rpegjax.perf.model.hardware`) built for a number of devices; `preset(name, n)`
picks one by the name `scripts/plan.py --hardware` takes. Peak figures are datasheet numbers; efficiency factors
and per-kernel overheads are assumptions of the usual order (stated below), never fitted to the validation figures;
`rpegjax.perf.reference.calibration` measures the local machine instead, and `rpegjax.perf.reference.profile` puts
its measurements in place of a preset's assumptions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from rpegjax.perf.model.hardware import GB, TFLOPS, DeviceSpec, HardwareSpec, Level, Topology

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
