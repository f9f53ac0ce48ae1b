"""A tiny safe parser for integer arithmetic: `+ - * /`, parentheses, exact rational values.

Used to verify Countdown answers without `eval`: the grammar has no names, no calls, no attribute access
and no power operator, so `__import__('os')` or `9**9**9` are syntax errors, not computations. Values are
`fractions.Fraction` (exact; `/` is true division, and dividing by zero is an error). Sizes are bounded so
a hostile string cannot make parsing slow: at most `MAX_CHARS` characters, `MAX_DIGITS` digits per
literal and `MAX_DEPTH` nested parentheses.

Grammar (whitespace between tokens is ignored):

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

MAX_CHARS = 256
MAX_DIGITS = 12
MAX_DEPTH = 16
_DIGITS = frozenset("0123456789")

_TOKEN = re.compile(r"\s*(?:(?P<number>[0-9]+)|(?P<op>[-+*/()]))", re.ASCII)


class ExpressionError(ValueError):
    """The string is not a well-formed arithmetic expression of this grammar (or is too large)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedExpression:
    """An expression's exact value and the integer literals it uses, in order of appearance."""

    value: Fraction
    numbers: tuple[int, ...]


def _tokenize(text: str) -> list[str]:
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters ({len(text)})")
    tokens, position = [], 0
    end = len(text.rstrip())
    while position < end:
        match = _TOKEN.match(text, position)
        if match is None:
            raise ExpressionError(f"unexpected character {text[position:].lstrip()[:1]!r} at {position} in {text!r}")
        number = match["number"]
        if number is not None and len(number) > MAX_DIGITS:
            raise ExpressionError(f"number with more than {MAX_DIGITS} digits in {text!r}")
        tokens.append(number if number is not None else match["op"])
        position = match.end()
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


class _Parser:
    """Recursive descent over the token list; `numbers` collects literals as they are read."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.position, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("expression ends too early")
        self.position += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = value + self.term(depth) if self.take() == "+" else value - self.term(depth)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            operator, right = self.take(), self.factor(depth)
            if operator == "*":
                value = value * right
            elif right == 0:
                raise ExpressionError("division by zero")
            else:
                value = value / right
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.take()
        if token[0] in _DIGITS:
            self.numbers.append(int(token))
            return Fraction(int(token))
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"more than {MAX_DEPTH} nested parentheses")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("expected ')'")
            return value
        raise ExpressionError(f"expected a number or '(' but found {token!r}")


def parse_expression(text: str) -> ParsedExpression:
    """Parse and evaluate `text` exactly; raise `ExpressionError` if it is not in the grammar."""
    parser = _Parser(_tokenize(text))
    value = parser.expr(depth=0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression in {text!r}")
    return ParsedExpression(value=value, numbers=tuple(parser.numbers))
