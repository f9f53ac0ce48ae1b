"""The devices a dry run compiles for: this machine's (virtual CPU devices when it has fewer than the plan), or
compile-only CUDA devices of a named GPU, with no GPU present.

XLA's CPU backend computes bfloat16 through float32 copies (a bf16 KV pool is converted whole for its dots, an
update's temporaries are float32-sized), so a bf16 plan compiled on virtual CPU devices reads up to 2x a GPU's
memory. The CUDA targets compile with XLA's GPU compiler instead: JAX's CUDA PJRT plugin makes a topology of
compile-only devices from a `GpuTargetConfigProto` (`jax.experimental.topologies.get_topology_desc(platform="cuda",
topology="1x1xN", target_config=...)`), and `jit(...).lower(...).compile().memory_analysis()` then gives the GPU
program's buffers. It needs the plugin installed (`pip install 'rpegjax[gpu-aot]'`: jax-cuda12-plugin and its PJRT
library, ~220 MB), not a GPU, a driver or cuDNN; without the plugin a CUDA target is an error, never a CPU compile.
cuDNN's attention kernel does not compile without cuDNN and a device: the dry run compiles the blockwise kernel
in its place (same memory class) and says so.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
from collections.abc import Sequence

import jax

from rpegjax.perf.reference.presets import H100_CUDA_MEMORY_BYTES


class DryRunTarget(enum.StrEnum):
    CPU = "cpu"  # this machine's devices (virtual CPU devices when the plan needs more)
    CUDA_H100 = "cuda-h100"
    CUDA_GH200 = "cuda-gh200"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """The fields of XLA's `GpuTargetConfigProto` that its GPU compiler reads for a device (values of NVIDIA's
    datasheets and `cudaGetDeviceProperties`, as XLA's own specs record them for the H100 SXM)."""

    name: str
    memory_bytes: int
    memory_bandwidth: int  # bytes/s
    core_count: int = 132
    clock_rate_ghz: float = 1.98
    l2_cache_size: int = 50 * 2**20
    compute_capability: tuple[int, int] = (9, 0)

    def target_config(self) -> str:
        """The `GpuTargetConfigProto` in protobuf text format."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{self.name}"
"""


# Device memory as the CUDA runtime reports it (H100 SXM 80 GB: XLA's spec, the `h100` preset's CUDA figure); GH200's
# GPU is the same Hopper die with 96 GB of HBM3 (rpegjax.perf.model.hardware's `gh200` preset).
GPU_SPECS = {
    DryRunTarget.CUDA_H100: GpuSpec(name="NVIDIA H100 80GB HBM3", memory_bytes=H100_CUDA_MEMORY_BYTES,
                                    memory_bandwidth=3352320000000),
    DryRunTarget.CUDA_GH200: GpuSpec(name="NVIDIA GH200 96GB HBM3", memory_bytes=96 * 2**30,
                                     memory_bandwidth=4000 * 10**9),
}


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is importable (looked up without initialising JAX's backends)."""
    return (importlib.util.find_spec("jax_plugins") is not None
            and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


def prepare_host(target: DryRunTarget) -> None:
    """For a CUDA target, runs this process's own work on the CPU unless JAX_PLATFORMS says otherwise: the plugin
    then loads without a CUDA runtime or driver. Call before anything starts JAX's backends (no effect after)."""
    if DryRunTarget(target) is not DryRunTarget.CPU and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


def compile_devices(target: DryRunTarget, count: int) -> list[jax.Device]:
    """`count` devices to compile a plan's programs for. CPU: this process's first `count` (call
    `rpegjax.train.dry_run.ensure_devices` first); CUDA: compile-only devices of the target GPU, one host."""
    target = DryRunTarget(target)
    if target is DryRunTarget.CPU:
        devices = jax.devices()
        if len(devices) < count:
            raise ValueError(f"dry run: the plan needs {count} devices, {len(devices)} exist (call ensure_devices first)")
        return devices[:count]
    from jax.experimental import topologies

    if not cuda_plugin_installed():
        raise ValueError(f"dry run target {target.value!r}: JAX's CUDA plugin is not installed, so nothing here "
                         f"compiles for a GPU; install it (pip install 'rpegjax[gpu-aot]', i.e. "
                         f"jax-cuda12-plugin=={jax.__version__}) or compile for this machine's devices (target cpu)")
    prepare_host(target)
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                                target_config=GPU_SPECS[target].target_config())
    except NotImplementedError:
        raise ValueError(f"dry run target {target.value!r}: JAX's CUDA plugin is installed but did not load (with "
                         f"JAX_PLATFORMS={jax.config.jax_platforms!r} it needs the CUDA runtime; run with "
                         f"JAX_PLATFORMS=cpu)") from None
    return list(topology.devices)


def compile_only(devices: Sequence[jax.Device]) -> bool:
    """Whether `devices` are compile-only (a CUDA target's, with no GPU behind them)."""
    return devices[0].platform != jax.default_backend()


def describe(devices: Sequence[jax.Device]) -> str:
    """'N x KIND (platform)' for a report's header; compile-only devices say so."""
    first = devices[0]
    return (f"{len(devices)} x {first.device_kind} ({first.platform}"
            + (", compile-only: XLA's GPU compiler, no device" if compile_only(devices) else "") + ")")


__all__ = ["DryRunTarget", "GPU_SPECS", "GpuSpec", "compile_devices", "compile_only", "cuda_plugin_installed", "describe", "prepare_host"]
