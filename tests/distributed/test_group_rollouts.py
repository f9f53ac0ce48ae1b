"""What a single-host run has, over process groups: rollouts handed over piece by piece (the training process
starts on the first pieces while the rest still decode, measured in the processes' traces), held-out evaluation
during the run, dynamic sampling, and processes of different device counts. Each test runs
`scripts/train_grpo.py` disaggregated over processes on localhost and the same plan in one process with the same
devices, from the same warm-start weights: every metric of every step agrees within 1e-5.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from test_distributed_job import assert_same_records, finish, records, start, summary

from rpegjax.graph.trace import Trace


def _run_split_and_one(tmp_path: pathlib.Path, flags: list[str], *, processes: int, devices: int | list[int]
                       ) -> tuple[pathlib.Path, list[dict], list[dict]]:
    """The job over `processes` processes of `devices` CPU devices each (or process i `devices[i]`) and in one
    process with all of them; the split run's directory and both runs' records (already checked equal)."""
    split, one = tmp_path / "split", tmp_path / "one"
    total = sum(devices) if isinstance(devices, list) else processes * devices
    finish(start(one, *flags, f"--warm_start.cache_dir={tmp_path}/cache_one", processes=1, devices=total),
           timeout=600)
    shutil.copytree(tmp_path / "cache_one", tmp_path / "cache_split")  # the same warm-start weights, bit for bit
    outputs = finish(start(split, *flags, f"--warm_start.cache_dir={tmp_path}/cache_split", processes=processes,
                           devices=devices), timeout=600)
    assert [summary(out) is not None for out, _ in outputs] == [False] * (processes - 1) + [True]
    split_records, one_records = records(split), records(one)
    assert any(r.get("reward", 0) > 0 for r in split_records)  # not a blind comparison
    assert_same_records(split_records, one_records)
    return split, split_records, one_records


def _wall_clock_events(path: pathlib.Path) -> list:
    """A trace file's events with times on the wall clock the processes of one host share (origin added)."""
    origin = json.loads(path.read_text())["otherData"]["origin"]
    return [(e.stage, e.step, e.microbatch, e.start + origin, e.end + origin) for e in Trace.from_chrome_json(path)]


def handover_times(run_dir: pathlib.Path, generation_process: int = 0) -> list[dict[str, float]]:
    """Per step, on the shared wall clock: when the generation process sent the first piece and finished generating
    the step, when the training process received the first piece and began its first pass over it; `overlap` is
    the time the training process worked on the step while it was still being generated."""
    generation = _wall_clock_events(run_dir / f"trace.generation-{generation_process}.json")
    training = _wall_clock_events(run_dir / "trace.json")

    def first(events, stage: str, step: int, edge: int) -> float:
        return min(e[edge] for e in events if stage in e[0] and e[1] == step and e[2] in (0, None))

    steps = sorted({e[1] for e in generation if e[0] == "generate"})
    times = []
    for step in steps:
        generated = max(e[4] for e in generation if e[0] == "generate" and e[1] == step)
        work = first(training, "logprob", step, 3)
        times.append({"step": step, "first_sent": first(generation, "rollout_send", step, 3),
                      "first_arrived": first(training, "rollout_arrival", step, 4), "training_started": work,
                      "generated": generated, "overlap": generated - work})
    return times


@pytest.mark.slow
def test_pieces_reach_the_training_process_while_the_step_still_generates(tmp_path):
    """Process 0 generates (2 devices, data=2), process 1 trains (data=2), bound 0; each step's 4 prompt groups
    come in 2 pieces, and 8 slots for 16 sequences decode the second piece after the first. Held-out evaluation
    after every step. In every step the first piece reached the training process, and its old-log-prob pass
    began, before generation of the step ended (the overlap, from the two processes' traces)."""
    flags = ["--steps=2", "--async-bound=0", "--rollout-devices=2", "--mesh=data=2", "--rollout-mesh=data=2",
             "--graph.generate_microbatches=2", "--rollout.num_slots=8", "--train.eval_every=1",
             "--train.export_hf=false"]
    split, split_records, _ = _run_split_and_one(tmp_path, flags, processes=2, devices=2)
    assert [r["step"] for r in split_records if "eval/accuracy" in r] == [0, 1, 2]  # evaluated during the run too
    times = handover_times(split)
    assert [t["step"] for t in times] == [0, 1]
    for t in times:
        print(f"step {t['step']}: first piece sent {t['generated'] - t['first_sent']:.3f} s and received "
              f"{t['generated'] - t['first_arrived']:.3f} s before generation ended; training worked on the step "
              f"for {t['overlap']:.3f} s of its generation")
        assert t["first_sent"] <= t["first_arrived"] <= t["training_started"] < t["generated"], t


