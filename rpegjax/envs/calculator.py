"""The calculator tool for the arithmetic and countdown tasks: `<tool>2*(3+4)</tool>` -> `<result>14</result>`.

Expressions are evaluated by `rpegjax.rewards.expression` (integers, + - * /, parentheses; no names, calls or
powers; bounded size), exactly, so 7/2 is `7/2` and never a float; anything else answers an error the
model can read. The episode's reward is the task's, of the last model turn (the calculator judges nothing).
"""

from __future__ import annotations

from rpegjax.envs.protocol import TaggedToolEnvironment
from rpegjax.rewards.expression import ExpressionError, parse_expression

INSTRUCTIONS = "You may use a calculator: write <tool>expression</tool> and read its <result>value</result>.\n"


def calculate(expression: str) -> str:
    """The exact value of `expression` (`p/q` when not an integer), or `error: ...`."""
    try:
        value = parse_expression(expression.strip()).value
    except (ExpressionError, ZeroDivisionError) as error:
        return f"error: {error}"
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def calculator_environment(*, instructions: str = INSTRUCTIONS, call_start: str = "<tool>", call_end: str = "</tool>",
                           result_start: str = "<result>", result_end: str = "</result>") -> TaggedToolEnvironment:
    """The calculator environment; the tags must match the tokenizer's."""
    return TaggedToolEnvironment(name="calculator", tool=calculate, call_start=call_start, call_end=call_end,
                                 result_start=result_start, result_end=result_end, instructions=instructions)
