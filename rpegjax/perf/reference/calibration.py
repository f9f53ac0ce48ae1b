"""Measuring this machine for the performance model: matmul and attention rates per dtype, memory bandwidth,
fixed overheads and the all-reduce over the local devices.

`measure()` times one dtype's kernels (fastest of several repeats) and `calibrate()` turns the float32 figures
into a one-device spec of this machine (the CPU validation, benchmarks/bench_perfmodel.py). `measure_profile()`
measures every dtype asked for plus the all-reduce and returns a `HardwareProfile` (rpegjax/perf/reference/profile.py),
the file the planner loads with `--hardware-profile`:

    python -m rpegjax.perf.reference.calibration --out profile.json [--dtypes float32,bfloat16] [--rounds 3]
        [--sizes gpu]

JAX is imported inside the functions: the perf model itself never needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from rpegjax.options import DType
from rpegjax.perf.model.hardware import GIB, DeviceSpec, HardwareSpec, Level
from rpegjax.perf.reference import profile as hardware_profile

DTYPES = tuple(dtype.value for dtype in DType)  # the compute dtypes a plan may use


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """What `measure()` measured for one dtype (fastest of several repeats)."""

    matmul_flops: float  # FLOP/s of a large square matmul: the peak
    layer_matmul_flops: float  # FLOP/s of a layer's training matmuls X·W, dY·Wᵀ, Xᵀ·dY (`Sizes.layer`)
    small_matmul_flops: float  # FLOP/s of a [rows, d] x [d, 4d]-sized matmul (decode-like shapes)
    attention_flops: float  # FLOP/s of the model's dense attention (`Sizes.attention`)
    backward_efficiency: float  # backward matmul FLOP/s / forward, from an MLP block's forward and gradient
    memory_bandwidth: float  # bytes/s of a streaming elementwise kernel (read + write counted)
    dispatch_overhead_s: float  # seconds per dispatch of a trivial jitted program
    kernel_overhead_s: float  # seconds per small dependent op inside one program


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """Problem sizes of the measurements. The defaults suit a CPU; `Sizes.gpu()` is large enough that one kernel
    takes about a millisecond on a Hopper GPU, so that launch and dispatch do not hide its rate."""

    matmul: int = 1024  # square matmul side
    layer: tuple[int, int, int] = (2048, 512, 2048)  # tokens x model dim x MLP dim
    attention: tuple[int, int, int, int, int] = (16, 128, 4, 2, 64)  # batch, time, heads, KV heads, head dim
    small: tuple[int, int] = (32, 256)  # rows, width (the weight is width x 4 width)
    stream_mib: int = 64
    all_reduce_mib: int = 16  # per device; the latency is measured with 4 bytes per device

    @classmethod
    def gpu(cls) -> Sizes:
        return cls(matmul=8192, layer=(16384, 2048, 8192), attention=(8, 2048, 16, 2, 128), small=(64, 4096),
                   stream_mib=2048, all_reduce_mib=256)

    @classmethod
    def smoke(cls) -> Sizes:
        """Small enough to run in seconds on a CPU: checks that calibration works, not what the machine does."""
        return cls(matmul=256, layer=(256, 128, 256), attention=(2, 32, 4, 2, 16), small=(8, 64), stream_mib=8,
                   all_reduce_mib=1)

    @classmethod
    def for_platform(cls, platform: str) -> Sizes:
        return cls.gpu() if platform == "gpu" else cls()


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


def measure(*, dtype: str = "float32", matmul_size: int | None = None, stream_mib: int | None = None, repeats: int = 7,
            sizes: Sizes | None = None) -> Calibration:
    """Measures this machine's first JAX device: matmul and attention FLOP/s with operands in `dtype`, memory
    bandwidth (float32 stream) and fixed overheads. `matmul_size` / `stream_mib` override those of `sizes`."""
    import jax
    import jax.numpy as jnp

    if dtype not in DTYPES:
        raise ValueError(f"calibration: dtype must be one of {DTYPES}, got {dtype!r}")
    sizes = sizes or Sizes()
    sizes = dataclasses.replace(sizes, matmul=matmul_size or sizes.matmul, stream_mib=stream_mib or sizes.stream_mib)
    dtype_ = jnp.dtype(dtype)
    device = jax.devices()[0]
    key = jax.random.key(0)

    def normal(shape, seed_key=key):
        return jax.device_put(jax.random.normal(seed_key, shape, jnp.float32).astype(dtype_), device)

    n = sizes.matmul
    a = normal((n, n))
    matmul = jax.jit(lambda x: x @ x)
    big = _fastest_seconds(lambda: matmul(a).block_until_ready(), repeats)

    m, k, f = sizes.layer  # a layer of tokens x model dim x MLP dim, in the three orientations of training
    x, weight, grad = normal((m, k)), normal((k, f)), normal((m, f))
    orientations = (jax.jit(lambda x, w, g: x @ w), jax.jit(lambda x, w, g: g @ w.T), jax.jit(lambda x, w, g: x.T @ g))
    layer = sum(_fastest_seconds(lambda f=f: f(x, weight, grad).block_until_ready(), repeats) for f in orientations)

    # the model's own kernels (attention, SwiGLU), so that the rates are the ones its programs reach
    from rpegjax.models import activations, attention

    b, t, h, kv, e = sizes.attention
    q, keys = normal((b, t, h, e)), normal((b, t, kv, e))
    attend = jax.jit(lambda q, keys: attention.causal_attention(q, keys, keys, None))
    attention_seconds = _fastest_seconds(lambda: attend(q, keys).block_until_ready(), repeats)

    up = normal((k, f), jax.random.key(1))

    def block(x, w):  # an MLP block: gate and up projections (distinct weights), SwiGLU, down-projection
        gate_weight, up_weight = w
        return activations.swiglu(x @ gate_weight, x @ up_weight) @ gate_weight.T

    forward_block = jax.jit(block)
    grad_block = jax.jit(jax.grad(lambda x, w: block(x, w).astype(jnp.float32).sum(), argnums=(0, 1)))
    block_forward = _fastest_seconds(lambda: forward_block(x, (weight, up)).block_until_ready(), repeats)
    block_grad = _fastest_seconds(lambda: jax.block_until_ready(grad_block(x, (weight, up))), repeats)

    rows, width = sizes.small
    x = jax.device_put(jnp.ones((rows, width), dtype_), device)
    w = jax.device_put(jnp.ones((width, 4 * width), dtype_), device)
    small_matmul = jax.jit(lambda x, w: x @ w)
    small = _fastest_seconds(lambda: small_matmul(x, w).block_until_ready(), repeats * 5)

    elements = sizes.stream_mib * 1024 * 1024 // 4
    s = jax.device_put(jnp.ones((elements,), jnp.float32), device)
    stream = jax.jit(lambda v: v * 1.5 + 1.0)
    stream_seconds = _fastest_seconds(lambda: stream(s).block_until_ready(), repeats)

    dispatch = _dispatch_seconds(device, repeats)

    chain_length = 256
    tiny = jax.device_put(jnp.ones((8, 8), jnp.float32), device)

    def chain(v):
        for _ in range(chain_length):
            v = jnp.tanh(v @ v)  # dependent ops XLA cannot merge into one kernel
        return v

    chained = jax.jit(chain)
    chain_seconds = _fastest_seconds(lambda: chained(tiny).block_until_ready(), repeats)
    return Calibration(
        matmul_flops=2 * n**3 / big,
        layer_matmul_flops=3 * 2 * m * k * f / layer,
        attention_flops=2 * 2 * b * h * t * t * e / attention_seconds,
        backward_efficiency=min(1.0, 2 * block_forward / max(block_grad - block_forward, 1e-9)),
        small_matmul_flops=2 * rows * width * 4 * width / max(small - dispatch, 1e-9),
        memory_bandwidth=2 * elements * 4 / stream_seconds,
        dispatch_overhead_s=dispatch,
        kernel_overhead_s=max(chain_seconds - dispatch, 0.0) / chain_length,
    )


def _dispatch_seconds(device, repeats: int) -> float:
    """Seconds per dispatch of a trivial program, from 200 dependent calls."""
    import jax
    import jax.numpy as jnp

    scalar = jax.device_put(jnp.ones((), jnp.float32), device)
    trivial = jax.jit(lambda v: v + 1.0)
    calls = 200

    def many_dispatches():
        out = scalar
        for _ in range(calls):
            out = trivial(out)
        out.block_until_ready()

    return _fastest_seconds(many_dispatches, max(3, repeats // 2)) / calls


def measure_all_reduce(*, mib_per_device: int = 16, repeats: int = 7) -> hardware_profile.AllReduce | None:
    """The ring all-reduce's α and β over all local devices (None with one device): a 4-byte and a
    `mib_per_device` (or, until it takes twice as long as the 4-byte one, 4, 16, 64 times larger) all-reduce, timed,
    less one dispatch, fitted to T(S) = 2(n−1)α + 2(n−1)/n · S/β
    (rpegjax.perf.model.collectives)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.local_devices()
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.array(devices), ("devices",))
    spec = PartitionSpec("devices")
    summed = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "devices"), mesh=mesh, in_specs=spec, out_specs=spec))
    dispatch = _dispatch_seconds(devices[0], repeats)

    def timed(elements: int) -> float:
        v = jax.device_put(jnp.ones((n * elements,), jnp.float32), NamedSharding(mesh, spec))
        return max(_fastest_seconds(lambda: summed(v).block_until_ready(), repeats) - dispatch, 0.0)

    small_bytes, small = 4, timed(1)
    large_bytes = mib_per_device * 1024 * 1024
    # the bandwidth term must stand clear of the latency's noise: grow the message until it takes twice as long
    for _ in range(4):
        large = timed(large_bytes // 4)
        if large > 2 * small:
            break
        large_bytes *= 4
    else:
        raise RuntimeError(f"all-reduce over {n} devices: {large_bytes // 4} bytes took no longer than twice {small_bytes} "
                           f"({large:.3g} s vs {small:.3g} s); the measurement is noise")
    per_byte = (large - small) / (large_bytes - small_bytes)  # 2(n−1)/n / β
    return hardware_profile.AllReduce(
        devices=n, latency_s=max(small - per_byte * small_bytes, 0.0) / (2 * (n - 1)),
        bandwidth=2 * (n - 1) / n / per_byte, samples=((small_bytes, small), (large_bytes, large)))


def measure_profile(*, dtypes: Sequence[str] = ("float32", "bfloat16"), rounds: int = 1, repeats: int = 7,
                    sizes: Sizes | None = None) -> hardware_profile.HardwareProfile:
    """This machine's hardware profile (see `profile_from_calibrations`) from `rounds` calibrations per dtype."""
    return profile_from_calibrations(_measure_dtypes(dtypes, rounds, repeats, sizes), sizes=sizes, repeats=repeats)


def _measure_dtypes(dtypes: Sequence[str], rounds: int, repeats: int, sizes: Sizes | None,
                    **measure_options) -> dict[str, list[Calibration]]:
    import jax

    if rounds < 1:
        raise ValueError(f"calibration: rounds must be >= 1, got {rounds!r}")
    if not dtypes:
        raise ValueError("calibration: needs at least one dtype")
    sizes = sizes or Sizes.for_platform(jax.devices()[0].platform)
    return {dtype: [measure(dtype=dtype, repeats=repeats, sizes=sizes, **measure_options) for _ in range(rounds)]
            for dtype in dtypes}


def profile_from_calibrations(calibrations: dict[str, list[Calibration]], *, sizes: Sizes | None = None,
                              repeats: int = 7) -> hardware_profile.HardwareProfile:
    """Per dtype, the field-wise median of its calibrations; bandwidth and overheads (dtype-independent) the
    median over all of them; and the all-reduce over the local devices, measured now."""
    import jax

    device = jax.devices()[0]
    sizes = sizes or Sizes.for_platform(device.platform)
    return hardware_profile.HardwareProfile.from_calibrations(
        {dtype: median_calibration(found) for dtype, found in calibrations.items()},
        shared=median_calibration([c for found in calibrations.values() for c in found]),
        platform=device.platform, device_kind=device.device_kind, devices=jax.local_device_count(),
        memory_bytes=_device_memory_bytes(device), jax_version=jax.__version__,
        all_reduce=measure_all_reduce(mib_per_device=sizes.all_reduce_mib, repeats=repeats))


def _device_memory_bytes(device) -> float:
    """One device's memory: what its allocator may use on an accelerator; on a CPU, the host's RAM shared by its
    (virtual) devices."""
    import os

    import jax

    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / jax.local_device_count()


def spec_from_calibration(measured: Calibration, *, name: str = "calibrated-cpu", memory_bytes: float = 8 * GIB,
                          platform: str = "cpu") -> HardwareSpec:
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
        platform=platform,
    )
    # One device: collectives never happen; the level only makes the spec complete.
    level = Level(name="host", size=1, bandwidth=measured.memory_bandwidth, latency=0.0)
    return HardwareSpec(name=name, device=device, num_devices=1, levels=(level,), usable_memory_fraction=1.0)


