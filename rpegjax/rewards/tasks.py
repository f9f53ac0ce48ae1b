"""The built-in tasks by name: `TASKS[name](difficulty)` builds one (no download, generated from a seed)."""

from __future__ import annotations

from collections.abc import Callable

from rpegjax.rewards.arithmetic import ArithmeticTask
from rpegjax.rewards.countdown import CountdownTask
from rpegjax.rewards.task import Difficulty, Task

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask.preset,
    "countdown": CountdownTask.preset,
}


def make_task(name: str, difficulty: Difficulty | str = Difficulty.EASY, **overrides: object) -> Task:
    """The built-in task `name` at `difficulty`; `overrides` set its other fields (e.g. format_bonus=0.1)."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known: {sorted(TASKS)}")
    try:
        difficulty = Difficulty(difficulty)
    except ValueError:
        raise ValueError(f"unknown difficulty {difficulty!r}; known: {[d.value for d in Difficulty]}") from None
    return TASKS[name](difficulty, **overrides)
