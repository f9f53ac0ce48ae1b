"""The arithmetic task: scratchpad lines are correct column arithmetic, answers are exact."""

import re

import pytest

from rpegjax.rewards.arithmetic import ArithmeticTask
from rpegjax.rewards.expression import parse_expression

LINE = re.compile(r"(\d+)([+-])(\d+)\2(\d+)=(\d+)")


def test_worked_examples():
    task = ArithmeticTask()
    assert task.reference_solution(task.make_example(47, "+", 85)) == "7+5+0=12\n4+8+1=13\nA:132"
    assert task.reference_solution(task.make_example(85, "-", 47)) == "15-7-0=8\n8-4-1=3\nA:38"
    assert task.reference_solution(task.make_example(50, "-", 47)) == "10-7-0=3\n5-4-1=0\nA:3"
    example = task.make_example(47, "+", 85)
    assert example.prompt == "Q:47+85\n" and example.answer == "132"


@pytest.mark.parametrize("digits", [1, 2, 3, 5])
def test_scratchpad_is_column_arithmetic(digits):
    task = ArithmeticTask(digits=digits)
    for example in task.train_examples(60, seed=digits):
        left, operation, right = re.fullmatch(r"Q:(\d+)([+-])(\d+)\n", example.prompt).groups()
        left, right = int(left), int(right)
        expected = left + right if operation == "+" else left - right  # computed here, independently
        assert expected >= 0 and len(str(left)) == digits == len(str(right))
        *lines, answer = task.reference_solution(example).split("\n")
        assert answer == f"A:{expected}" and example.answer == str(expected)
        assert len(lines) == digits
        carry, digits_out = 0, []
        for column, line in enumerate(lines):
            a, op, b, carry_in, result = LINE.fullmatch(line).groups()
            assert op == operation and int(carry_in) == carry
            assert parse_expression(f"{a}{op}{b}{op}{carry_in}").value == int(result)
            assert int(b) == right // 10**column % 10
            if operation == "+":
                assert int(a) == left // 10**column % 10
                digits_out.append(int(result) % 10)
                carry = int(result) // 10
            else:
                borrowed = int(a) >= 10
                assert int(a) == left // 10**column % 10 + 10 * borrowed and 0 <= int(result) <= 9
                digits_out.append(int(result))
                carry = int(borrowed)
        total = sum(d * 10**i for i, d in enumerate(digits_out)) + carry * 10**digits
        assert total == expected


def test_answer_must_be_canonical_and_first():
    task = ArithmeticTask(format_bonus=0.25)
    example = task.make_example(47, "+", 85)
    assert task.is_correct("A:132", example)
    assert task.is_correct("work\nA:132\nA:7", example)  # the first answer line counts
    assert not task.is_correct("A:7\nA:132", example)
    assert not task.is_correct("A:0132", example) and task.reward("A:0132", example) == 0.0
    assert not task.is_correct("A:+132", example)
    assert not task.is_correct(" A:132", example)
    assert task.reward("A:133", example) == 0.25


def test_config_is_validated():
    with pytest.raises(ValueError, match="ArithmeticTask.digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="ArithmeticTask.operations"):
        ArithmeticTask(operations=("*",))
    with pytest.raises(ValueError, match="ArithmeticTask.eval_fraction"):
        ArithmeticTask(eval_fraction=1.0)
    with pytest.raises(ValueError, match="ArithmeticTask.format_bonus"):
        ArithmeticTask(format_bonus=2.0)
    assert ArithmeticTask(operations=["+"]).operations == ("+",)
    assert {e.prompt[4] for e in ArithmeticTask(operations=("-",)).train_examples(20, seed=0)} == {"-"}
