"""The Countdown task: search, verification by parsing, number-usage rules."""

import itertools
import re
from fractions import Fraction

import pytest

from rpegjax.data.example import DatasetError
from rpegjax.rewards.countdown import CountdownTask, solve
from rpegjax.rewards.expression import parse_expression

STEP = re.compile(r"(\d+)([-+*/])(\d+)=(\d+)")


def reachable_with_one_operation(numbers, target):
    for a, b in itertools.permutations(numbers, 2):
        if target in (a + b, a - b, a * b) or (b and Fraction(a, b) == target):
            return True
    return False


def test_worked_example():
    task = CountdownTask()
    example = task.make_example((3, 5, 7), 22)
    assert example.prompt == "Q:3 5 7->22\n" and example.answer == "22"
    assert task.reference_solution(example) == "5*3=15\n15+7=22\nA:5*3+7"


def test_reference_steps_are_correct_and_minimal():
    task = CountdownTask.preset("medium")
    for example in task.train_examples(80, seed=2):
        numbers = [int(n) for n in example.meta_value("numbers").split()]
        target = int(example.answer)
        assert target not in numbers and 1 <= target <= task.max_target
        *steps, answer = task.reference_solution(example).split("\n")
        available = list(numbers)
        for step in steps:  # each step combines two available values into a new one
            a, operator, b, result = STEP.fullmatch(step).groups()
            assert parse_expression(f"{a}{operator}{b}").value == int(result)
            available.remove(int(a))
            available.remove(int(b))
            available.append(int(result))
        assert int(result) == target
        assert (len(steps) == 1) == reachable_with_one_operation(numbers, target)
        parsed = parse_expression(answer.removeprefix("A:"))
        assert parsed.value == target


def test_verification_rules():
    task = CountdownTask(format_bonus=0.1)
    example = task.make_example((1, 3, 4, 6), 24)
    assert task.is_correct("A:6/(1-3/4)", example)  # fractional intermediates are fine
    assert task.is_correct("A:4*6", example)  # not every number must be used
    assert task.is_correct("thinking...\nA: (6*4) ", example)
    assert not task.is_correct("A:6*4*1*1", example)  # 1 used twice
    assert not task.is_correct("A:24", example)  # 24 is not a given number
    assert not task.is_correct("A:6*3+4", example)  # 22
    assert not task.is_correct("6*4", example)  # no answer line
    assert task.reward("A:6*3+4", example) == pytest.approx(0.1)
    assert task.reward("A:6**4", example) == 0.0
    assert solve((1, 1), 5) is None
    with pytest.raises(DatasetError, match="no countdown solution"):
        task.reference_solution(task.make_example((1, 1), 5))


def test_config_is_validated():
    with pytest.raises(ValueError, match="CountdownTask.count"):
        CountdownTask(count=1)
    with pytest.raises(ValueError, match="CountdownTask.max_number"):
        CountdownTask(max_number=0)
    with pytest.raises(ValueError, match="CountdownTask.max_target"):
        CountdownTask(max_target=True)
    assert CountdownTask.preset("hard", max_target=500).max_target == 500
