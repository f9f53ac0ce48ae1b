"""Before/after of a change, interleaved in one run: `bench_wsmall_parts.py` (this tree's copy) alternately on another
source tree of the package (before, e.g. `git archive <commit> | tar -x -C DIR`) and on this one (after), one process
at a time, `--rounds` times. Prints each round's medians, the per-round before/after ratios and their median.

    python benchmarks/ab_trees.py --before DIR [--after DIR] [--rounds 3] [--runs 5] [--parts update logprobs generate paged floor]
    python benchmarks/ab_trees.py --before . --after-xla-flags=--xla_cpu_... [...]   # one tree, two XLA_FLAGS

A ratio above 1 means the change is faster. Each process compiles its programs before timing (warm-up excluded).
Ratios of wall time and of the process's CPU time (which waiting for a core does not inflate) are both printed.
`--before-xla-flags` / `--after-xla-flags` are appended to the caller's XLA_FLAGS for that side's processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_parts(tree: str, runs: int, parts: list[str], xla_flags: str = "") -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    env["XLA_FLAGS"] = " ".join(part for part in (env.get("XLA_FLAGS", ""), xla_flags) if part)
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench_wsmall_parts.py"), "--runs", str(runs),
                          "--parts", *parts], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="root of the source tree before the change")
    parser.add_argument("--after", default=os.path.dirname(HERE),
                        help="root of the source tree after the change (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["update", "logprobs", "generate", "paged", "floor"])
    parser.add_argument("--before-xla-flags", default="")
    parser.add_argument("--after-xla-flags", default="")
    args = parser.parse_args()
    after_tree = os.path.abspath(args.after)
    keys = args.parts + [f"{part}_cpu" for part in args.parts]
    ratios: dict[str, list[float]] = {key: [] for key in keys}
    for round_index in range(args.rounds):
        before = run_parts(os.path.abspath(args.before), args.runs, args.parts, args.before_xla_flags)
        after = run_parts(after_tree, args.runs, args.parts, args.after_xla_flags)
        for key in keys:
            ratios[key].append(before[key] / after[key])
        print(f"round {round_index + 1}: " + "; ".join(
            f"{key} {before[key] * 1e3:.1f} -> {after[key] * 1e3:.1f} ms" for key in keys), flush=True)
    print("before / after per round (median): " + "; ".join(
        f"{part} {' '.join(f'{r:.3f}' for r in values)} ({statistics.median(values):.3f})"
        for part, values in ratios.items()))


if __name__ == "__main__":
    main()