@pytest.mark.slow
def test_dynamic_sampling_over_process_groups_decides_like_one_process(tmp_path):
    """`--recipe dapo` with processes 0-1 generating (1 device each, data=2: each round's rewards are gathered
    over the two) and process 2 training, the step in 2 pieces, bound 1: the same groups kept, the same extra
    rounds and every metric of one process with the same 3 devices."""
    flags = ["--recipe=dapo", "--steps=2", "--grpo.max_extra_rounds=8", "--async-bound=1", "--rollout-devices=2",
             "--mesh=data=1", "--rollout-mesh=data=2", "--graph.generate_microbatches=2", "--train.export_hf=false"]
    _, split_records, _ = _run_split_and_one(tmp_path, flags, processes=3, devices=1)
    assert sum(r.get("dynamic_sampling/extra_rounds", 0) for r in split_records) > 0  # not a blind comparison
    assert all("dynamic_sampling/generated_sequences" in r for r in split_records if "loss" in r)


@pytest.mark.slow
def test_processes_with_different_device_counts_in_one_launch(tmp_path):
    """Process 0 generates on its 2 CPU devices (data=2), process 1 trains on its 1: the set-up collectives run
    over one device per process, so the launch holds processes of different device counts. Every metric of every
    step, and the held-out accuracy, equal one process with the same 3 devices."""
    flags = ["--steps=2", "--async-bound=1", "--rollout-devices=2", "--mesh=data=1", "--rollout-mesh=data=2",
             "--train.export_hf=false"]
    _, split_records, _ = _run_split_and_one(tmp_path, flags, processes=2, devices=[2, 1])
    assert [r["step"] for r in split_records if "eval/accuracy" in r] == [0, 2]


@pytest.mark.slow
def test_partial_rollouts_over_process_groups_resume_exactly(tmp_path):
    """Partial rollouts with process 0 generating and processes 1-2 training (data=2; bound 1, a checkpoint every
    step): a run of 4 steps, and a run stopped after step 2 then resumed to step 4. The step-2 checkpoint holds the
    groups in flight, which the generation process had sent with the step's last piece; resumed, the training
    process sends them back with the start of the run, and steps 3 and 4 train exactly what the uninterrupted run
    trained."""
    flags = ["--rollout.partial=true", "--checkpoint-every=1", "--async-bound=1", "--rollout-devices=1",
             "--mesh=data=2", "--rollout-mesh=data=1", "--train.export_hf=false",
             "--rollout.num_slots=32",  # both batches in flight decode at once: the carry holds started sequences
             f"--warm_start.cache_dir={tmp_path}/cache"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run_dir, steps in ((whole, 4), (cut, 2)):
        finish(start(run_dir, f"--steps={steps}", *flags, processes=3, devices=1), timeout=600)

    def trained(run_dir: pathlib.Path) -> dict[int, dict]:
        return {r["step"]: r for r in records(run_dir) if "loss" in r}

    assert trained(cut)[2]["partial/carried_groups"] > 0  # the checkpoint at step 2 holds groups in flight
    outputs = finish(start(cut, "--resume", str(cut), "--steps=4", *flags, processes=3, devices=1),
                     timeout=600)  # the flags again: they override `SMALL`'s (the launch's) layout
    assert "resumed from step 2" in outputs[1][1]  # the first training process speaks for the run
    once, again = trained(whole), trained(cut)
    assert sorted(again) == [1, 2, 3, 4]
    assert sum(once[step]["partial/carried_sequences"] for step in (3, 4)) > 0  # carried sequences trained
    assert_same_records([again[3], again[4]], [once[3], once[4]])
