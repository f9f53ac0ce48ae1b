"""The groups partial rollouts carry between steps (`PartialRollouts.snapshot`) as arrays of fixed shapes, so that
they can cross between the generation and the training processes of a run over process groups
(`rpegjax.runtime.roles`): a transfer moves arrays whose shapes both sides planned in advance, never a record of
varying size. Every value round-trips exactly (tokens and versions as int32, log-probs as float32, as the
snapshot holds them).

For `groups` groups of `samples` samples and rows of `length` tokens:
- `groups`  int32 [groups, 2]: each group's example index (-1: an unused row) and prompt length;
- `prompts` int32 [groups, length]: its prompt;
- `samples` int32 [groups * samples, 2]: each sample's response length so far and finish (an index into
  `FinishReason`, -1: still decoding);
- `tokens`, `versions` int32 and `logprobs` float32 [groups * samples, length]: its tokens, the weights version
  that sampled each and its log-prob.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rpegjax.generate.completion import FinishReason

__all__ = ["carry_arrays", "carry_like", "carry_snapshot"]

_FINISH = [reason.value for reason in FinishReason]


def carry_like(groups: int, samples: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of the arrays of up to `groups` groups of `samples` samples, rows of `length` tokens."""
    rows = groups * samples
    return {"groups": jax.ShapeDtypeStruct((groups, 2), np.int32),
            "prompts": jax.ShapeDtypeStruct((groups, length), np.int32),
            "samples": jax.ShapeDtypeStruct((rows, 2), np.int32),
            "tokens": jax.ShapeDtypeStruct((rows, length), np.int32),
            "versions": jax.ShapeDtypeStruct((rows, length), np.int32),
            "logprobs": jax.ShapeDtypeStruct((rows, length), np.float32)}


def carry_arrays(snapshot: dict[str, Any], groups: int, samples: int, length: int) -> dict[str, np.ndarray]:
    """`snapshot` (`PartialRollouts.snapshot`) as the arrays of `carry_like(groups, samples, length)`. Raises
    ValueError naming what does not fit (more groups, other group sizes or longer rows than planned)."""
    arrays = {name: np.zeros(like.shape, like.dtype) for name, like in carry_like(groups, samples, length).items()}
    arrays["groups"][:, 0] = -1
    carried = snapshot["groups"]
    if len(carried) > groups:
        raise ValueError(f"partial rollouts: {len(carried)} groups in flight do not fit the {groups} planned for "
                         "the transfer between process groups (was the run saved with more rollout.inflight_batches?)")
    for g, group in enumerate(carried):
        prompt = group["prompt"]
        if len(group["samples"]) != samples or len(prompt) > length:
            raise ValueError(f"partial rollouts: a carried group of {len(group['samples'])} samples and a "
                             f"{len(prompt)}-token prompt does not fit groups of {samples} samples, rows of {length}")
        arrays["groups"][g] = (group["example"], len(prompt))
        arrays["prompts"][g, :len(prompt)] = prompt
        for j, sample in enumerate(group["samples"]):
            row, size = g * samples + j, len(sample["tokens"])
            if size > length:
                raise ValueError(f"partial rollouts: a carried sample of {size} tokens exceeds rows of {length}")
            finish = -1 if sample["finish"] is None else _FINISH.index(sample["finish"])
            arrays["samples"][row] = (size, finish)
            for name in ("tokens", "versions", "logprobs"):
                arrays[name][row, :size] = sample[name]
    return arrays


def carry_snapshot(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The snapshot held by `arrays` (`carry_arrays`), as `PartialRollouts.snapshot` made it."""
    samples = arrays["samples"].shape[0] // arrays["groups"].shape[0]
    carried = []
    for g, (example, prompt) in enumerate(np.asarray(arrays["groups"]).tolist()):
        if example < 0:
            continue
        rows = []
        for row in range(g * samples, (g + 1) * samples):
            size, finish = np.asarray(arrays["samples"][row]).tolist()
            rows.append({"tokens": arrays["tokens"][row, :size].tolist(),
                         "logprobs": arrays["logprobs"][row, :size].tolist(),
                         "versions": arrays["versions"][row, :size].tolist(),
                         "finish": None if finish < 0 else _FINISH[finish]})
        carried.append({"example": example, "prompt": arrays["prompts"][g, :prompt].tolist(), "samples": rows})
    return {"groups": carried}
