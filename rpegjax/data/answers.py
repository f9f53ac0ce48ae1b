"""Gold answers as datasets write them: GSM8K's `#### n` and MATH's last `\\boxed{}`.

Pure string parsing; whether the answer means something is the verifier's business (`rpegjax.rewards.math`).
"""

from __future__ import annotations

import re

_GSM8K_MARKER = "####"
_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def extract_gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after its last `####`, thousands commas removed.

    Raises `ValueError` when there is no `####` or nothing follows it.
    """
    if _GSM8K_MARKER not in solution:
        raise ValueError(f"no {_GSM8K_MARKER!r} answer marker in GSM8K solution {solution[-80:]!r}")
    answer = _THOUSANDS.sub("", solution.rsplit(_GSM8K_MARKER, 1)[1].strip())
    if not answer:
        raise ValueError(f"nothing after the {_GSM8K_MARKER!r} answer marker in {solution[-80:]!r}")
    return answer


def extract_boxed(text: str) -> str:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

    Raises `ValueError` when there is none or its braces do not close.
    """
    start = max(text.rfind(command + "{") for command in _BOXED_COMMANDS)
    if start < 0:
        raise ValueError(f"no \\boxed{{...}} in {text[-80:]!r}")
    open_brace = text.index("{", start)
    depth = 0
    for position in range(open_brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                content = text[open_brace + 1 : position].strip()
                if not content:
                    raise ValueError(f"empty \\boxed{{}} in {text[-80:]!r}")
                return content
    raise ValueError(f"unbalanced braces in \\boxed{{...}} of {text[-80:]!r}")
