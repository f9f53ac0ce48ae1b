"""JSONL loading: the three row styles, format detection, and every kind of malformed row by file:line."""

import json

import pytest

from rpegjax.data.example import SOLUTION_KEY, DatasetError
from rpegjax.data.jsonl import DatasetFormat, load_jsonl
from rpegjax.rewards.math import check_gold_answer, math_reward

GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A big sum?", "answer": "It is large.\n#### 1,234"},
]
MATH_ROWS = [
    {"problem": "Compute $\\sin 60^\\circ$.", "solution": "It is $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "id": "m1"},
    {"problem": "Half of one?", "solution": "First $\\boxed{1}$... no: $\\boxed{\\frac{1}{2}}$."},
]
PLAIN_ROWS = [{"prompt": "1/4 + 1/4 = ?", "answer": "1/2"}, {"prompt": "2+2?", "answer": 4}]


def write(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path


def test_gsm8k_rows(tmp_path):
    path = write(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    examples = load_jsonl(path)
    assert [e.answer for e in examples] == ["72", "1234"]
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:2"]
    assert [e.id for e in examples] == ["gsm8k.jsonl:1", "gsm8k.jsonl:2"]
    assert examples[0].prompt == GSM8K_ROWS[0]["question"] and examples[0].task == "math"
    assert examples[0].meta_value(SOLUTION_KEY) == GSM8K_ROWS[0]["answer"]
    assert load_jsonl(path, dataset_format="gsm8k") == examples


def test_math_rows(tmp_path):
    examples = load_jsonl(write(tmp_path / "math.jsonl", MATH_ROWS), dataset_format=DatasetFormat.MATH)
    assert [e.answer for e in examples] == ["\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}"]
    assert examples[0].id == "m1"
    assert math_reward("so \\boxed{0.5}", examples[1]) == 1.0


def test_plain_rows_and_blank_lines(tmp_path):
    path = write(tmp_path / "plain.jsonl", [PLAIN_ROWS[0], "", "   ", PLAIN_ROWS[1]])
    examples = load_jsonl(path, task="toy")
    assert [e.answer for e in examples] == ["1/2", "4"]
    assert examples[1].source == f"{path}:4" and examples[1].task == "toy" and examples[1].meta == ()


@pytest.mark.parametrize(
    "rows, line, message",
    [
        ([PLAIN_ROWS[0], '{"prompt": "x", "answer": '], 2, "invalid JSON"),
        ([PLAIN_ROWS[0], "[1, 2]"], 2, "must be a JSON object"),
        (["[1, 2]"], 1, "must be a JSON object"),
        ([{"text": "x"}], 1, "cannot tell the dataset format"),
        ([PLAIN_ROWS[0], {"prompt": "no answer"}], 2, "missing field 'answer'"),
        ([GSM8K_ROWS[0], {"question": "q", "solution": "#### 3"}], 2, "missing field 'answer' of a gsm8k row"),
        ([{"prompt": ["x"], "answer": "1"}], 1, "field 'prompt'[0] must be a message {'role'"),
        ([{"prompt": 5, "answer": "1"}], 1, "field 'prompt' must be a string or a non-empty list of messages, got int"),
        ([{"prompt": [{"role": "system", "content": "s"}], "answer": "1"}], 1, "field 'prompt' holds no user message"),
        ([{"prompt": [{"role": "robot", "content": "s"}], "answer": "1"}], 1, "'role': one of ['system', 'user'"),
        ([{"prompt": "x", "answer": None}], 1, "field 'answer' must be a string"),
        ([PLAIN_ROWS[0], {"prompt": "  ", "answer": "1"}], 2, "empty prompt"),
        ([{"question": "q", "answer": "no marker"}], 1, "no '####' answer marker"),
        ([{"problem": "p", "solution": "no box"}], 1, "no \\boxed{...}"),
        ([{"problem": "p", "solution": "\\boxed{\\frac{1}"}], 1, "unbalanced"),
        ([PLAIN_ROWS[0], {"prompt": "x", "answer": "{"}], 2, "math-verify cannot parse the gold answer"),
        ([{"question": "q", "answer": "#### \\frac{"}], 1, "math-verify cannot parse the gold answer"),
        ([{"prompt": "x", "answer": ""}], 1, "empty gold answer"),
        ([{"prompt": "a", "answer": "1", "id": 7}, {"prompt": "b", "answer": "2", "id": "7"}], 2, "already used at"),
        ([{"prompt": "a", "answer": "1", "id": [7]}], 1, "field 'id'"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, rows, line, message):
    path = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as error:
        load_jsonl(path, check_answer=check_gold_answer)
    assert str(error.value).startswith(f"{path}:{line}: ")
    assert message in str(error.value)


def test_whole_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="has no rows"):
        load_jsonl(empty)
    with pytest.raises(DatasetError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="unknown dataset format 'csv'"):
        load_jsonl(write(tmp_path / "ok.jsonl", PLAIN_ROWS), dataset_format="csv")
    # An explicit format is enforced on every row.
    with pytest.raises(DatasetError, match=r"ok\.jsonl:1: missing field 'question'"):
        load_jsonl(tmp_path / "ok.jsonl", dataset_format="gsm8k")
