"""Built-in task: multi-digit addition and subtraction with a column-by-column scratchpad.

Prompt `Q:47+85\\n`. The reference completion works the columns from the units up, one line each, then
gives the answer on a line `A:<n>`:

    addition     a_i+b_i+c=s        (c the carry in; the digit is s mod 10, the carry out s div 10)
    subtraction  a'-b_i-c=r         (c the borrow in; a' = a_i, or a_i+10 when the column borrows)

so 47+85 gives `7+5+0=12\\n4+8+1=13\\nA:132` and 85-47 gives `15-7-0=8\\n8-4-1=3\\nA:38`. Operands have exactly
`digits` digits and a subtraction's first operand is the larger, so answers are never negative. Only the
answer line is verified: it must be the canonical decimal form of the result.
"""

from __future__ import annotations

import dataclasses
import random
import re

from rpegjax.data.example import DatasetError, Example
from rpegjax.rewards.runner import Isolation
from rpegjax.rewards.task import (
    ANSWER_PREFIX,
    Difficulty,
    GeneratedTask,
    check_fraction,
    extract_answer_line,
)

_OPERATIONS = ("+", "-")
_DIGITS_FOR = {Difficulty.EASY: 2, Difficulty.MEDIUM: 3, Difficulty.HARD: 4}
_CANONICAL_INTEGER = re.compile(r"0|[1-9][0-9]{0,19}", re.ASCII)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask(GeneratedTask):
    """`digits`: digits of each operand; `operations`: any of '+', '-'; `eval_fraction`: share of all
    problems held out; `format_bonus`: reward for a well-formed but wrong answer line (correct scores 1)."""

    digits: int = 2
    operations: tuple[str, ...] = _OPERATIONS
    eval_fraction: float = 0.1
    format_bonus: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"ArithmeticTask.digits must be an integer in [1, 9], got {self.digits!r}")
        operations = tuple(self.operations)
        if not operations or len(set(operations)) != len(operations) or not set(operations) <= set(_OPERATIONS):
            raise ValueError(f"ArithmeticTask.operations must be distinct entries of {_OPERATIONS}, got {self.operations!r}")
        object.__setattr__(self, "operations", operations)
        check_fraction("ArithmeticTask", "eval_fraction", self.eval_fraction, low_open=True)
        check_fraction("ArithmeticTask", "format_bonus", self.format_bonus, low_open=False)

    @classmethod
    def preset(cls, difficulty: Difficulty | str = Difficulty.EASY, **overrides: object) -> ArithmeticTask:
        """easy: 2-digit, medium: 3-digit, hard: 4-digit operands; `overrides` set other fields."""
        return cls(**{"digits": _DIGITS_FOR[Difficulty(difficulty)], **overrides})

    @property
    def name(self) -> str:
        return "arithmetic"

    @property
    def isolation(self) -> Isolation:
        return Isolation.THREAD

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        left, operation, right = rng.randint(low, high), rng.choice(self.operations), rng.randint(low, high)
        if operation == "-" and left < right:
            left, right = right, left
        return left, operation, right

    def _problem_key(self, problem: tuple[int, str, int]) -> str:
        return "".join(str(part) for part in problem)

    def _build(self, problem: tuple[int, str, int]) -> Example:
        return self.make_example(*problem)

    def make_example(self, left: int, operation: str, right: int) -> Example:
        """The example for `left operation right` (prompt, answer and the operands in `meta`)."""
        result = left + right if operation == "+" else left - right
        return Example(
            id=f"{self.name}/{left}{operation}{right}",
            prompt=f"Q:{left}{operation}{right}\n",
            answer=str(result),
            task=self.name,
            meta={"left": str(left), "operation": operation, "right": str(right)},
        )

    def is_correct(self, text: str, example: Example) -> bool:
        answer = extract_answer_line(text)
        return answer is not None and answer == example.answer

    def reward(self, text: str, example: Example) -> float:
        answer = extract_answer_line(text)
        if answer is None:
            return 0.0
        if answer == example.answer:
            return 1.0
        return self.format_bonus if _CANONICAL_INTEGER.fullmatch(answer) else 0.0

    def reference_solution(self, example: Example) -> str:
        """The column-by-column working and the answer line (see the module docstring)."""
        try:
            left, operation, right = (example.meta_value(k) for k in ("left", "operation", "right"))
        except KeyError as error:
            raise DatasetError(f"{example.where()}: not an arithmetic example ({error})") from None
        width = max(len(left), len(right))
        left_digits = [int(d) for d in reversed(left.zfill(width))]
        right_digits = [int(d) for d in reversed(right.zfill(width))]
        lines, carry = [], 0
        for a, b in zip(left_digits, right_digits):
            if operation == "+":
                total = a + b + carry
                lines.append(f"{a}+{b}+{carry}={total}")
                carry = total // 10
            else:
                borrow = int(a < b + carry)
                lines.append(f"{a + 10 * borrow}-{b}-{carry}={a + 10 * borrow - b - carry}")
                carry = borrow
        return "\n".join(lines) + f"\n{ANSWER_PREFIX}{example.answer}"
