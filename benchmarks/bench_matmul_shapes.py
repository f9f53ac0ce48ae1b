"""W-small's matmul shapes, float32: XLA:CPU (jitted, under given XLA_FLAGS) against torch (one thread per CPU
of the process's affinity: 2 here, 1 under `--pin 0`), one process per contender, processes alternated for
`--rounds` rounds (XLA_FLAGS are read once per process).

Shapes (T = 32 x 96 = 3,072 training tokens; a decode step has 32 rows):
* forward `x @ W` of the projections, the MLP and the logits;
* the backward's transposed dots: `dY @ W.T` (input gradient, contracting both operands' last dimension) and
  `X.T @ dY` (weight gradient, contracting over the tokens);
* the attention's batched dots in the model's layout (`bkqe,bkse->bkqs`, `bkqs,bkse->bkqe`, b k = 32 x 2, q = 2 x 96);
* the weight gradient with `X.T` materialised first (`(x.T copied)`, XLA only: see `xla_calls`);
* decode `[32, d] @ W`: per call (dispatch included, as a decode loop calls them) and, for XLA, 64 dots inside one
  jitted loop (`loop`), the kernel without the per-call dispatch.

Each worker times every shape `--runs` times, shapes interleaved, wall and CPU seconds of the process
(`time.process_time`, all threads); the driver reports per shape and contender the median over rounds of each
process's median (and the smallest per-process median), as GFLOP/s of wall time and CPU ms per call.

    python benchmarks/bench_matmul_shapes.py [--rounds 3] [--runs 30] [--config NAME=XLA_FLAGS ...] [--json FILE]
    python benchmarks/bench_matmul_shapes.py --from-json FILE   # the table and the step bound of a saved run

After the table, each contender's W-small step matmuls at its measured rates (`step_matmul_seconds`): a lower bound
on the wall and CPU seconds of any step that runs those matmuls with that library on this machine.

Default contenders: torch, XLA default flags (`xla`) and XLA with the dots left to Eigen (`xla-eigen`:
`--xla_cpu_experimental_ynn_fusion_type=-individual_dot`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T = 32 * 96
ROWS = 32
LOOP = 64

# name -> (lhs shape, rhs shape, einsum); FLOPs = 2 x product of all distinct letters' sizes.
SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...], str]] = {
    "q/o x@W [T,256]x[256,256]": ((T, 256), (256, 256), "tk,kn->tn"),
    "k/v x@W [T,256]x[256,128]": ((T, 256), (256, 128), "tk,kn->tn"),
    "gate/up x@W [T,256]x[256,1024]": ((T, 256), (256, 1024), "tk,kn->tn"),
    "down x@W [T,1024]x[1024,256]": ((T, 1024), (1024, 256), "tk,kn->tn"),
    "logits x@W [T,256]x[256,512]": ((T, 256), (256, 512), "tk,kn->tn"),
    "q/o dY@W.T [T,256]x[256,256]T": ((T, 256), (256, 256), "tn,kn->tk"),
    "gate/up dY@W.T [T,1024]x[256,1024]T": ((T, 1024), (256, 1024), "tn,kn->tk"),
    "down dY@W.T [T,256]x[1024,256]T": ((T, 256), (1024, 256), "tn,kn->tk"),
    "logits dY@W.T [T,512]x[256,512]T": ((T, 512), (256, 512), "tn,kn->tk"),
    "q/o X.T@dY [T,256]Tx[T,256]": ((T, 256), (T, 256), "tk,tn->kn"),
    "gate/up X.T@dY [T,256]Tx[T,1024]": ((T, 256), (T, 1024), "tk,tn->kn"),
    "down X.T@dY [T,1024]Tx[T,256]": ((T, 1024), (T, 256), "tk,tn->kn"),
    "logits X.T@dY [T,256]Tx[T,512]": ((T, 256), (T, 512), "tk,tn->kn"),
    "attn scores [64,192,64]x[64,96,64]": ((32, 2, 192, 64), (32, 2, 96, 64), "bkqe,bkse->bkqs"),
    "attn p@v [64,192,96]x[64,96,64]": ((32, 2, 192, 96), (32, 2, 96, 64), "bkqs,bkse->bkqe"),
    "decode q/o [32,256]x[256,256]": ((ROWS, 256), (256, 256), "tk,kn->tn"),
    "decode k/v [32,256]x[256,128]": ((ROWS, 256), (256, 128), "tk,kn->tn"),
    "decode gate/up [32,256]x[256,1024]": ((ROWS, 256), (256, 1024), "tk,kn->tn"),
    "decode down [32,1024]x[1024,256]": ((ROWS, 1024), (1024, 256), "tk,kn->tn"),
    "decode logits [32,256]x[256,512]": ((ROWS, 256), (256, 512), "tk,kn->tn"),
}
EIGEN = "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"


def flops(name: str) -> int:
    lhs, rhs, spec = SHAPES[name]
    sizes: dict[str, int] = {}
    inputs = spec.split("->")[0].split(",")
    for letters, shape in zip(inputs, (lhs, rhs)):
        sizes.update(zip(letters, shape))
    total = 2
    for size in sizes.values():
        total *= size
    return total


def time_calls(calls: dict[str, object], runs: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds per call of each callable, the callables interleaved run by run."""
    for call in calls.values():
        call()
        call()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            w0, c0 = time.perf_counter(), time.process_time()
            call()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return {name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])} for name in calls}


