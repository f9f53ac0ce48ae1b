"""Format reward cases and DAPO's over-length penalty against its piecewise formula."""

import numpy as np
import pytest

from rpegjax.rewards.format import format_reward, overlong_penalty


@pytest.mark.parametrize(
    "text",
    [
        "<think>2+2 is 4</think>The answer is 4.",
        "  \n<think>\nmulti\nline\n</think>\n\\boxed{4}",
        "<think>a < b</think> 4",
    ],
)
def test_well_formed_scores_one(text):
    assert format_reward(text) == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",  # no think block
        "<think>reasoning</think>",  # no answer
        "<think>reasoning</think>   \n",  # blank answer
        "<think>  </think>4",  # blank reasoning
        "<think>unclosed 4",
        "4 <think>late</think> 4",  # think block not first
        "<think>a</think><think>b</think>4",  # a second block
        "<think>a<think>b</think>c</think>4",  # nested
        "<think>a</think>4</think>",  # stray closing tag in the answer
        "",
    ],
)
def test_malformed_scores_zero(text):
    assert format_reward(text) == 0.0


def test_answer_tag_variant():
    assert format_reward("<think>r</think><answer>4</answer>", answer_tag=True) == 1.0
    assert format_reward("<think>r</think>\n<answer> 4 </answer>\n", answer_tag=True) == 1.0
    assert format_reward("<think>r</think>4", answer_tag=True) == 0.0
    assert format_reward("<think>r</think><answer> </answer>", answer_tag=True) == 0.0
    assert format_reward("<think>r</think><answer>4</answer> extra", answer_tag=True) == 0.0


def test_overlong_penalty_matches_the_formula():
    max_length, cache_length = 20, 8
    lengths = np.arange(0, 30)
    expected = []
    for length in lengths:  # DAPO eq. 13, written out case by case
        if length <= max_length - cache_length:
            expected.append(0.0)
        elif length <= max_length:
            expected.append(((max_length - cache_length) - length) / cache_length)
        else:
            expected.append(-1.0)
    penalty = overlong_penalty(lengths, max_length=max_length, cache_length=cache_length)
    assert penalty.dtype == np.float32 and penalty.shape == lengths.shape
    np.testing.assert_allclose(penalty, expected, rtol=0, atol=1e-7)
    # Anchors: free up to 12, -1/8 at 13, exactly -1 at the budget, -1 beyond it.
    assert penalty[12] == 0.0 and penalty[13] == pytest.approx(-1 / 8) and penalty[20] == -1.0 and penalty[29] == -1.0


def test_overlong_penalty_validates_arguments():
    with pytest.raises(ValueError, match="max_length"):
        overlong_penalty(np.array([1]), max_length=0, cache_length=1)
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(np.array([1]), max_length=10, cache_length=11)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(np.array([1.5]), max_length=10, cache_length=2)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(np.array([-1]), max_length=10, cache_length=2)
