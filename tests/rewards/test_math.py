"""math-verify rewards: equivalent forms, wrong answers, GSM8K and boxed golds, unparsable golds."""

import os

import pytest

from rpegjax.data.answers import extract_boxed, extract_gsm8k_answer
from rpegjax.data.example import DatasetError, Example
from rpegjax.rewards.math import MathVerifier, check_gold_answer, math_reward


def example(answer: str, source: str = "") -> Example:
    return Example(id="row", prompt="What is it?", answer=answer, task="math", source=source)


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{\\frac{1}{2}}",
        "The answer is 0.5",
        "1/2",
        "So the result is \\boxed{2/4}.",
        "#### 0.5",
        "The answer is $\\frac{1}{2}$.",
        "\\boxed{\\dfrac{1}{2}}",
        "\\boxed{0.5}",
    ],
)
def test_equivalent_forms_of_one_half_score_one(completion):
    assert math_reward(completion, example("1/2")) == 1.0
    assert math_reward(completion, example("\\frac{1}{2}")) == 1.0
    assert math_reward(completion, example("0.5")) == 1.0


@pytest.mark.parametrize(
    "completion", ["\\boxed{1/3}", "0.51", "", "no answer here", "1/2 or 1/3", "\\boxed{-1/2}", "\\boxed{2}"]
)
def test_wrong_or_missing_answers_score_zero(completion):
    assert math_reward(completion, example("1/2")) == 0.0


def test_gsm8k_gold_and_predictions():
    solution = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    assert extract_gsm8k_answer(solution) == "72"
    assert extract_gsm8k_answer("lots of work\n#### 1,234,567") == "1234567"
    gold = example("1234")
    for completion in ["#### 1234", "#### 1,234", "The answer is 1,234.", "\\boxed{1234}"]:
        assert math_reward(completion, gold) == 1.0, completion
    for completion in ["#### 1233", "#### 12345", "1,2,3,4"]:
        assert math_reward(completion, gold) == 0.0, completion
    # The reference solution itself verifies against its own extracted answer.
    assert math_reward(solution, example(extract_gsm8k_answer(solution))) == 1.0
    with pytest.raises(ValueError, match="####"):
        extract_gsm8k_answer("no marker")
    with pytest.raises(ValueError, match="nothing after"):
        extract_gsm8k_answer("marker but nothing ####  ")


def test_boxed_extraction_takes_the_last_balanced_box():
    solution = "First $\\boxed{1}$, then finally \\boxed{\\frac{\\sqrt{3}}{2}} is it."
    assert extract_boxed(solution) == "\\frac{\\sqrt{3}}{2}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert math_reward("\\boxed{\\frac{\\sqrt3}{2}}", example(extract_boxed(solution))) == 1.0
    assert math_reward("\\boxed{0.8660254}", example("\\frac{\\sqrt{3}}{2}")) == 1.0
    assert math_reward("\\boxed{(1,2)}", example("(1,2)")) == 1.0
    assert math_reward("\\boxed{(2,1)}", example("(1,2)")) == 0.0
    for bad, message in [("no box", "no \\\\boxed"), ("\\boxed{1", "unbalanced"), ("\\boxed{ }", "empty")]:
        with pytest.raises(ValueError, match=message):
            extract_boxed(bad)


@pytest.mark.parametrize("gold", ["", "{", "\\frac{", "}}"])
def test_unparsable_gold_is_an_error_never_a_reward(gold):
    bad = example(gold, source="data/train.jsonl:17")
    with pytest.raises(DatasetError, match=r"data/train\.jsonl:17: math-verify cannot parse the gold answer"):
        check_gold_answer(bad)
    # Even a completion identical to the gold text cannot earn reward 1: the verifier raises.
    with pytest.raises(DatasetError, match="train.jsonl:17"):
        math_reward(gold, bad)


def test_model_output_is_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    attack = f"__import__('os').system('touch {marker}')"
    assert math_reward(attack, example("0")) == 0.0
    assert math_reward(f"\\boxed{{{attack}}}", example("0")) == 0.0
    assert not os.path.exists(marker)


def test_verifier_config_is_validated():
    with pytest.raises(ValueError, match="MathVerifier.timeout_s"):
        MathVerifier(timeout_s=0)
    with pytest.raises(ValueError, match="MathVerifier.timeout_s"):
        MathVerifier(timeout_s=1.5)


@pytest.mark.parametrize("answer, message", [
    ("hello", r"the gold answer 'hello' is text \('hello'\), which math-verify reads as E\*h\*l\*l\*o"),
    ("nan", "the gold answer 'nan' is not a finite number"),
    ("NaN", "the gold answer 'NaN' is not a finite number"),
    ("0/0", r"the gold answer '0/0' is not a number \(nan\)"),
])
def test_text_and_nan_gold_answers_are_refused_naming_the_row(answer, message):
    from rpegjax.data.example import DatasetError
    from rpegjax.rewards.math import check_gold_answer

    with pytest.raises(DatasetError, match=f"data.jsonl:3: {message}"):
        check_gold_answer(Example(id="1", prompt="q", answer=answer, task="math", source="data.jsonl:3"))
    for fine in ("x+1", "\\text{Evelyn}", "5\\text{ cm}", "\\infty", "\\frac{1}{2}", "-3.5"):
        check_gold_answer(Example(id="1", prompt="q", answer=fine, task="math"))
