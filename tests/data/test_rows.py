"""Row checks shared by every file kind: field mapping, format detection under a mapping, further fields."""

import json

import pytest

from rpegjax.data.example import SOLUTION_KEY, DatasetError
from rpegjax.data.rows import DatasetFormat, RowSchema, examples_from_rows


def rows(*items):
    return [(f"f:{n}", f"id{n}", row) for n, row in enumerate(items, start=1)]


def test_field_mapping_reads_renamed_fields():
    schema = RowSchema(prompt_field="query", answer_field="gold")
    examples = examples_from_rows(rows({"query": "1+1?", "gold": "2"}, {"query": "2+2?", "gold": 4}), "f",
                                  schema=schema)
    assert [(e.prompt, e.answer) for e in examples] == [("1+1?", "2"), ("2+2?", "4")]
    assert examples[0].meta == ()  # a plain row: no worked solution kept


def test_a_mapping_with_an_explicit_format_extracts_the_answer_its_way():
    schema = RowSchema(dataset_format="gsm8k", prompt_field="q")
    [example] = examples_from_rows(rows({"q": "Sum?", "answer": "1+1=2\n#### 2"}), "f", schema=schema)
    assert example.answer == "2" and example.meta_value(SOLUTION_KEY) == "1+1=2\n#### 2"


@pytest.mark.parametrize(
    "answer, expected_format, expected_answer",
    [("so #### 72", "gsm8k", "72"), ("it is \\boxed{\\frac{1}{2}}", "math", "\\frac{1}{2}"), ("1/2", "plain", "1/2")],
)
def test_both_fields_mapped_the_answer_tells_the_format(answer, expected_format, expected_answer):
    schema = RowSchema(prompt_field="q", answer_field="a")
    [example] = examples_from_rows(rows({"q": "x?", "a": answer}), "f", schema=schema)
    assert example.answer == expected_answer
    assert (SOLUTION_KEY in dict(example.meta)) == (expected_format != "plain")


def test_only_the_prompt_field_mapped_keeps_the_answer_field_of_the_format():
    schema = RowSchema(prompt_field="input")
    [gsm8k] = examples_from_rows(rows({"input": "x?", "answer": "#### 3"}), "f", schema=schema)
    [math] = examples_from_rows(rows({"input": "x?", "solution": "\\boxed{3}"}), "f", schema=schema)
    assert gsm8k.answer == math.answer == "3"


def test_further_fields_are_kept_for_rewards():
    row = {"prompt": "x?", "answer": "3", "id": 9, "level": 2, "tags": ["a", "b"], "note": "hi", "missing": None}
    [example] = examples_from_rows(rows(row), "f")
    assert example.id == "9"
    assert dict(example.meta) == {"level": "2", "tags": json.dumps(["a", "b"]), "note": "hi", "missing": "null"}
    assert example["level"] == "2" and example["answer"] == "3" and example.get("absent") is None


@pytest.mark.parametrize(
    "schema, row, message",
    [
        (RowSchema(prompt_field="query"), {"question": "x", "answer": "1"}, "cannot tell the dataset format"),
        (RowSchema(prompt_field="query"), {"question": "x", "answer": "1"}, "--prompt-field"),
        (RowSchema(dataset_format="plain", answer_field="gold"), {"prompt": "x", "answer": "1"}, "missing field 'gold'"),
        (RowSchema(prompt_field="q", answer_field="a"), {"q": "x", "a": None}, "field 'a' must be a string"),
        (RowSchema(prompt_field="q", answer_field="a"), {"q": "", "a": "1"}, "empty prompt (field 'q')"),
        (RowSchema(), {"question": "q", "answer": "#### 1", "solution": "x"}, "clashes with the worked solution"),
        (RowSchema(), {"prompt": "q", "answer": "1", "blob": b"\x00"}, "field 'blob' holds bytes"),
        (RowSchema(), {"prompt": "q", "answer": "1", "x": float("nan")}, "field 'x' holds float"),
    ],
)
def test_bad_rows_name_their_place(schema, row, message):
    with pytest.raises(DatasetError) as error:
        examples_from_rows(rows(row), "f", schema=schema)
    assert str(error.value).startswith("f:1: ") and message in str(error.value)


def test_bad_schemas():
    with pytest.raises(DatasetError, match="unknown dataset format 'csv'"):
        RowSchema(dataset_format="csv")
    with pytest.raises(DatasetError, match="both 'x'"):
        RowSchema(prompt_field="x", answer_field="x")
    with pytest.raises(DatasetError, match="prompt_field must be a non-empty string"):
        RowSchema(prompt_field="")
    assert RowSchema(dataset_format="math").dataset_format is DatasetFormat.MATH
