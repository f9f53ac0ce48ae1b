"""What the sampler hands out: one finished sequence (`Completion`) and a padded batch of them."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np


class FinishReason(enum.StrEnum):
    EOS = "eos"  # sampled the end-of-sequence token (kept as the last response token)
    STOP = "stop"  # sampled one of SamplingConfig.stop_ids (kept as the last response token)
    LENGTH = "length"  # reached its budget of new tokens
    PARTIAL = "partial"  # still running when the call was interrupted (`interrupt`): a prefix, continued later


# Codes used on device (0 = still running).
FINISH_CODES: dict[int, FinishReason] = {1: FinishReason.EOS, 2: FinishReason.STOP, 3: FinishReason.LENGTH}
RUNNING_CODE = 0
EOS_CODE, STOP_CODE, LENGTH_CODE = 1, 2, 3


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Completion:
    """One sampled response.

    `behaviour_logprobs[i]` is log pi(response_ids[i] | prompt, response_ids[:i]) under the
    temperature-scaled, unfiltered distribution of the weights of `version` (see `sample_tokens`).
    A multi-turn episode (`rpegjax.envs.rollout`) interleaves the model's turns with tool output:
    `model_mask[i]` is False at a tool token (its log-prob is 0 and it gets no loss); None: every token was sampled.
    `token_versions[i]` is the weights version that sampled token i when a sequence was continued over several
    versions (partial rollouts, `rpegjax.runtime.partial_rollouts`); None: every token was sampled by `version`.
    `expert_ids[i]` (a sampler that records routing, `Sampler(record_routing=True)`): the experts each sparse layer
    of a mixture-of-experts model chose for token i of prompt + response, [s + length, sparse layers, k]; -1 where
    none was computed (the last response token, which no pass feeds). None: not recorded.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: np.ndarray  # int32 [s]
    response_ids: np.ndarray  # int32 [length]
    behaviour_logprobs: np.ndarray  # float32 [length]
    finish_reason: FinishReason
    version: int | None = None
    model_mask: np.ndarray | None = None  # bool [length]
    token_versions: np.ndarray | None = None  # int64 [length]
    expert_ids: np.ndarray | None = None  # int16 [s + length, sparse layers, k]

    def __post_init__(self) -> None:
        if self.response_ids.shape != self.behaviour_logprobs.shape:
            raise ValueError(
                f"Completion(prompt {self.prompt_index}, sample {self.sample_index}): response_ids "
                f"{self.response_ids.shape} and behaviour_logprobs {self.behaviour_logprobs.shape} differ in shape"
            )
        if self.model_mask is not None and (self.model_mask.shape != self.response_ids.shape
                                            or self.model_mask.dtype != bool):
            raise ValueError(
                f"Completion(prompt {self.prompt_index}, sample {self.sample_index}): model_mask must be bool of shape "
                f"{self.response_ids.shape}, got {self.model_mask.dtype} {self.model_mask.shape}"
            )
        if self.token_versions is not None and self.token_versions.shape != self.response_ids.shape:
            raise ValueError(
                f"Completion(prompt {self.prompt_index}, sample {self.sample_index}): token_versions must have shape "
                f"{self.response_ids.shape}, got {self.token_versions.shape}"
            )
        tokens = self.prompt_ids.shape[0] + self.response_ids.shape[0]
        if self.expert_ids is not None and (self.expert_ids.ndim != 3 or self.expert_ids.shape[0] != tokens):
            raise ValueError(
                f"Completion(prompt {self.prompt_index}, sample {self.sample_index}): expert_ids must be [{tokens} "
                f"tokens, sparse layers, k], got {self.expert_ids.shape}"
            )

    @property
    def loss_mask(self) -> np.ndarray:
        """bool [length]: the response tokens the losses count (the model's, not a tool's)."""
        return np.ones(self.response_ids.shape, bool) if self.model_mask is None else self.model_mask

    def versions(self) -> np.ndarray:
        """int64 [length]: the weights version that sampled each response token (-1 where unknown)."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(self.response_ids.shape, -1 if self.version is None else self.version, np.int64)

    @property
    def length(self) -> int:
        """Number of response tokens."""
        return int(self.response_ids.shape[0])

    @property
    def order(self) -> tuple[int, int]:
        return (self.prompt_index, self.sample_index)


def unstarted(prompt_index: int, sample_index: int, prompt_ids: np.ndarray, version: int | None) -> Completion:
    """A sequence an interrupted call never started (or preempted back to its prompt): no tokens, `PARTIAL`."""
    return Completion(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=prompt_ids.copy(),
                      response_ids=np.zeros((0,), np.int32), behaviour_logprobs=np.zeros((0,), np.float32),
                      finish_reason=FinishReason.PARTIAL, version=version)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CompletionBatch:
    """Completions right-padded into arrays, aligned with `rpegjax.models.logprobs.token_logprobs`.

    tokens[b, :] = prompt + response + padding; `attention_mask` marks real tokens. Column i of
    `response_mask` and `behaviour_logprobs` refers to the token at i + 1 (the one that position i
    predicts), exactly like `token_logprobs(model, tokens)[:, i]`; tool tokens of an episode are not in it.
    """

    tokens: np.ndarray  # int32 [b, t]
    attention_mask: np.ndarray  # bool [b, t]
    response_mask: np.ndarray  # bool [b, t]
    behaviour_logprobs: np.ndarray  # float32 [b, t]
    prompt_index: np.ndarray  # int32 [b]
    sample_index: np.ndarray  # int32 [b]
    versions: np.ndarray  # int64 [b], -1 where unknown


def stack_completions(completions: Sequence[Completion], *, pad_id: int = 0, length: int | None = None) -> CompletionBatch:
    """Pads completions into a `CompletionBatch` of `length` columns (default: the longest sequence)."""
    if not completions:
        raise ValueError("stack_completions needs at least one completion, got none")
    longest = max(c.prompt_ids.shape[0] + c.length for c in completions)
    width = longest if length is None else length
    if width < longest:
        raise ValueError(f"stack_completions: length={length} is shorter than the longest sequence ({longest} tokens)")
    b = len(completions)
    tokens = np.full((b, width), pad_id, np.int32)
    attention = np.zeros((b, width), bool)
    response = np.zeros((b, width), bool)
    logprobs = np.zeros((b, width), np.float32)
    for row, c in enumerate(completions):
        s, n = c.prompt_ids.shape[0], c.length
        tokens[row, :s] = c.prompt_ids
        tokens[row, s:s + n] = c.response_ids
        attention[row, :s + n] = True
        response[row, s - 1:s - 1 + n] = c.loss_mask
        logprobs[row, s - 1:s - 1 + n] = c.behaviour_logprobs
    return CompletionBatch(
        tokens=tokens,
        attention_mask=attention,
        response_mask=response,
        behaviour_logprobs=logprobs,
        prompt_index=np.array([c.prompt_index for c in completions], np.int32),
        sample_index=np.array([c.sample_index for c in completions], np.int32),
        versions=np.array([-1 if c.version is None else c.version for c in completions], np.int64),
    )
