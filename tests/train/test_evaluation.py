"""pass@k against brute force over every k-subset of the samples."""

import itertools

import numpy as np
import pytest

from rpegjax.data.example import Example
from rpegjax.train.evaluation import Answer, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("samples, correct", [(5, 0), (5, 1), (5, 3), (6, 6), (4, 2)])
def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_correct_sample(samples, correct):
    verdicts = [True] * correct + [False] * (samples - correct)
    for k in range(1, samples + 1):
        subsets = list(itertools.combinations(verdicts, k))
        expected = sum(any(subset) for subset in subsets) / len(subsets)
        assert pass_at_k(samples, correct, k) == pytest.approx(expected, abs=1e-12)


def test_mean_pass_at_k_averages_over_problems_and_checks_its_arguments():
    example = Example(id="0", prompt="p", answer="1", task="t")
    groups = [[Answer(example, "x", c, "eos") for c in verdicts] for verdicts in ([True, False], [False, False])]
    assert mean_pass_at_k(groups, [1, 2]) == {1: pytest.approx(0.25), 2: pytest.approx(0.5)}
    assert np.isclose(pass_at_k(3, 1, 1), 1 / 3)
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="outside"):
        pass_at_k(2, 3, 1)
