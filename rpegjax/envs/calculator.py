"""The calculator tool for the arithmetic and countdown tasks: `<tool>2*(3+4)</tool>` -> `<result>14</result>`.

Expressions are evaluated by `rpegjax.rewards.expression` (integers, + - * /, parentheses; no names, calls or
powers; bounded size), exactly, so 7/2 is `7/2` and never a float; anything else answers an error the
model can read. The episode's reward is the task's, of the last model turn (the calculator judges nothing).
"""

from __future__ import annotations

from collections.abc import Callable

from rpegjax.data.example import Example
from rpegjax.envs.protocol import TaggedToolEnvironment, WorkedEpisode
from rpegjax.rewards.expression import ExpressionError, parse_expression
from rpegjax.rewards.task import extract_answer_line

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


def _arithmetic_call(example: Example, reference: str) -> str:
    """`Q:47+85` asks the calculator for 47+85 (the column-by-column reference is not needed)."""
    return "".join(example.meta_value(name) for name in ("left", "operation", "right"))


def _countdown_call(example: Example, reference: str) -> str:
    """A countdown answer is an expression: the calculator checks that it reaches the target."""
    answer = extract_answer_line(reference)
    if answer is None:
        raise ValueError(f"{example.where()}: the reference solution has no answer line")
    return answer


_CALLS: dict[str, Callable[[Example, str], str]] = {
    "arithmetic": _arithmetic_call,
    "countdown": _countdown_call,
}


def worked_calculator_episode(env: TaggedToolEnvironment, example: Example, reference: str) -> WorkedEpisode | None:
    """The episode a supervised warm start teaches for `example` of a built-in task: one calculator call, the
    calculator's answer (context, not trained), then the reference solution's answer line, e.g.
    `<tool>47+85</tool>` `<result>132</result>` `A:132`. None for a task the calculator has no call for."""
    call = _CALLS.get(example.task)
    answer = extract_answer_line(reference)
    if call is None or answer is None:
        return None
    return env.worked_episode(call(example, reference), f"A:{answer}")
