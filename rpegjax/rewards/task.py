"""The task interface — examples with a held-out split, a verifier, a reward, reference solutions — and
the helpers the built-in generated tasks share (hash-based split, seeded distinct sampling, answer line)."""

from __future__ import annotations

import abc
import enum
import hashlib
import random
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from rpegjax.data.example import Example
from rpegjax.rewards.runner import Isolation

Problem = TypeVar("Problem")

ANSWER_PREFIX = "A:"
"""Built-in tasks end their completion with a line `A:<answer>`; the first such line is the answer."""


class Difficulty(enum.StrEnum):
    EASY = "easy"  # what the default CPU training run learns: prompts <= ~32, completions <= ~48 characters
    MEDIUM = "medium"
    HARD = "hard"


@runtime_checkable
class Task(Protocol):
    """A source of problems and the means to check answers to them.

    `train_examples(n, seed)` and `eval_examples(n, seed)` return `n` distinct examples, the same for the
    same seed, and never share a problem (the held-out split is fixed by construction, not by the seed).
    `is_correct` is the verifier; `reward` is what training optimises (correctness, maybe plus a small
    format bonus); `reference_solution` is a completion that verifies, for a supervised warm start.
    `isolation` says how a `RewardRunner` should run `reward`.
    """

    @property
    def name(self) -> str: ...

    @property
    def isolation(self) -> Isolation: ...

    def train_examples(self, n: int, seed: int) -> list[Example]: ...

    def eval_examples(self, n: int, seed: int) -> list[Example]: ...

    def reward(self, text: str, example: Example) -> float: ...

    def is_correct(self, text: str, example: Example) -> bool: ...

    def reference_solution(self, example: Example) -> str: ...


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """Whether the problem named `key` is held out: a stable hash of the key (BLAKE2b, not Python's
    salted `hash`) mapped to [0, 1) falls below `eval_fraction`."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < eval_fraction


def sample_problems(
    draw: Callable[[random.Random], Problem],
    key: Callable[[Problem], str],
    *,
    n: int,
    seed: int,
    held_out: bool,
    eval_fraction: float,
    task: str,
) -> list[Problem]:
    """`n` distinct problems of one split, drawn by `draw` from a generator seeded by (task, split, seed).

    Raises `ValueError` when the split seems to hold fewer than `n` problems (too many draws fail).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{task}: number of examples must be a non-negative integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{task}: seed must be an integer, got {seed!r}")
    split = "eval" if held_out else "train"
    # A string seed is hashed with SHA-512 by `random.Random`: reproducible across runs and platforms.
    rng = random.Random(f"{task}/{split}/{seed}")
    problems: dict[str, Problem] = {}
    attempts, budget = 0, 1000 + 200 * n
    while len(problems) < n:
        attempts += 1
        if attempts > budget:
            raise ValueError(
                f"{task}: found only {len(problems)} distinct {split} problems in {budget} draws, {n} requested; "
                "ask for fewer or raise the difficulty"
            )
        problem = draw(rng)
        name = key(problem)
        if name not in problems and in_eval_split(name, eval_fraction) == held_out:
            problems[name] = problem
    return list(problems.values())


class GeneratedTask(abc.ABC):
    """Base of the tasks generated from a seed: `train_examples` / `eval_examples` from the task's `_draw`
    (one random problem), `_problem_key` (its name for the split and for de-duplication) and `_build`
    (the `Example`); the class provides `name` and `eval_fraction`."""

    name: str
    eval_fraction: float

    @abc.abstractmethod
    def _draw(self, rng: random.Random) -> Any: ...

    @abc.abstractmethod
    def _problem_key(self, problem: Any) -> str: ...

    @abc.abstractmethod
    def _build(self, problem: Any) -> Example: ...

    def _generate(self, n: int, seed: int, held_out: bool) -> list[Example]:
        problems = sample_problems(
            self._draw, self._problem_key, n=n, seed=seed, held_out=held_out, eval_fraction=self.eval_fraction, task=self.name
        )
        return [self._build(problem) for problem in problems]

    def train_examples(self, n: int, seed: int) -> list[Example]:
        return self._generate(n, seed, held_out=False)

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        return self._generate(n, seed, held_out=True)


def extract_answer_line(text: str) -> str | None:
    """The text after `A:` on the first line that starts with it (stripped), or None if no line does."""
    for line in text.split("\n"):
        if line.startswith(ANSWER_PREFIX):
            return line[len(ANSWER_PREFIX) :].strip()
    return None


def check_fraction(owner: str, name: str, value: float, *, low_open: bool) -> None:
    """Validate a config fraction: in (0, 1) when `low_open`, else in [0, 1]."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (0 < value < 1 if low_open else 0 <= value <= 1)
    if not ok:
        interval = "(0, 1)" if low_open else "[0, 1]"
        raise ValueError(f"{owner}.{name} must be in {interval}, got {value!r}")
