"""A loaded math dataset (GSM8K, MATH or plain rows) as a `Task`, rewarded by math-verify."""

from __future__ import annotations

import dataclasses
import random

from rpegjax.data.example import SOLUTION_KEY, Example
from rpegjax.rewards.format import format_reward
from rpegjax.rewards.math import MathVerifier, check_gold_answer
from rpegjax.rewards.runner import Isolation
from rpegjax.rewards.task import check_fraction, in_eval_split


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathAnswerReward:
    """1.0 when math-verify accepts the completion's answer, else `format_bonus` if the completion has the
    `<think>…</think>`-then-answer format, else 0.0."""

    verifier: MathVerifier = MathVerifier()
    format_bonus: float = 0.0

    def __post_init__(self) -> None:
        check_fraction("MathAnswerReward", "format_bonus", self.format_bonus, low_open=False)

    def __call__(self, text: str, example: Example) -> float:
        if self.verifier.is_correct(text, example):
            return 1.0
        return self.format_bonus * format_reward(text) if self.format_bonus else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathDatasetTask:
    """Examples from files, verified by math-verify.

    The held-out split is `held_out` when given (e.g. a dataset's test file), else the examples whose
    prompt hashes into `eval_fraction` (`rpegjax.rewards.task.in_eval_split`). Every gold answer is checked
    at construction; one that math-verify cannot parse raises `DatasetError` naming its file and line.
    `reward` (a `MathAnswerReward`) = 1 if correct, else `format_bonus` when the completion has the
    `<think>…</think>` format.
    """

    name: str = "math"
    examples: tuple[Example, ...]
    held_out: tuple[Example, ...] | None = None
    eval_fraction: float = 0.1
    format_bonus: float = 0.0
    verifier: MathVerifier = MathVerifier()
    # A callable field, not a method: a RewardRunner pickles `task.reward` into each worker process, and a
    # bound method would carry the whole dataset along.
    reward: MathAnswerReward = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"MathDatasetTask.name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "examples", tuple(self.examples))
        if self.held_out is not None:
            object.__setattr__(self, "held_out", tuple(self.held_out))
        check_fraction("MathDatasetTask", "eval_fraction", self.eval_fraction, low_open=True)
        check_fraction("MathDatasetTask", "format_bonus", self.format_bonus, low_open=False)
        for example in (*self.examples, *(self.held_out or ())):
            if not isinstance(example, Example):
                raise TypeError(f"MathDatasetTask holds {type(example).__name__} {example!r}; expected Example")
            check_gold_answer(example)
        object.__setattr__(self, "reward", MathAnswerReward(verifier=self.verifier, format_bonus=self.format_bonus))

    @property
    def isolation(self) -> Isolation:
        return Isolation.PROCESS

    def _split(self, held_out: bool) -> tuple[Example, ...]:
        if self.held_out is not None:
            return self.held_out if held_out else self.examples
        return tuple(e for e in self.examples if in_eval_split(e.prompt, self.eval_fraction) == held_out)

    def _take(self, n: int, seed: int, held_out: bool) -> list[Example]:
        pool = list(self._split(held_out))
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(pool):
            split = "eval" if held_out else "train"
            raise ValueError(f"{self.name}: asked for {n!r} {split} examples, the split holds {len(pool)}")
        random.Random(f"{self.name}/{seed}").shuffle(pool)
        return pool[:n]

    def split_size(self, *, held_out: bool) -> int:
        """How many examples the train (or held-out) split holds."""
        return len(self._split(held_out))

    def train_examples(self, n: int, seed: int) -> list[Example]:
        return self._take(n, seed, held_out=False)

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        return self._take(n, seed, held_out=True)

    def is_correct(self, text: str, example: Example) -> bool:
        return self.verifier.is_correct(text, example)

    def reference_solution(self, example: Example) -> str:
        """The row's worked solution when the file had one (a GSM8K or MATH row), else `\\boxed{answer}`."""
        try:
            return example.meta_value(SOLUTION_KEY)
        except KeyError:
            return f"\\boxed{{{example.answer}}}"

