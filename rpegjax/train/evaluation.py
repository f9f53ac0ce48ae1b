"""Held-out evaluation: greedy accuracy and pass@k of a policy on evaluation examples, checked by the task's
verifier. A run with a tool environment is evaluated as it trains: each answer is an episode (model turns and
tool calls, `rpegjax.envs.rollout`), judged on its last model turn (or by the environment's reward, >= 1 correct)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from rpegjax.data.example import Example
from rpegjax.envs.rollout import EpisodeRunner
from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Answer:
    """One completion of one evaluation example and the verifier's verdict."""

    example: Example
    response: str
    correct: bool
    finish_reason: str


def _verdict(is_correct: Callable[[str, Example], bool], text: str, example: Example) -> bool:
    try:
        return bool(is_correct(text, example))
    except Exception:  # a verifier failing on odd output counts as wrong, as in training
        return False


def generate_answers(
    sampler: Sampler,
    params: Any,
    examples: Sequence[Example],
    prompt_ids: Sequence[Sequence[int]],
    *,
    is_correct: Callable[[str, Example], bool],
    decode: Callable[[Sequence[int]], str],
    sampling: SamplingConfig,
    samples_per_example: int = 1,
    seed: int = 0,
    episodes: EpisodeRunner | None = None,
) -> list[list[Answer]]:
    """`samples_per_example` completions of every example (outer list in the order of `examples`), verified.
    With `episodes` (the run's multi-turn driver) every completion is an episode decoded with `sampling`: its
    response is the whole transcript (turns and tool output), its verdict the last model turn's."""
    key = jax.random.key(seed)
    answers: list[list[Answer]] = [[] for _ in examples]
    if episodes is not None:
        finished = episodes.with_sampling(sampling).run(params, examples, group_size=samples_per_example, key=key)
        for episode in sorted(finished, key=lambda e: e.completion.order):
            completion, example = episode.completion, examples[episode.completion.prompt_index]
            correct = (episode.reward >= 1.0 if episode.reward is not None
                       else _verdict(is_correct, episode.final_text, example))
            answers[completion.prompt_index].append(
                Answer(example, decode(completion.response_ids), correct, str(episode.finish)))
        return answers
    completions = sampler.generate(params, prompt_ids, sampling, group_size=samples_per_example, key=key)
    for completion in sorted(completions, key=lambda c: c.order):
        example = examples[completion.prompt_index]
        text = decode(completion.response_ids)
        answers[completion.prompt_index].append(
            Answer(example, text, _verdict(is_correct, text, example), str(completion.finish_reason)))
    return answers


def evaluate_accuracy(
    sampler: Sampler,
    params: Any,
    examples: Sequence[Example],
    prompt_ids: Sequence[Sequence[int]],
    *,
    is_correct: Callable[[str, Example], bool],
    decode: Callable[[Sequence[int]], str],
    max_new_tokens: int,
    episodes: EpisodeRunner | None = None,
) -> tuple[float, list[Answer]]:
    """Fraction of `examples` whose greedy completion (or episode) verifies, and the answer to each example."""
    answers = generate_answers(sampler, params, examples, prompt_ids, is_correct=is_correct, decode=decode,
                               sampling=SamplingConfig(max_new_tokens=max_new_tokens, greedy=True), episodes=episodes)
    flat = [group[0] for group in answers]
    return sum(a.correct for a in flat) / max(len(flat), 1), flat


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from `samples` >= k completions of which `correct` verify (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), the probability that
    at least one of k completions drawn without replacement from the n is correct."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@k needs 1 <= k <= samples, got k={k}, samples={samples}")
    if not 0 <= correct <= samples:
        raise ValueError(f"pass@k: correct={correct} is outside [0, samples={samples}]")
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def mean_pass_at_k(answers: Sequence[Sequence[Answer]], ks: Sequence[int]) -> dict[int, float]:
    """pass@k averaged over examples, for each k in `ks` (every example needs at least max(ks) answers)."""
    return {k: sum(pass_at_k(len(group), sum(a.correct for a in group), k) for group in answers) / max(len(answers), 1)
            for k in ks}
