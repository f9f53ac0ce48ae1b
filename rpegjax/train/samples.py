"""What the model writes: a few completions of a training step or of a held-out evaluation, kept as lines of
`samples.jsonl`, TensorBoard text and short console lines."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rpegjax.data.example import Example
from rpegjax.train.evaluation import Answer
from rpegjax.train.records import set_aside_records


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One completion as a person reads it. `source` is "train" (a rollout of step `step`, scored by the
    run's reward) or "eval" (the greedy answer of a held-out evaluation after `step` steps, verified).
    `correct` is the verdict: reward >= 1 for rollouts (as the `accuracy` metric counts them), the task's
    verifier for evaluations (which have no reward: None)."""

    step: int
    source: str
    prompt: str
    response: str
    answer: str
    reward: float | None
    correct: bool
    finish_reason: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def training_samples(step: int, completions: Sequence[Any], examples: Sequence[Example], rewards: np.ndarray,
                     decode: Callable[[Sequence[int]], str], count: int) -> list[Sample]:
    """The first completion of each of the first `count` prompts of a step (`completions` and `rewards` in
    the same order; `Completion.prompt_index` indexes `examples`)."""
    chosen = []
    for completion, reward in zip(completions, rewards, strict=True):
        if completion.sample_index == 0 and len(chosen) < count:
            example = examples[completion.prompt_index]
            chosen.append(Sample(step=step, source="train", prompt=example.prompt,
                                 response=decode(completion.response_ids), answer=example.answer,
                                 reward=float(reward), correct=bool(reward >= 1.0),
                                 finish_reason=str(completion.finish_reason)))
    return chosen


def evaluation_samples(step: int, answers: Sequence[Answer], count: int) -> list[Sample]:
    return [Sample(step=step, source="eval", prompt=a.example.prompt, response=a.response, answer=a.example.answer,
                   reward=None, correct=a.correct, finish_reason=a.finish_reason) for a in answers[:count]]


def _clip(text: str, width: int) -> str:
    flat = json.dumps(text)[1:-1]  # newlines and quotes escaped: one sample, one line
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def console_lines(samples: Sequence[Sample], width: int = 60) -> list[str]:
    """One short line per sample: verdict, reward, prompt and response clipped to `width` characters."""
    lines = []
    for s in samples:
        score = "" if s.reward is None else f" reward {s.reward:.2f}"
        lines.append(f"  [{s.source} step {s.step}] {'✓' if s.correct else '✗'}{score} | {_clip(s.prompt, width)} "
                     f"-> {_clip(s.response, width)} (gold {_clip(s.answer, 20)})")
    return lines


def markdown(samples: Sequence[Sample]) -> str:
    """A Markdown table of `samples` (TensorBoard renders text summaries as Markdown)."""
    def cell(text: str) -> str:
        return json.dumps(text)[1:-1].replace("|", "\\|")

    rows = ["| verdict | reward | prompt | response | gold |", "|---|---|---|---|---|"]
    for s in samples:
        reward = "" if s.reward is None else f"{s.reward:.3f}"
        rows.append(f"| {'correct' if s.correct else 'wrong'} | {reward} | {cell(s.prompt)} | {cell(s.response)} "
                    f"| {cell(s.answer)} |")
    return "\n".join(rows)


class SampleLog:
    """Appends samples to `run_dir/samples.jsonl` (one JSON object per line); `enabled=False` (processes
    other than the first) makes `write` a no-op."""

    def __init__(self, run_dir: str | pathlib.Path, *, enabled: bool = True):
        self.path = pathlib.Path(run_dir) / "samples.jsonl"
        self.enabled = enabled

    def write(self, samples: Sequence[Sample]) -> None:
        if self.enabled and samples:
            with open(self.path, "a") as handle:
                handle.write("".join(s.to_json() + "\n" for s in samples))

    def truncate(self, next_step: int) -> pathlib.Path | None:
        """Sets aside the samples of steps after a resumed checkpoint (they are generated again) and the
        evaluations at `next_step` (the final evaluation of a run that ended there), in the file returned
        (`rpegjax.train.records`; None when nothing was dropped)."""
        if not self.enabled:
            return None
        return set_aside_records(self.path, lambda record: record["step"] < next_step or (
            record["step"] == next_step and record["source"] == "train"))
