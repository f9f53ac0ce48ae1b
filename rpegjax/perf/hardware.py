"""Hardware specs for the performance model: one device type inside a GPU -> node -> rack -> cluster hierarchy.

A `HardwareSpec` is a device (peak FLOP/s per dtype, memory capacity and bandwidth, fixed overheads) and an
ordered tuple of `Level`s, innermost first. Level i groups `levels[i].size` consecutive device indices
(a node, a rack, the cluster); a transfer between two devices uses the innermost level that contains both.
Collective costs (α–β, hierarchical) live in `rpegjax.perf.collectives`.

Peak figures are vendor datasheet numbers (cited beside each preset). Efficiency factors and per-kernel
overheads are *assumptions* (stated where they are set), never fitted to the validation figures;
`calibrate()` measures the local machine instead, so that runs on this CPU can be predicted.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
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
#        (= 50 GB/s per direction per GPU to the network).
# [GH200] NVIDIA GH200 Grace Hopper Superchip datasheet / whitepaper: H100 with 96 GB HBM3 at 4 TB/s,
#        989 TFLOP/s dense BF16, NVLink-C2C 900 GB/s bidirectional (450 GB/s per direction) to Grace memory.
# [GH200-quad] HPE Cray EX254n blade as deployed at CSCS Alps (CSCS user documentation, "GH200 nodes"):
#        4 GH200 per node, all-to-all NVLink between the four GPUs at 150 GB/s per direction per pair (no
#        NVSwitch), 120 GB LPDDR5X per Grace, 4 Slingshot-11 NICs at 200 Gb/s = 25 GB/s per direction per GPU.
# [NVL32] NVIDIA GH200 NVL32 (DGX GH200 NVL32 / AWS Ceiba) product brief: 32 GH200 (144 GB HBM3e at 4.9 TB/s)
#        in one NVLink Switch domain at 900 GB/s bidirectional per GPU; one ConnectX-7 400 Gb/s per superchip.
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


def h100_node(num_devices: int = 8) -> HardwareSpec:
    """DGX H100-style nodes: 8 H100 SXM on NVSwitch, 50 GB/s per GPU to the network [H100], [DGX-H100]."""
    device = DeviceSpec(name="H100-SXM-80GB", peak_flops=_HOPPER_FLOPS, memory_bytes=80 * GB, memory_bandwidth=3350 * GB)
    node = Level(name="node", size=8, bandwidth=450 * GB, latency=2e-6)
    return HardwareSpec(name="h100", device=device, num_devices=num_devices,
                        levels=_network_levels(node, per_gpu_bandwidth=50 * GB, rack_size=32, num_devices=num_devices))


def h200_node(num_devices: int = 8) -> HardwareSpec:
    """HGX H200-style nodes: 8 H200 SXM on NVSwitch, 50 GB/s per GPU to the network [H200], [DGX-H100]."""
    device = DeviceSpec(name="H200-SXM-141GB", peak_flops=_HOPPER_FLOPS, memory_bytes=141 * GB, memory_bandwidth=4800 * GB)
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
    "h100": h100_node,
    "h200": h200_node,
    "a100": a100_node,
})


def preset(name: str, num_devices: int) -> HardwareSpec:
    """A preset by name (`gh200`, `gh200-nvl32`, `h100`, `h200`, `a100`) with `num_devices` devices."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(PRESETS)}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"hardware preset {name!r}: number of devices must be a positive integer, got {num_devices!r}")
    return PRESETS[name](num_devices)


# ----------------------------------------------------------------------------------------- calibration
@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """What `calibrate()` measured (fastest of several repeats), kept beside the spec it produced."""

    matmul_flops: float  # FLOP/s of a large square float32 matmul: the peak
    layer_matmul_flops: float  # FLOP/s of a layer's training matmuls X·W, dY·Wᵀ, Xᵀ·dY at [2048, 512] x [512, 2048]
    small_matmul_flops: float  # FLOP/s of a [32, d] x [d, 4d]-sized matmul (decode-like shapes)
    attention_flops: float  # FLOP/s of the model's attention (16 x 4 heads over 2 KV heads, 128 x 128 x 64)
    backward_efficiency: float  # backward matmul FLOP/s / forward, from an MLP block's forward and gradient
    memory_bandwidth: float  # bytes/s of a streaming elementwise kernel (read + write counted)
    dispatch_overhead_s: float  # seconds per dispatch of a trivial jitted program
    kernel_overhead_s: float  # seconds per small dependent op inside one program


def median_calibration(calibrations: Sequence[Calibration]) -> Calibration:
    """Field by field, the median of several calibrations: one disturbed measurement on a shared machine
    moves it little, and every prediction made from it sees the same machine."""
    if not calibrations:
        raise ValueError("median_calibration needs at least one calibration")
    return Calibration(**{field.name: statistics.median(getattr(c, field.name) for c in calibrations)
                          for field in dataclasses.fields(Calibration)})


