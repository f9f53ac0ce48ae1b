"""Datasets as people have them: Parquet files (and directories of them) and Hugging Face `save_to_disk`
directories, read without `datasets` and checked row by row against what `datasets` itself reads."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rpegjax.data.example import SOLUTION_KEY, DatasetError
from rpegjax.data.files import dataset_rows, load_examples
from rpegjax.data.rows import RowSchema
from rpegjax.rewards.math import check_gold_answer

ROWS = [
    {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}", "level": a % 3}
    for a in range(7) for b in range(3)
]


def write_parquet(path, rows, **kwargs):
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def test_parquet_file_row_by_row(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", ROWS, row_group_size=4)  # rows span several batches
    examples = load_examples(path, check_answer=check_gold_answer)
    assert [e.prompt for e in examples] == [r["question"] for r in ROWS]
    assert [e.answer for e in examples] == [r["answer"].rsplit("#### ", 1)[1] for r in ROWS]
    assert [e.source for e in examples[:2]] == [f"{path}:row 0", f"{path}:row 1"]
    assert examples[5].id == "train.parquet:5" and examples[5]["level"] == str(ROWS[5]["level"])
    assert examples[0].meta_value(SOLUTION_KEY) == ROWS[0]["answer"]


def test_parquet_field_mapping_and_ids(tmp_path):
    rows = [{"query": "2+2?", "gold": "4", "id": 10}, {"query": "3+3?", "gold": "6", "id": 11}]
    path = write_parquet(tmp_path / "mapped.parquet", rows)
    examples = load_examples(path, schema=RowSchema(prompt_field="query", answer_field="gold"))
    assert [(e.id, e.prompt, e.answer) for e in examples] == [("10", "2+2?", "4"), ("11", "3+3?", "6")]


def test_a_directory_of_parquet_files_is_read_in_name_order(tmp_path):
    write_parquet(tmp_path / "train-00001-of-00002.parquet", ROWS[10:])
    write_parquet(tmp_path / "train-00000-of-00002.parquet", ROWS[:10])
    examples = load_examples(tmp_path)
    assert [e.prompt for e in examples] == [r["question"] for r in ROWS]
    assert examples[10].source.endswith("train-00001-of-00002.parquet:row 0")


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "q", "answer": "#### 1"}, {"question": "q2", "answer": "no marker"}], ":row 1: field 'answer'"),
        ([{"question": "q", "answer": "#### 1"}, {"question": None, "answer": "#### 2"}], ":row 1: field 'question' "
                                                                                          "must be a string"),
        ([{"question": "q", "answer": "#### 1", "id": 1}, {"question": "r", "answer": "#### 2", "id": 1}],
         ":row 1: id '1' already used at"),
        ([{"question": "q", "answer": "#### {"}], ":row 0: math-verify cannot parse the gold answer"),
    ],
)
def test_bad_parquet_rows_are_named_by_row(tmp_path, rows, message):
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError) as error:
        load_examples(path, check_answer=check_gold_answer)
    assert str(error.value).startswith(f"{path}:row ") and message in str(error.value)


def test_whole_file_problems(tmp_path):
    path = write_parquet(tmp_path / "cols.parquet", [{"text": "x", "label": "1"}])
    with pytest.raises(DatasetError, match=r"the columns \['label', 'text'\] do not hold the prompt and answer"):
        load_examples(path)
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(DatasetError, match="cannot read it as Parquet"):
        load_examples(not_parquet)
    empty = write_parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(DatasetError, match="the columns"):  # no columns at all
        load_examples(empty)
    empty_rows = tmp_path / "no_rows.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty_rows)
    with pytest.raises(DatasetError, match="has no rows"):
        load_examples(empty_rows)
    with pytest.raises(DatasetError, match="no such dataset file or directory"):
        load_examples(tmp_path / "missing.parquet")
    (tmp_path / "other").mkdir()
    with pytest.raises(DatasetError, match="neither a Hugging Face dataset"):
        load_examples(tmp_path / "other")


def test_saved_hugging_face_datasets_match_load_from_disk(tmp_path):
    dataset = datasets.Dataset.from_list(ROWS)
    cases = {
        "whole": dataset,
        "selected": dataset.select([20, 3, 7]),  # an indices mapping, flattened by save_to_disk
        "sharded": dataset,
    }
    for name, data in cases.items():
        data.save_to_disk(str(tmp_path / name), num_shards=3 if name == "sharded" else 1)
    assert len(list((tmp_path / "sharded").glob("*.arrow"))) == 3
    for name in cases:
        reference = list(datasets.load_from_disk(str(tmp_path / name)))
        assert [row for _, _, row in dataset_rows(tmp_path / name)] == reference
        examples = load_examples(tmp_path / name, check_answer=check_gold_answer)
        assert [e.prompt for e in examples] == [r["question"] for r in reference]
        assert examples[-1].source == f"{tmp_path / name}:row {len(reference) - 1}"


def test_a_dataset_dict_names_its_splits(tmp_path):
    dataset = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"a DatasetDict with splits \['train', 'test'\]; give one split's directory"):
        load_examples(tmp_path / "dd")
    assert len(load_examples(tmp_path / "dd" / "test")) == 2


def test_a_damaged_saved_dataset_is_a_clear_error(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "d"))
    (tmp_path / "d" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
    with pytest.raises(DatasetError, match="lists 'gone.arrow', which is not a file"):
        load_examples(tmp_path / "d")
    (tmp_path / "d" / "state.json").write_text("{")
    with pytest.raises(DatasetError, match="state.json: cannot read it"):
        load_examples(tmp_path / "d")


def verl_rows(count):
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {a} + 2? Let's think step by step and output the final "
                                                    "answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + 2)},
             "extra_info": {"split": "train", "index": a, "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}",
                            "question": f"What is {a} + 2?"}}
            for a in range(count)]


def test_verl_parquet_loads_without_conversion(tmp_path):
    """verl's GSM8K/MATH Parquet layout is detected (DatasetFormat.VERL): the prompt messages, the gold answer
    from reward_model.ground_truth, the other columns for rewards (decoded for batched ones)."""
    rows = verl_rows(5)
    path = write_parquet(tmp_path / "train.parquet", rows)
    examples = load_examples(path, check_answer=check_gold_answer)
    assert [e.answer for e in examples] == [str(a + 2) for a in range(5)]
    first = examples[0]
    assert first.messages == (("user", rows[0]["prompt"][0]["content"]),) and first.prompt == rows[0]["prompt"][0]["content"]
    assert first["data_source"] == "openai/gsm8k" and json.loads(first["reward_model"])["style"] == "rule"
    assert first.columns()["extra_info"] == rows[0]["extra_info"] and first.columns()["ability"] == "math"
    assert SOLUTION_KEY not in dict(first)
    assert load_examples(path, schema=RowSchema(dataset_format="verl")) == examples


def test_trl_conversational_jsonl_and_nested_fields(tmp_path):
    """TRL's conversational rows (a prompt that is a list of messages) and dotted field names for nested values."""
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}+1?"}],
             "meta": {"gold": {"value": str(a + 1)}}, "solution": str(a + 1)} for a in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    plain = load_examples(path, schema=RowSchema(answer_field="solution"))
    assert [e.messages for e in plain] == [(("system", "Be brief."), ("user", f"{a}+1?")) for a in range(3)]
    assert [e.prompt for e in plain] == ["0+1?", "1+1?", "2+1?"] and [e.answer for e in plain] == ["1", "2", "3"]
    nested = load_examples(path, schema=RowSchema(answer_field="meta.gold.value"))
    assert [e.answer for e in nested] == ["1", "2", "3"] and nested[0]["solution"] == "1"
    with pytest.raises(DatasetError, match=r"chat\.jsonl:1: missing field 'meta\.gold\.nothing' of a plain row"):
        load_examples(path, schema=RowSchema(dataset_format="plain", answer_field="meta.gold.nothing"))
    with pytest.raises(DatasetError, match=r"chat\.jsonl:1: cannot tell the dataset format.*'meta\.gold\.nothing'"):
        load_examples(path, schema=RowSchema(answer_field="meta.gold.nothing"))


def test_nested_fields_in_parquet(tmp_path):
    rows = [{"input": {"text": f"{a}*2?"}, "target": {"value": a * 2}} for a in range(4)]
    path = write_parquet(tmp_path / "nested.parquet", rows)
    examples = load_examples(path, schema=RowSchema(prompt_field="input.text", answer_field="target.value"))
    assert [(e.prompt, e.answer) for e in examples] == [(f"{a}*2?", str(a * 2)) for a in range(4)]
    with pytest.raises(DatasetError, match="do not hold the prompt and answer fields"):
        load_examples(path, schema=RowSchema(prompt_field="question.text", answer_field="target.value"))
