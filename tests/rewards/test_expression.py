"""The safe arithmetic parser: exact values against an independent tree evaluation, and hostile input."""

import random
from fractions import Fraction

import pytest

from rpegjax.rewards.countdown import render
from rpegjax.rewards.expression import MAX_CHARS, MAX_DEPTH, ExpressionError, parse_expression


def evaluate(tree):
    if isinstance(tree, int):
        return Fraction(tree)
    operator, left, right = tree
    a, b = evaluate(left), evaluate(right)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[operator]


def leaves(tree):
    return [tree] if isinstance(tree, int) else leaves(tree[1]) + leaves(tree[2])


def random_tree(rng, depth):
    if depth == 0 or rng.random() < 0.3:
        return rng.randint(1, 30)
    return (rng.choice("+-*/"), random_tree(rng, depth - 1), random_tree(rng, depth - 1))


def fully_parenthesised(tree):
    if isinstance(tree, int):
        return str(tree)
    return f"({fully_parenthesised(tree[1])} {tree[0]} {fully_parenthesised(tree[2])})"


@pytest.mark.parametrize(
    "text, value",
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("8-3-2", 3),  # left-associative
        ("8/4/2", 1),
        ("8/(4/2)", 4),
        ("1/3+1/6", Fraction(1, 2)),
        (" 6 / ( 1 - 3 / 4 ) ", 24),
        ("007", 7),
    ],
)
def test_known_values(text, value):
    assert parse_expression(text).value == value


def test_random_trees_match_independent_evaluation():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        tree = random_tree(rng, 4)
        try:
            value = evaluate(tree)
        except ZeroDivisionError:
            continue
        for text in (fully_parenthesised(tree), render(tree)):  # render drops the parentheses it can
            parsed = parse_expression(text)
            assert parsed.value == value, text
            assert list(parsed.numbers) == leaves(tree), text
        checked += 1
    assert checked > 250


@pytest.mark.parametrize(
    "text",
    [
        "9**9**9",
        "9^9^9",
        "__import__('os')",
        "__import__('os').system('true')",
        "1/0",
        "2/(1-1)",
        "(1+2",
        "1+2)",
        "1+",
        "",
        "   ",
        "-3",  # no unary minus: Countdown uses the given numbers
        "1e9",
        "1.5",
        "2 3",
        "1" * 13,  # more digits than allowed
        "\u0663+1",  # a non-ASCII digit
        "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1),
        "1+" * MAX_CHARS + "1",
    ],
)
def test_rejects_malformed_and_hostile_input(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)


def test_nesting_up_to_the_limit_is_fine():
    text = "(" * MAX_DEPTH + "5" + ")" * MAX_DEPTH
    assert parse_expression(text).value == 5