def calibrate(*, rounds: int = 1, profile: str | None = None, dtypes: Sequence[str] = ("float32", "bfloat16"),
              sizes: Sizes | None = None, repeats: int = 7, **measure_options) -> tuple[HardwareSpec, Calibration]:
    """Measures this machine (see `measure`; `rounds` times, then the field-wise median) and returns the float32
    spec that predicts it, with the measurements it was made from. With `profile`, also measures the other `dtypes`
    and the all-reduce and writes the hardware profile (rpegjax/perf/reference/profile.py) there."""
    if rounds < 1:
        raise ValueError(f"calibrate: rounds must be >= 1, got {rounds!r}")
    import jax

    wanted = ("float32", *(d for d in dtypes if d != "float32")) if profile is not None else ("float32",)
    sizes = sizes or Sizes.for_platform(jax.default_backend())
    found = _measure_dtypes(wanted, rounds, repeats, sizes, **measure_options)
    if profile is not None:
        profile_from_calibrations({d: found[d] for d in dtypes}, sizes=sizes, repeats=repeats).write(profile)
    measured = median_calibration(found["float32"])
    platform = jax.default_backend()
    return spec_from_calibration(measured, name=f"calibrated-{platform}", platform=platform), measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure this machine and write a hardware profile for "
                                                 "scripts/plan.py --hardware-profile.")
    parser.add_argument("--out", required=True, help="profile JSON file to write")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes to measure, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="calibrations per dtype (field-wise median)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per kernel (fastest kept)")
    parser.add_argument("--sizes", choices=("auto", "cpu", "gpu", "smoke"), default="auto",
                        help="problem sizes: auto = by the platform of the first device; smoke = tiny, a check that it runs")
    args = parser.parse_args(argv)
    import jax

    sizes = {"cpu": Sizes(), "gpu": Sizes.gpu(), "smoke": Sizes.smoke(),
             "auto": Sizes.for_platform(jax.devices()[0].platform)}[args.sizes]
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        parser.error(f"--dtypes: {unknown or 'nothing'} given; choose from {', '.join(DTYPES)}")
    try:
        measured = measure_profile(dtypes=dtypes, rounds=args.rounds, repeats=args.repeats, sizes=sizes)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"calibration: {error}") from None
    measured.write(args.out)
    print(measured.summary())
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
