"""A planned plan's generation at other decode slot counts: what its slots buy.

Reads a `scripts/plan.py --json` document and re-predicts one of its plans with each slot count per replica (the
paged pool cut to those slots at capacity, as the planner cuts it): step and generate seconds, slots busy, the
live-token shares of the decode work (rows, cached keys read), decode steps, running rows and the generation
phase's peak memory. With `--seeds`, the partial-rollout simulation is drawn again with each seed over
`--measured` steps (the planner's: `partial_rollouts.MEASURED_STEPS`, seed 0): the mean and standard deviation of
the generate seconds say how much of a difference between slot counts is sampling noise.

    python scripts/plan.py --model qwen2.5-7b --hardware gh200 --gpus 256 --reference --top 0 --json > plan.json
    python benchmarks/bench_slot_counts.py plan.json [--plan best] [--slots 192,128,96,64,48] [--seeds 0,1,2,3]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys

from rpegjax.graph.ir import Graph, StageKind
from rpegjax.perf.model import partial_rollouts as partial
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.reference import presets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from plan import load_model  # noqa: E402  (the model presets plan.py wrote the document with)


def _evaluator(document: dict) -> step_model.Evaluator:
    """The evaluator plan.py predicted the document with (a preset model and hardware, the workload's lengths)."""
    w = document["workload"]
    workload = Workload(prompts=w["prompts"], group_size=w["group_size"], prompt_tokens=w["prompt_tokens"],
                        responses=ResponseLengths.lognormal(w["response_mean"], w["response_max"]))
    model = load_model(document["model"])
    return step_model.Evaluator.for_runtime(model, workload, presets.preset(document["hardware"], document["gpus"]))


def _with_slots(graph: Graph, per_replica: int, capacity: int, pool: int | None) -> Graph:
    replicas = math.prod(size for axis, size in graph.parallel_of("generate").items() if axis != "tensor")
    cut = None if pool is None else min(pool, per_replica * capacity)
    return dataclasses.replace(graph, execution=dataclasses.replace(
        graph.execution, decode_slots=per_replica * replicas, kv_pool_tokens=cut))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("document", help="a scripts/plan.py --json output")
    parser.add_argument("--plan", default="best", help="the plan's name in the document (best, verl-like, ...)")
    parser.add_argument("--slots", default="192,128,96,64,48,24", help="slots per generation replica, comma-separated")
    parser.add_argument("--pool", type=int, default=None,
                        help="the uncut pool per replica in tokens (default: the plan's own, or its slots at capacity)")
    parser.add_argument("--seeds", default="", help="partial rollouts: draw the simulation with each seed too")
    parser.add_argument("--measured", type=int, default=partial.MEASURED_STEPS, help="steps the --seeds runs average")
    args = parser.parse_args()
    document = json.load(open(args.document))
    plan = next(p for p in document["plans"] + document["alternatives"] if p["name"] == args.plan)
    graph = Graph.from_dict(plan["graph"])
    w = document["workload"]
    capacity = w["prompt_tokens"] + w["response_max"]
    counts = [int(c) for c in args.slots.split(",")]
    pool = args.pool if args.pool is not None else graph.execution.kv_pool_tokens
    if pool is not None and args.pool is None:
        pool = max(pool, max(counts) * capacity)  # the plan's pool may already be cut to its own slots
    print(plan["description"])
    print("| slots/replica | step s | generate s | slots busy | live rows | live keys | decode steps | running rows "
          "| generation peak GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    evaluator = _evaluator(document)
    for count in counts:
        prediction = evaluator.predict(_with_slots(graph, count, capacity, pool), with_trace=False)
        stage = next(s for s in prediction.stages if s.kind == StageKind.GENERATE)
        d = stage.detail
        print(f"| {count} | {prediction.step_seconds:.2f} | {stage.seconds:.2f} | {d['slot_busy']:.1%} | "
              f"{d['live_row_share']:.1%} | {d['live_key_share']:.1%} | {d['decode_steps']:.0f} | "
              f"{d['mean_active']:.1f} | {stage.peak_memory_bytes / 1e9:.1f} |")
    if not args.seeds:
        return
    drawn = partial.drawn_steady_state
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"\ngenerate seconds over seeds {seeds}, {args.measured} measured steps each:")
    for count in counts:
        seconds = []
        for seed in seeds:
            partial.drawn_steady_state = functools.partial(drawn, seed=seed, measured=args.measured)
            prediction = _evaluator(document).predict(_with_slots(graph, count, capacity, pool), with_trace=False)
            seconds.append(next(s for s in prediction.stages if s.kind == StageKind.GENERATE).seconds)
        partial.drawn_steady_state = drawn
        spread = statistics.stdev(seconds) if len(seconds) > 1 else 0.0
        print(f"  {count} slots: {', '.join(f'{s:.2f}' for s in seconds)}; mean {statistics.mean(seconds):.2f}, "
              f"sd {spread:.2f} ({spread / statistics.mean(seconds):.1%})")


if __name__ == "__main__":
    main()
