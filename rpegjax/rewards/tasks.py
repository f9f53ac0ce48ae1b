"""The built-in tasks by name: `TASKS[name](difficulty)` builds one (no download, generated from a seed)."""

from __future__ import annotations

import enum
from collections.abc import Callable

from rpegjax.rewards.arithmetic import ArithmeticTask
from rpegjax.rewards.countdown import CountdownTask
from rpegjax.rewards.task import Difficulty, Task


class TaskName(enum.StrEnum):
    ARITHMETIC = "arithmetic"
    COUNTDOWN = "countdown"


TASKS: dict[TaskName, Callable[..., Task]] = {
    TaskName.ARITHMETIC: ArithmeticTask.preset,
    TaskName.COUNTDOWN: CountdownTask.preset,
}


def make_task(name: TaskName | str, difficulty: Difficulty | str = Difficulty.EASY, **overrides: object) -> Task:
    """The built-in task `name` at `difficulty`; `overrides` set its other fields (e.g. format_bonus=0.1)."""
    try:
        name = TaskName(name)
    except ValueError:
        raise ValueError(f"unknown built-in task {name!r}; known: {[t.value for t in TaskName]}") from None
    try:
        difficulty = Difficulty(difficulty)
    except ValueError:
        raise ValueError(f"unknown difficulty {difficulty!r}; known: {[d.value for d in Difficulty]}") from None
    return TASKS[name](difficulty, **overrides)