def xla_calls() -> dict[str, object]:
    import jax
    import jax.numpy as jnp

    calls = {}
    for index, (name, (lhs, rhs, spec)) in enumerate(SHAPES.items()):
        a = jax.random.normal(jax.random.key(2 * index), lhs, jnp.float32)
        b = jax.random.normal(jax.random.key(2 * index + 1), rhs, jnp.float32)
        dot = jax.jit(lambda x, y, spec=spec: jnp.einsum(spec, x, y))
        calls[name] = lambda dot=dot, a=a, b=b: dot(a, b).block_until_ready()
        if name.startswith("decode"):
            calls[name + " (loop)"] = _decode_loop(a, b, spec)
        if spec == "tk,tn->kn":
            # XLA:CPU gives a dot contracting its lhs' leading dim to Eigen; with x.T materialised (the barrier
            # keeps the transpose from being folded back into the dot) it is a [k, t] @ [t, n] YNNPACK dot
            copied = jax.jit(lambda x, y: jax.lax.optimization_barrier(x.T) @ y)
            calls[name + " (x.T copied)"] = lambda dot=copied, a=a, b=b: dot(a, b).block_until_ready()
    return calls


def _decode_loop(a, b, spec: str):
    """LOOP dots in one jitted loop; the input changes each step (a scale) so no dot is hoisted out."""
    import jax
    import jax.numpy as jnp

    def body(_, carry):
        x, acc = carry
        return x * 0.999, acc + jnp.einsum(spec, x, b)

    out = jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)
    loop = jax.jit(lambda x, acc: jax.lax.fori_loop(0, LOOP, body, (x, acc))[1])
    return lambda: loop(a, out).block_until_ready()


def torch_calls() -> dict[str, object]:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.set_grad_enabled(False)
    generator = torch.Generator().manual_seed(0)
    calls = {}
    for name, (lhs, rhs, spec) in SHAPES.items():
        a = torch.randn(lhs, generator=generator)
        b = torch.randn(rhs, generator=generator)
        # The BLAS call each autograd / nn.Linear path makes: transposed views, no copies.
        mm = {"tk,kn->tn": lambda a, b: a @ b, "tn,kn->tk": lambda a, b: a @ b.t(),
              "tk,tn->kn": lambda a, b: a.t() @ b, "bkqe,bkse->bkqs": lambda a, b: a @ b.transpose(-1, -2),
              "bkqs,bkse->bkqe": lambda a, b: a @ b}[spec]
        calls[name] = lambda mm=mm, a=a, b=b: mm(a, b)
    return calls


def worker(kind: str, runs: int) -> None:
    calls = torch_calls() if kind == "torch" else xla_calls()
    print(json.dumps(time_calls(calls, runs)))


def run_worker(kind: str, flags: str, runs: int, pin: str | None) -> dict[str, dict[str, float]]:
    env = dict(os.environ)
    if kind == "xla":
        env["XLA_FLAGS"] = " ".join(part for part in (env.get("XLA_FLAGS", ""), flags) if part)
    elif kind == "torch-passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind.split("-")[0], "--runs", str(runs)]
    out = subprocess.run((["taskset", "-c", pin] if pin else []) + command,
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--config", action="append", default=[],
                        help="an XLA contender NAME=XLA_FLAGS (repeatable); default: xla= and xla-eigen=" + EIGEN)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-passive", action="store_true",
                        help="also torch with OMP_WAIT_POLICY=PASSIVE (its idle threads sleep instead of spinning, "
                             "which on a loaded machine otherwise counts as CPU time and steals cores)")
    parser.add_argument("--pin", help="run every worker under `taskset -c PIN` (torch then uses that many threads; "
                                      "XLA:CPU sizes its pool from the same affinity)")
    parser.add_argument("--json", help="also write every round's per-process medians here")
    parser.add_argument("--from-json", help="report a saved run (--json's file) instead of measuring")
    parser.add_argument("--worker", choices=["xla", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.runs)
        return
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)["rounds"]
        print_table(saved)
        print_step_bound(saved)
        return
    configs = [tuple(c.split("=", 1)) for c in args.config] or [("xla", ""), ("xla-eigen", EIGEN)]
    contenders = (([] if args.no_torch else [("torch", "torch", "")])
                  + ([("torch-passive", "torch-passive", "")] if args.torch_passive else [])
                  + [(n, "xla", f) for n, f in configs])
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name, _, _ in contenders}
    for index in range(args.rounds):
        for name, kind, flags in contenders:
            rounds[name].append(run_worker(kind, flags, args.runs, args.pin))
        print(f"round {index + 1} done", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": dict((n, f) for n, _, f in contenders), "rounds": rounds}, f, indent=1)
    print_table(rounds)
    print_step_bound(rounds)


def print_table(rounds: dict[str, list[dict[str, dict[str, float]]]]) -> None:
    names = list(rounds)
    shapes = list(rounds[names[-1]][0])
    print(f"GFLOP/s of wall time: median over rounds of each process's median (best process); CPU ms per call "
          f"(median). {len(rounds[names[0]])} rounds.")
    print(f"{'shape':<40}" + "".join(f"{n:>26}" for n in names))
    for shape in shapes:
        base = shape.removesuffix(" (loop)").removesuffix(" (x.T copied)")
        work = flops(base) * (LOOP if shape.endswith("(loop)") else 1)
        cells = []
        for name in names:
            per_round = [r[shape] for r in rounds[name] if shape in r]
            if not per_round:
                cells.append(f"{'-':>26}")
                continue
            wall = statistics.median(p["wall"] for p in per_round)
            best = min(p["wall"] for p in per_round)
            cpu = statistics.median(p["cpu"] for p in per_round) * 1e3
            cells.append(f"{work / wall / 1e9:>9.1f} ({work / best / 1e9:5.1f}) {cpu:7.3f}ms")
        print(f"{shape:<40}" + "".join(cells))


# W-small (4 layers): per layer the calls of each shape in one forward pass (q and o, k and v, gate and up, down,
# the attention's two batched dots); the output layer once. A backward pass runs each forward dot's two transposed
# dots (input and weight gradients), the attention's as two more calls of each of its forward shapes; k and v's
# transposed dots are not in SHAPES and are counted at their forward dot's time (4% of a layer's matmul FLOPs).
LAYERS, NEW_TOKENS, PROMPT_SHARE = 4, 64, 1 / 3  # the prefill: 32 x 32 prompt tokens, a third of T
FORWARD_CALLS = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}


