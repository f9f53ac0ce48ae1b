"""Shape rewards: the `<think>…</think>`-then-answer format, and DAPO's soft over-length penalty."""

from __future__ import annotations

import re

import numpy as np
from jaxtyping import Float, Int

# One reasoning block at the very start (no nested or second <think>), then a non-empty answer.
_THINK_THEN_ANSWER = re.compile(r"\s*<think>(?P<think>(?:(?!</?think>).)+?)</think>(?P<answer>.*)", re.DOTALL)
_ANSWER_TAG = re.compile(r"\s*<answer>(?P<content>(?:(?!</?answer>).)+?)</answer>\s*", re.DOTALL)
_THINK_TAG = re.compile(r"</?think>")


def format_reward(text: str, *, answer_tag: bool = False) -> float:
    """1.0 when `text` is `<think>R</think>A`, else 0.0.

    R is non-blank reasoning; A, after the closing tag, is a non-blank answer containing no further think
    tag. With `answer_tag=True`, A must be exactly `<answer>X</answer>` (X non-blank, surrounding whitespace
    allowed). Leading whitespace before `<think>` is allowed.
    """
    match = _THINK_THEN_ANSWER.fullmatch(text)
    if match is None or not match["think"].strip():
        return 0.0
    answer = match["answer"]
    if _THINK_TAG.search(answer) or not answer.strip():
        return 0.0
    if answer_tag:
        tagged = _ANSWER_TAG.fullmatch(answer)
        if tagged is None or not tagged["content"].strip():
            return 0.0
    return 1.0


def overlong_penalty(lengths: Int[np.ndarray, "b"], *, max_length: int, cache_length: int) -> Float[np.ndarray, "b"]:
    """DAPO's soft over-length punishment (Yu et al. 2025, eq. 13), added to the task reward.

    With L = `lengths` (response tokens), L_max = `max_length`, L_cache = `cache_length`:

        R(L) = 0                                   if L <= L_max - L_cache
        R(L) = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        R(L) = -1                                  if L > L_max

    so the penalty ramps linearly from 0 to -1 over the last L_cache tokens of the budget.
    """
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"overlong_penalty: max_length must be a positive integer, got {max_length!r}")
    if not isinstance(cache_length, int) or not 0 < cache_length <= max_length:
        raise ValueError(
            f"overlong_penalty: cache_length must be an integer in [1, max_length={max_length}], got {cache_length!r}"
        )
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
        raise ValueError(f"overlong_penalty: lengths must be a 1-D array of non-negative integers, got {lengths!r}")
    free = max_length - cache_length
    ramp = (free - lengths) / cache_length
    penalty = np.where(lengths <= free, 0.0, np.where(lengths <= max_length, ramp, -1.0))
    return penalty.astype(np.float32)
