"""Why a plan is as fast as it is, in words: what bounds its step, what overlaps, how it differs from others.

Read from a `planner.Plan` alone (its choice, graph and prediction): the busiest device set per step is the
resource that bounds the step (`schedule.resource_bound`); the gap between the sum of stage times and the
step time is what the plan overlaps (asynchrony, disaggregation, micro-batching).
"""

from __future__ import annotations

from collections.abc import Sequence

from rpegjax.graph.ir import StageKind
from rpegjax.perf.planner.choice import Plan

LEGEND = (
    "Plan notation:\n"
    "  k=N           asynchrony bound: generation runs up to N steps ahead of training on weights N versions old\n"
    "                (k=0 on-policy, k=1 one-step off-policy)\n"
    "  colocated     generation and training take turns on all GPUs; disaggregated G+T: G GPUs generate, T train\n"
    "  d48xt4        a layout: data 48 x tensor 4 (d data-parallel replicas, f FSDP/ZeRO-3 shards of the weights,\n"
    "                t tensor-parallel ranks, p pipeline stages, e expert-parallel shards of a mixture-of-experts\n"
    "                model's experts, c context-parallel ranks); f64 alone = 64-way FSDP; 1 = one GPU\n"
    "  gen / train   the generation layout and the training (update) layout\n"
    "  fused         the inference stages (reference, old log-probs, values) run as one program per step\n"
    "  N microbatches  generation and the stages after it work in N pieces, so the next stage starts on the\n"
    "                first piece while generation still runs\n"
    "  re-sharded    inference stages on their own fastest layout, weights re-sharded before each\n"
    "  critic shared PPO actor and critic share one trunk (two heads)")


def _busy_by_devices(plan: Plan) -> dict[str, tuple[int, float, list[tuple[str, float]]]]:
    """Per placement: (GPUs, busy seconds per step, stages and their seconds), from the predicted stages."""
    graph, out = plan.graph, {}
    seconds = plan.prediction.stage_seconds()
    for stage in graph.stages:
        if stage.host:
            continue
        name = stage.placement
        gpus = len(graph.placements[name].device_indices)
        _, busy, members = out.get(name, (gpus, 0.0, []))
        out[name] = (gpus, busy + seconds[stage.name], members + [(stage.name, seconds[stage.name])])
    return out


def bottleneck(plan: Plan) -> str:
    """Which device set and stage bound the step."""
    busy = _busy_by_devices(plan)
    name, (gpus, seconds, members) = max(busy.items(), key=lambda item: item[1][1])
    stage, stage_seconds = max(members, key=lambda item: item[1])
    step = plan.prediction.step_seconds
    share = 100 * stage_seconds / seconds if seconds else 0.0
    return (f"the step ({step:.1f} s) is bound by the {gpus} GPUs of placement {name!r}, busy {seconds:.1f} s per "
            f"step; its largest stage is {stage} ({stage_seconds:.1f} s, {share:.0f}% of that)")


def overlaps(plan: Plan) -> list[str]:
    """What runs at the same time in this plan, and how much time that saves per step."""
    choice, prediction = plan.choice, plan.prediction
    lines = []
    if choice.generation_devices:
        lines.append(f"generation runs on its own {choice.generation_devices} GPUs beside training on "
                     f"{choice.num_devices - choice.generation_devices}: the two overlap whenever k >= 1")
    if choice.async_bound:
        lines.append(f"k={choice.async_bound}: generation of step t+{choice.async_bound} overlaps the log-probs and "
                     f"update of step t (weights up to {choice.async_bound} version(s) old)")
    else:
        lines.append("k=0: on-policy, every stage waits for the one before it")
    if choice.microbatches > 1:
        lines.append(f"{choice.microbatches} micro-batches: the stages after generation start on its first piece")
    if choice.fused:
        lines.append("the inference stages are fused into one program (one dispatch, shared reads)")
    total = sum(s.seconds for s in prediction.stages)
    saved = total - prediction.step_seconds
    if saved > 0.01 * total:
        lines.append(f"stages add up to {total:.1f} s; overlap brings the step to {prediction.step_seconds:.1f} s "
                     f"({saved:.1f} s saved)")
    return lines


def compare(plan: Plan, other: Plan, name: str) -> str:
    """How `plan` differs from the reference plan `other`: step time and the stages that differ most."""
    if not other.prediction.fits:
        return f"{name}: {other.prediction.fit_reason}"
    mine, theirs = plan.prediction.stage_seconds(), other.prediction.stage_seconds()
    ratio = other.prediction.step_seconds / plan.prediction.step_seconds
    diffs = sorted(((theirs.get(s, 0.0) - mine.get(s, 0.0), s) for s in set(mine) | set(theirs)),
                   key=lambda item: (-abs(item[0]), item[1]))
    stages = ", ".join(f"{s} {theirs.get(s, 0.0):.1f} s vs {mine.get(s, 0.0):.1f} s" for d, s in diffs[:2] if abs(d) > 0.05)
    text = (f"{name}: {other.prediction.step_seconds:.1f} s/step, {ratio:.2f}x the best plan's "
            f"{plan.prediction.step_seconds:.1f} s ({other.choice.describe()})")
    if stages:
        text += f"; largest stage differences: {stages}"
    if not other.choice.async_bound and plan.choice.async_bound:
        generate = next(s.name for s in plan.graph.stages if StageKind.GENERATE in s.kinds)
        text += (f"; it cannot hide {generate} behind training (k=0): its stages add up to "
                 f"{sum(theirs.values()):.1f} s")
    return text


def explain(plan: Plan, references: Sequence[tuple[str, Plan]]) -> str:
    """The `--explain` text of `scripts/plan.py`: why `plan` wins against `references`."""
    lines = [f"Why the best plan wins ({plan.choice.describe()}):", f"- {bottleneck(plan)}"]
    lines += [f"- {line}" for line in overlaps(plan)]
    lines += [f"- {compare(plan, other, name)}" for name, other in references]
    return "\n".join(lines)