def _fastest_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed runs: on a shared machine the least disturbed one is the machine's rate."""
    run()  # compile and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure(*, matmul_size: int = 1024, stream_mib: int = 64, repeats: int = 7) -> Calibration:
    """Measures this machine's first JAX device: matmul FLOP/s, memory bandwidth and fixed overheads."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    key = jax.random.key(0)
    a = jax.device_put(jax.random.normal(key, (matmul_size, matmul_size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    big = _fastest_seconds(lambda: matmul(a).block_until_ready(), repeats)

    m, k, n = 2048, 512, 2048  # a layer of tokens x model dim x MLP dim, in the three orientations of training
    x = jax.device_put(jax.random.normal(key, (m, k), jnp.float32), device)
    weight = jax.device_put(jax.random.normal(key, (k, n), jnp.float32), device)
    grad = jax.device_put(jax.random.normal(key, (m, n), jnp.float32), device)
    orientations = (jax.jit(lambda x, w, g: x @ w), jax.jit(lambda x, w, g: g @ w.T), jax.jit(lambda x, w, g: x.T @ g))
    layer = sum(_fastest_seconds(lambda f=f: f(x, weight, grad).block_until_ready(), repeats) for f in orientations)

    # the model's own kernels (attention, SwiGLU), so that the rates are the ones its programs reach
    from rpegjax.models.transformer import causal_attention, swiglu

    b, t, h, kv, e = 16, 128, 4, 2, 64
    q = jax.device_put(jax.random.normal(key, (b, t, h, e), jnp.float32), device)
    keys = jax.device_put(jax.random.normal(key, (b, t, kv, e), jnp.float32), device)
    attend = jax.jit(lambda q, keys: causal_attention(q, keys, keys, None))
    attention_seconds = _fastest_seconds(lambda: attend(q, keys).block_until_ready(), repeats)

    up = jax.device_put(jax.random.normal(jax.random.key(1), (k, n), jnp.float32), device)

    def block(x, w):  # an MLP block: gate and up projections (distinct weights), SwiGLU, down-projection
        gate_weight, up_weight = w
        return swiglu(x @ gate_weight, x @ up_weight) @ gate_weight.T

    forward_block = jax.jit(block)
    grad_block = jax.jit(jax.grad(lambda x, w: block(x, w).sum(), argnums=(0, 1)))
    block_forward = _fastest_seconds(lambda: forward_block(x, (weight, up)).block_until_ready(), repeats)
    block_grad = _fastest_seconds(lambda: jax.block_until_ready(grad_block(x, (weight, up))), repeats)

    rows, width = 32, 256
    x = jax.device_put(jnp.ones((rows, width), jnp.float32), device)
    w = jax.device_put(jnp.ones((width, 4 * width), jnp.float32), device)
    small_matmul = jax.jit(lambda x, w: x @ w)
    small = _fastest_seconds(lambda: small_matmul(x, w).block_until_ready(), repeats * 5)

    elements = stream_mib * 1024 * 1024 // 4
    s = jax.device_put(jnp.ones((elements,), jnp.float32), device)
    stream = jax.jit(lambda v: v * 1.5 + 1.0)
    stream_seconds = _fastest_seconds(lambda: stream(s).block_until_ready(), repeats)

    scalar = jax.device_put(jnp.ones((), jnp.float32), device)
    trivial = jax.jit(lambda v: v + 1.0)
    calls = 200

    def many_dispatches():
        out = scalar
        for _ in range(calls):
            out = trivial(out)
        out.block_until_ready()

    dispatch = _fastest_seconds(many_dispatches, max(3, repeats // 2)) / calls

    chain_length = 256
    tiny = jax.device_put(jnp.ones((8, 8), jnp.float32), device)

    def chain(v):
        for _ in range(chain_length):
            v = jnp.tanh(v @ v)  # dependent ops XLA cannot merge into one kernel
        return v

    chained = jax.jit(chain)
    chain_seconds = _fastest_seconds(lambda: chained(tiny).block_until_ready(), repeats)
    return Calibration(
        matmul_flops=2 * matmul_size**3 / big,
        layer_matmul_flops=3 * 2 * m * k * n / layer,
        attention_flops=2 * 2 * b * h * t * t * e / attention_seconds,
        backward_efficiency=min(1.0, 2 * block_forward / max(block_grad - block_forward, 1e-9)),
        small_matmul_flops=2 * rows * width * 4 * width / max(small - dispatch, 1e-9),
        memory_bandwidth=2 * elements * 4 / stream_seconds,
        dispatch_overhead_s=dispatch,
        kernel_overhead_s=max(chain_seconds - dispatch, 0.0) / chain_length,
    )


def spec_from_calibration(measured: Calibration, *, name: str = "calibrated-cpu", memory_bytes: float = 8 * GIB) -> HardwareSpec:
    """A one-device spec from the measurements: peak = the square matmul's rate, matmul and attention efficiencies =
    what a layer's matmuls and attention's batched matmuls reach of it, the measured backward efficiency, memory
    efficiency 1 (the streaming rate is already an attained rate)."""
    peak = max(measured.matmul_flops, measured.layer_matmul_flops)
    device = DeviceSpec(
        name=name,
        peak_flops={"float32": peak, "bfloat16": peak, "float16": peak},
        memory_bytes=memory_bytes,
        memory_bandwidth=measured.memory_bandwidth,
        matmul_efficiency=measured.layer_matmul_flops / peak,
        attention_efficiency=min(1.0, measured.attention_flops / peak),
        backward_efficiency=measured.backward_efficiency,
        memory_efficiency=1.0,
        kernel_overhead_s=measured.kernel_overhead_s,
        dispatch_overhead_s=measured.dispatch_overhead_s,
        platform="cpu",
    )
    # One device: collectives never happen; the level only makes the spec complete.
    level = Level(name="host", size=1, bandwidth=measured.memory_bandwidth, latency=0.0)
    return HardwareSpec(name=name, device=device, num_devices=1, levels=(level,), usable_memory_fraction=1.0)


def calibrate(*, rounds: int = 1, **measure_options) -> tuple[HardwareSpec, Calibration]:
    """Measures this machine (see `measure`; `rounds` times, then the field-wise median) and returns the spec
    that predicts it, with the measurements it was made from."""
    if rounds < 1:
        raise ValueError(f"calibrate: rounds must be >= 1, got {rounds!r}")
    measured = median_calibration([measure(**measure_options) for _ in range(rounds)])
    return spec_from_calibration(measured), measured
