"""Math answer verification with Hugging Face `math-verify`.

Gold answers are parsed once, when a dataset is loaded (`check_gold_answer`): an answer that math-verify
cannot parse is a `DatasetError` on that row, never a reward of 1. Completions are parsed by math-verify's
LaTeX extractor (with `\\boxed{}`) and its plain-expression extractor (numbers, `1/2`, GSM8K's `#### n`),
then compared symbolically and numerically, so `1/2`, `0.5` and `\\frac{1}{2}` agree. Nothing here calls
`eval`: math-verify's plain-expression path hands SymPy only strings made of digits and `+-*/^()`, and
whatever SymPy then computes (e.g. `9^{9^{9}}`) is bounded by the reward runner's timeout, which kills the
worker process (`rpegjax.rewards.runner`).

math-verify's own timeouts use `signal.alarm`, which works only in a process's main thread; a runner's
worker process calls reward functions from its main thread, so they are enabled there and disabled (None)
anywhere else, where the runner's timeout is the only bound.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rpegjax.data.example import DatasetError, Example

# The gold is wrapped in \boxed{} and boxed content is read first, so a gold such as "72" or "\frac{1}{2}"
# is parsed the same whether or not it carries LaTeX delimiters.
_GOLD_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_PREDICTION_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def _signal_timeout(seconds: int) -> int | None:
    """math-verify's signal-based timeout when it can work (main thread), else None (see module docstring)."""
    return seconds if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def parse_gold_answer(answer: str, timeout_s: int = 5) -> tuple:
    """math-verify's parse of a gold answer (cached: a group of samples shares its gold).

    Raises `ValueError` when nothing parses (an empty list from math-verify, or a timeout).
    """
    parsed = parse(
        f"\\boxed{{{answer}}}",
        extraction_config=_GOLD_EXTRACTION,
        fallback_mode="no_fallback",
        parsing_timeout=_signal_timeout(timeout_s),
    )
    if not parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    return tuple(parsed)


_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname)\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


def check_gold_answer(example: Example) -> None:
    """Raise `DatasetError` naming the row when the example's gold answer does not parse, is bare text
    (math-verify would read `hello` as the product E*h*l*l*o and `nan` as n*a*n, so such a gold could only
    ever match nonsense) or is not a number where it looks like one (NaN). Text answers are fine inside
    `\\text{...}`, as MATH writes them."""
    where = example.where()
    try:
        parsed = parse_gold_answer(example.answer)
    except ValueError as error:
        raise DatasetError(f"{where}: {error}") from None
    bare = _COMMAND.sub(" ", _TEXT_COMMANDS.sub(" ", example.answer))
    word = _WORD.search(bare)
    if word is not None and word.group().lower() in ("nan", "inf", "infinity"):
        raise DatasetError(f"{where}: the gold answer {example.answer!r} is not a finite number")
    if word is not None:
        raise DatasetError(f"{where}: the gold answer {example.answer!r} is text ({word.group()!r}), which math-verify "
                           f"reads as {parsed[0]} (a product of letters); put text answers in \\text{{...}}")
    if str(parsed[0]) in ("nan", "zoo"):
        raise DatasetError(f"{where}: the gold answer {example.answer!r} is not a number ({parsed[0]})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathVerifier:
    """Reward 1.0 when math-verify finds the completion's answer equal to the gold answer, else 0.0.

    `timeout_s` bounds each of math-verify's parse and compare steps where its signal timeouts work (a
    process's main thread); it is an inner bound, the reward runner's timeout is the outer one.
    A gold answer that does not parse raises `DatasetError` (counted as an error by the runner, reward 0).
    """

    timeout_s: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ValueError(f"MathVerifier.timeout_s must be a positive integer of seconds, got {self.timeout_s!r}")

    def is_correct(self, text: str, example: Example) -> bool:
        try:
            gold = parse_gold_answer(example.answer, self.timeout_s)
        except ValueError as error:
            raise DatasetError(f"{example.where()}: {error}") from None
        timeout = _signal_timeout(self.timeout_s)
        predicted = parse(text, extraction_config=_PREDICTION_EXTRACTION, parsing_timeout=timeout)
        return bool(predicted) and verify(list(gold), predicted, timeout_seconds=timeout)

    def __call__(self, text: str, example: Example) -> float:
        return 1.0 if self.is_correct(text, example) else 0.0


math_reward = MathVerifier()
