"""rpegjax.runtime.carry_arrays: the groups in flight of partial rollouts as fixed-shape arrays (what crosses
between process groups) round-trip exactly, and what does not fit the planned shapes is refused by name."""

import numpy as np
import pytest

from rpegjax.generate.completion import FinishReason
from rpegjax.runtime.carry_arrays import carry_arrays, carry_like, carry_snapshot


def _snapshot() -> dict:
    """Two groups of 2: one untouched, one with a finished and a running sample over two versions."""
    logprobs = np.random.default_rng(0).normal(size=5).astype(np.float32)
    return {"groups": [
        {"example": 7, "prompt": [3, 4, 5], "samples": [
            {"tokens": [], "logprobs": [], "versions": [], "finish": None}] * 2},
        {"example": 2, "prompt": [9], "samples": [
            {"tokens": [1, 2, 3], "logprobs": logprobs[:3].tolist(), "versions": [4, 4, 5],
             "finish": FinishReason.STOP.value},
            {"tokens": [6, 8], "logprobs": logprobs[3:].tolist(), "versions": [5, 6], "finish": None}]}]}


def test_a_snapshot_round_trips_exactly_through_the_planned_shapes():
    snapshot = _snapshot()
    arrays = carry_arrays(snapshot, groups=4, samples=2, length=8)
    like = carry_like(4, 2, 8)
    assert {name: (a.shape, a.dtype) for name, a in arrays.items()} == {
        name: (s.shape, s.dtype) for name, s in like.items()}
    assert carry_snapshot(arrays) == snapshot  # float32 log-probs exactly, finish reasons by value
    assert carry_snapshot(carry_arrays({"groups": []}, 4, 2, 8)) == {"groups": []}


def test_what_does_not_fit_is_refused():
    snapshot = _snapshot()
    with pytest.raises(ValueError, match="2 groups in flight do not fit the 1 planned"):
        carry_arrays(snapshot, groups=1, samples=2, length=8)
    with pytest.raises(ValueError, match="does not fit groups of 3 samples"):
        carry_arrays(snapshot, groups=4, samples=3, length=8)
    with pytest.raises(ValueError, match="a carried sample of 3 tokens exceeds rows of 2"):
        carry_arrays({"groups": snapshot["groups"][1:]}, groups=4, samples=2, length=2)
