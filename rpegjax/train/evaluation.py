"""Held-out accuracy: greedy answers to evaluation examples, checked by the task's verifier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from rpegjax.data.example import Example
from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig


def evaluate_accuracy(
    sampler: Sampler,
    params: Any,
    examples: Sequence[Example],
    prompt_ids: Sequence[Sequence[int]],
    *,
    is_correct: Callable[[str, Example], bool],
    decode: Callable[[Sequence[int]], str],
    max_new_tokens: int,
) -> tuple[float, list[tuple[str, str, bool]]]:
    """Fraction of `examples` whose greedy completion verifies, and (prompt, completion, correct) per example."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, greedy=True)
    completions = sampler.generate(params, prompt_ids, sampling, group_size=1, key=jax.random.key(0))
    results = []
    for example, completion in zip(examples, completions):
        text = decode(completion.response_ids)
        try:
            correct = bool(is_correct(text, example))
        except Exception:  # a verifier failing on odd output counts as wrong, as in training
            correct = False
        results.append((example.prompt, text, correct))
    accuracy = sum(r[2] for r in results) / max(len(results), 1)
    return accuracy, results
