"""Sharded loading: peak resident memory per process of `load_pretrained(mesh=...)`, 4 processes vs 1.

Writes a Qwen2.5-0.5B-shaped checkpoint with random weights using `transformers` (bfloat16 by default, kept in
`--checkpoint` for the next run), then loads it onto a mesh `fsdp=4` twice: in one process holding 4 CPU
devices, and in 4 processes of one CPU device each (jax.distributed on localhost, gloo), where each process
reads only the windows of each tensor that its device holds. Each loader reports its resident memory before
the load (Python + JAX) and its peak (VmHWM) after it; the figure that should scale as 1/processes is the
growth, peak minus before. The fsdp rules split every weight along its embedding dimension, i.e. mostly
columns of the HF tensors: the case where a memory-mapped read would touch every page of each tensor.

    python benchmarks/bench_loading.py [--checkpoint DIR] [--dtype bfloat16|float32] [--processes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def write_checkpoint(directory: pathlib.Path, dtype: str) -> None:
    import torch
    import transformers

    from rpegjax.models.config import ModelConfig

    cfg = ModelConfig.qwen2p5("0.5b")
    config = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, tie_word_embeddings=cfg.tie_word_embeddings)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(directory)


def _status() -> dict[str, int]:
    """Resident memory figures of this process, in MiB (VmHWM is the peak)."""
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024
    return out


def load_one(checkpoint: str, out: str) -> None:
    """One loader process (launched by `main`): joins the others, loads, reports its memory as JSON."""
    from rpegjax import distributed

    distributed.initialize(distributed.DistributedConfig.from_env(initialization_timeout_s=120))
    import jax
    from flax import nnx

    from rpegjax.models.hf import load_pretrained

    mesh = distributed.global_mesh({"fsdp": -1})
    jax.block_until_ready(jax.numpy.zeros(1))  # the runtime's own buffers count as "before"
    before = _status()
    started = time.perf_counter()
    model, _ = load_pretrained(checkpoint, mesh=mesh)
    leaves = jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    seconds = time.perf_counter() - started
    after = _status()
    held = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)
    report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(mesh.devices.flat),
              "seconds": round(seconds, 2), "before_mib": before["VmRSS"], "peak_mib": after["VmHWM"],
              "growth_mib": after["VmHWM"] - before["VmRSS"], "rss_file_mib": after["RssFile"],
              "held_by_devices_mib": held >> 20}
    pathlib.Path(out, f"report{jax.process_index()}.json").write_text(json.dumps(report))


def run(checkpoint: pathlib.Path, processes: int, devices_per_process: int, out: pathlib.Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    children = []
    for process in range(processes):
        env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "SLURM_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(process))
        children.append(subprocess.Popen([sys.executable, __file__, "--load-one", str(checkpoint), "--out", str(out)],
                                         env=env))
    codes = [child.wait(timeout=600) for child in children]
    if any(codes):
        raise SystemExit(f"loader exit codes {codes}")
    return [json.loads((out / f"report{process}.json").read_text()) for process in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="/tmp/rpegjax_bench_loading/qwen2p5_0p5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--load-one", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="/tmp/rpegjax_bench_loading/reports")
    args = parser.parse_args()
    if args.load_one:
        load_one(args.load_one, args.out)
        return
    checkpoint = pathlib.Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        started = time.perf_counter()
        write_checkpoint(checkpoint, args.dtype)
        print(f"wrote {checkpoint} ({args.dtype}) in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    size = sum(path.stat().st_size for path in checkpoint.glob("*.safetensors")) >> 20
    one = run(checkpoint, 1, args.processes, pathlib.Path(args.out, "one"))
    many = run(checkpoint, args.processes, 1, pathlib.Path(args.out, "many"))
    print(f"checkpoint {checkpoint}: {size} MiB of safetensors")
    print(f"{'run':>14} {'process':>7} {'seconds':>8} {'before':>7} {'peak':>7} {'growth':>7} {'RssFile':>8} {'held':>6}  (MiB)")
    for name, reports in ((f"1 x {args.processes} devices", one), (f"{args.processes} x 1 device", many)):
        for r in reports:
            print(f"{name:>14} {r['process']:>7} {r['seconds']:>8} {r['before_mib']:>7} {r['peak_mib']:>7} "
                  f"{r['growth_mib']:>7} {r['rss_file_mib']:>8} {r['held_by_devices_mib']:>6}")
    ratio = max(r["growth_mib"] for r in many) / one[0]["growth_mib"]
    print(f"largest growth of a process of {args.processes} / growth of the one process: {ratio:.3f} "
          f"(ideal {1 / args.processes:.3f})")


if __name__ == "__main__":
    main()
