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
