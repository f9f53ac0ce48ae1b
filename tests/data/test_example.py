"""The Example record: validation, immutable meta, pickling (reward workers receive examples)."""

import pickle

import pytest

from rpegjax.data.example import DatasetError, Example


def test_meta_is_frozen_sorted_pairs():
    example = Example(id="a", prompt="p", answer="1", task="t", meta={"z": "1", "b": "2"})
    assert example.meta == (("b", "2"), ("z", "1"))
    assert example.meta_value("z") == "1"
    assert hash(example) == hash(Example(id="a", prompt="p", answer="1", task="t", meta=(("z", "1"), ("b", "2"))))
    assert pickle.loads(pickle.dumps(example)) == example
    with pytest.raises(KeyError, match="no meta field 'missing'"):
        example.meta_value("missing")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt": "   "}, "Example.prompt is empty"),
        ({"id": ""}, "Example.id must be non-empty"),
        ({"answer": 3}, "Example.answer must be a string"),
        ({"meta": {"k": 1}}, "meta entries must be"),
    ],
)
def test_invalid_examples(fields, message):
    base = {"id": "a", "prompt": "p", "answer": "1", "task": "t", "source": "f.jsonl:9"}
    with pytest.raises(DatasetError, match=message) as error:
        Example(**{**base, **fields})
    assert "f.jsonl:9" in str(error.value)


def test_an_example_reads_as_a_dict():
    example = Example(id="e1", prompt="2+2?", answer="4", task="math", meta={"level": "3", "prompt": "shadowed"},
                      source="f.jsonl:1")
    assert dict(example) == {"prompt": "2+2?", "answer": "4", "id": "e1", "task": "math", "level": "3"}
    assert len(example) == 5 and "level" in example and example.get("missing", "x") == "x"
    assert example["answer"] == "4" and example["level"] == "3"
    with pytest.raises(KeyError):
        example["source"]
    # still a value: hashable, compared field by field
    assert hash(example) == hash(Example(**{f: getattr(example, f) for f in ("id", "prompt", "answer", "task", "meta",
                                                                              "source")}))
    assert example != dict(example)
