"""Built-in task: Countdown — reach a target from given numbers with + - * / and parentheses.

Prompt `Q:3 5 7->22\\n`. A completion may show work, then must give an expression on a line `A:<expr>`;
it is correct when it uses each given number at most as often as given (not all must be used) and its exact
rational value equals the target. The answer is verified by parsing it with `rpegjax.rewards.expression`
(no `eval`, no powers, bounded sizes). The reference completion is found by breadth-first search (fewest
operations first, positive whole intermediate values, a fixed order), one step per line:

    3*5=15
    15+7=22
    A:3*5+7

Problems are generated so that such a solution exists and the target is not simply one of the numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from fractions import Fraction

from rpegjax.data.example import DatasetError, Example
from rpegjax.rewards.expression import ExpressionError, parse_expression
from rpegjax.rewards.runner import Isolation
from rpegjax.rewards.task import (
    ANSWER_PREFIX,
    Difficulty,
    GeneratedTask,
    check_fraction,
    extract_answer_line,
)

# An expression tree: an int leaf, or (operator, left, right).
Tree = int | tuple[str, "Tree", "Tree"]
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_PRESETS = {
    Difficulty.EASY: {"count": 3, "max_number": 9, "max_target": 99},
    Difficulty.MEDIUM: {"count": 4, "max_number": 20, "max_target": 200},
    Difficulty.HARD: {"count": 5, "max_number": 50, "max_target": 999},
}


def render(tree: Tree) -> str:
    """The expression with only the parentheses precedence needs (a-(b+c), a/(b*c); exact for rationals)."""
    if isinstance(tree, int):
        return str(tree)
    operator, left, right = tree
    left_text, right_text = render(left), render(right)
    if not isinstance(left, int) and _PRECEDENCE[left[0]] < _PRECEDENCE[operator]:
        left_text = f"({left_text})"
    if not isinstance(right, int) and (
        _PRECEDENCE[right[0]] < _PRECEDENCE[operator]
        or (_PRECEDENCE[right[0]] == _PRECEDENCE[operator] and operator in "-/")
    ):
        right_text = f"({right_text})"
    return f"{left_text}{operator}{right_text}"


def _combinations(a: int, b: int) -> list[tuple[str, int, int, int]]:
    """Steps (operator, x, y, x op y) from two values with a positive whole result, larger operand first."""
    high, low = max(a, b), min(a, b)
    steps = [("+", high, low, high + low), ("*", high, low, high * low)]
    if high > low:
        steps.append(("-", high, low, high - low))
    if low > 0 and high % low == 0:
        steps.append(("/", high, low, high // low))
    return steps


def solve(numbers: tuple[int, ...], target: int) -> tuple[list[str], Tree] | None:
    """A solution using fewest operations: (steps like '3*5=15', expression tree), or None.

    Breadth-first over states (the values still available, each with the tree that made it); pairs and
    operators are tried in a fixed order, so the answer is a function of (numbers, target) alone.
    """
    start = tuple((n, n, ()) for n in numbers)  # (value, tree, steps so far)
    frontier = [start]
    seen: set[tuple[int, ...]] = set()
    while frontier:
        next_frontier = []
        for state in frontier:
            for i in range(len(state)):
                for j in range(i + 1, len(state)):
                    rest = state[:i] + state[i + 1 : j] + state[j + 1 :]
                    (a, tree_a, steps_a), (b, tree_b, steps_b) = state[i], state[j]
                    for operator, x, y, value in _combinations(a, b):
                        tree_x, tree_y = (tree_a, tree_b) if x == a and (y == b) else (tree_b, tree_a)
                        steps = steps_a + steps_b + (f"{x}{operator}{y}={value}",)
                        tree = (operator, tree_x, tree_y)
                        if value == target:
                            return list(steps), tree
                        new_state = rest + ((value, tree, steps),)
                        values = tuple(sorted(item[0] for item in new_state))
                        if len(new_state) > 1 and values not in seen:
                            seen.add(values)
                            next_frontier.append(new_state)
        frontier = next_frontier
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownTask(GeneratedTask):
    """`count` numbers drawn from 1..`max_number`, a target in 1..`max_target`; `eval_fraction` of all
    problems held out; `format_bonus` for a parsable but wrong answer line (correct scores 1)."""

    count: int = 3
    max_number: int = 9
    max_target: int = 99
    eval_fraction: float = 0.1
    format_bonus: float = 0.0

    def __post_init__(self) -> None:
        for name, low, high in (("count", 2, 6), ("max_number", 2, 1000), ("max_target", 2, 10**6)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"CountdownTask.{name} must be an integer in [{low}, {high}], got {value!r}")
        check_fraction("CountdownTask", "eval_fraction", self.eval_fraction, low_open=True)
        check_fraction("CountdownTask", "format_bonus", self.format_bonus, low_open=False)

    @classmethod
    def preset(cls, difficulty: Difficulty | str = Difficulty.EASY, **overrides: object) -> CountdownTask:
        """easy: 3 numbers <= 9, targets <= 99; medium: 4 <= 20, <= 200; hard: 5 <= 50, <= 999."""
        return cls(**{**_PRESETS[Difficulty(difficulty)], **overrides})

    @property
    def name(self) -> str:
        return "countdown"

    @property
    def isolation(self) -> Isolation:
        return Isolation.THREAD

    def _draw(self, rng: random.Random) -> tuple[tuple[int, ...], int]:
        """Numbers, and a target made by combining a random subset of them (so a solution exists)."""
        for _ in range(10_000):
            numbers = tuple(rng.randint(1, self.max_number) for _ in range(self.count))
            values = list(rng.sample(numbers, rng.randint(2, self.count)))
            while len(values) > 1:
                a, b = values.pop(rng.randrange(len(values))), values.pop(rng.randrange(len(values)))
                values.append(rng.choice(_combinations(a, b))[3])
            target = values[0]
            if 1 <= target <= self.max_target and target not in numbers:
                return numbers, target
        raise ValueError(f"{self!r} produced no usable problem in 10000 draws; loosen max_target or max_number")

    def _problem_key(self, problem: tuple[tuple[int, ...], int]) -> str:
        numbers, target = problem
        return f"{sorted(numbers)}->{target}"  # the same numbers in another order are the same problem

    def _build(self, problem: tuple[tuple[int, ...], int]) -> Example:
        return self.make_example(*problem)

    def make_example(self, numbers: tuple[int, ...], target: int) -> Example:
        shown = " ".join(str(n) for n in numbers)
        return Example(
            id=f"{self.name}/{shown}->{target}",
            prompt=f"Q:{shown}->{target}\n",
            answer=str(target),
            task=self.name,
            meta={"numbers": shown},
        )

    @staticmethod
    def _problem(example: Example) -> tuple[tuple[int, ...], int]:
        try:
            return tuple(int(n) for n in example.meta_value("numbers").split()), int(example.answer)
        except (KeyError, ValueError) as error:
            raise DatasetError(f"{example.where()}: not a countdown example ({error})") from None

    def _judge(self, text: str, example: Example) -> tuple[bool, bool]:
        """(parsable answer line, correct)."""
        answer = extract_answer_line(text)
        if answer is None:
            return False, False
        try:
            parsed = parse_expression(answer)
        except ExpressionError:
            return False, False
        numbers, target = self._problem(example)
        available = collections.Counter(numbers)
        used = collections.Counter(parsed.numbers)
        return True, all(used[n] <= available[n] for n in used) and parsed.value == Fraction(target)

    def is_correct(self, text: str, example: Example) -> bool:
        return self._judge(text, example)[1]

    def reward(self, text: str, example: Example) -> float:
        parsable, correct = self._judge(text, example)
        return 1.0 if correct else (self.format_bonus if parsable else 0.0)

    def reference_solution(self, example: Example) -> str:
        numbers, target = self._problem(example)
        solution = solve(numbers, target)
        if solution is None:
            raise DatasetError(f"{example.where()}: no countdown solution reaches {target} from {numbers}")
        steps, tree = solution
        return "\n".join([*steps, f"{ANSWER_PREFIX}{render(tree)}"])