def _seconds(times: dict[str, dict[str, float]], shape: str, kind: str) -> float:
    """One call of `shape`: the faster of its variants the contender measured (a weight gradient with `x.T`
    copied first, or not)."""
    variants = [times[name][kind] for name in (shape, shape + " (x.T copied)") if name in times]
    return min(variants)


def step_matmul_seconds(times: dict[str, dict[str, float]], kind: str) -> dict[str, float]:
    """Seconds (`kind`: wall or cpu) of the W-small step's matmuls at one contender's per-call medians: the update
    (forward and backward over T tokens), one log-prob forward, and generation (the prefill as a third of a
    forward, 64 decode steps of every projection and the output layer; XLA's decode dots from its jitted loop,
    torch's per call as its generate calls them). Decode attention, sampling and everything elementwise are left
    out, so any real step is slower."""
    def shape(prefix: str, suffix: str) -> str:
        if prefix == "k/v" and suffix != " x@W":  # its transposed dots are not measured: its forward dot's time
            suffix = " x@W"
        found = [name for name in SHAPES if name.startswith(prefix) and suffix in name]
        if len(found) != 1:
            raise KeyError(f"SHAPES has {len(found)} shapes {prefix!r} ... {suffix!r}: {found}")
        return found[0]

    def one(name: str) -> float:
        return _seconds(times, name, kind)

    attention = sum(one(name) for name in SHAPES if name.startswith("attn"))
    forward = LAYERS * (sum(n * one(shape(p, " x@W")) for p, n in FORWARD_CALLS.items()) + attention)
    forward += one(shape("logits", " x@W"))
    backward = LAYERS * (sum(n * (one(shape(p, "dY@W.T")) + one(shape(p, "X.T@dY"))) for p, n in FORWARD_CALLS.items())
                         + 2 * attention)
    backward += one(shape("logits", "dY@W.T")) + one(shape("logits", "X.T@dY"))

    def decode(prefix: str) -> float:
        name = shape("decode " + prefix, "")
        return times[name + " (loop)"][kind] / LOOP if name + " (loop)" in times else times[name][kind]

    decode_step = LAYERS * sum(n * decode(p) for p, n in FORWARD_CALLS.items()) + decode("logits")
    return {"update": forward + backward, "log-probs": forward,
            "generation": PROMPT_SHARE * forward + NEW_TOKENS * decode_step}


def print_step_bound(rounds: dict[str, list[dict[str, dict[str, float]]]]) -> None:
    """Per contender: the step's matmul seconds without and with the old-log-prob pass (a reference pass in both),
    from each shape's median over rounds."""
    print("W-small step matmuls at these rates (wall s / CPU s; a lower bound on a step that runs them so):")
    for name, per_round in rounds.items():
        medians = {shape: {kind: statistics.median(r[shape][kind] for r in per_round if shape in r)
                           for kind in ("wall", "cpu")} for shape in per_round[0]}
        parts = {kind: step_matmul_seconds(medians, kind) for kind in ("wall", "cpu")}
        cells = []
        for graph, passes in (("update + reference + generation", 1), ("+ old log-probs", 2)):
            wall, cpu = (parts[k]["update"] + passes * parts[k]["log-probs"] + parts[k]["generation"]
                         for k in ("wall", "cpu"))
            cells.append(f"{graph} {wall:.3f} / {cpu:.3f}")
        print(f"  {name:<14}" + "; ".join(cells))


if __name__ == "__main__":
    main()
