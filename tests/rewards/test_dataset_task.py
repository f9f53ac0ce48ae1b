"""A loaded JSONL dataset as a Task rewarded by math-verify."""

import json
import pickle

import pytest

from rpegjax.data.example import DatasetError, Example
from rpegjax.data.jsonl import load_jsonl
from rpegjax.rewards.dataset_task import MathDatasetTask
from rpegjax.rewards.runner import Isolation
from rpegjax.rewards.task import Task


@pytest.fixture
def gsm8k_examples(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"} for i in range(60)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return load_jsonl(path)


def test_hash_split_is_disjoint_deterministic_and_complete(gsm8k_examples):
    task = MathDatasetTask(name="gsm8k", examples=gsm8k_examples, eval_fraction=0.25)
    assert isinstance(task, Task) and task.isolation is Isolation.PROCESS
    train_pool, eval_pool = task._split(held_out=False), task._split(held_out=True)
    assert len(train_pool) + len(eval_pool) == 60 and 0 < len(eval_pool) < 30
    train = task.train_examples(len(train_pool), seed=0)
    held_out = task.eval_examples(len(eval_pool), seed=0)
    assert not {e.id for e in train} & {e.id for e in held_out}
    assert task.train_examples(10, seed=5) == task.train_examples(10, seed=5)
    assert task.train_examples(10, seed=5) != task.train_examples(10, seed=6)
    with pytest.raises(ValueError, match="asked for 1000 train examples"):
        task.train_examples(1000, seed=0)


def test_reference_solutions_verify_and_wrong_answers_do_not(gsm8k_examples):
    task = MathDatasetTask(examples=gsm8k_examples, format_bonus=0.1)
    for example in gsm8k_examples[:10]:
        assert task.reward(task.reference_solution(example), example) == 1.0
        assert task.is_correct(f"#### {example.answer}", example)
        assert task.reward(f"#### {int(example.answer) + 1}", example) == 0.0
        assert task.reward(f"<think>hmm</think>#### {int(example.answer) + 1}", example) == pytest.approx(0.1)
        assert task.reward("__import__('os').system('true')", example) == 0.0
    plain = Example(id="p", prompt="half?", answer="1/2", task="math")
    assert MathDatasetTask(examples=[plain]).reference_solution(plain) == "\\boxed{1/2}"


def test_the_reward_sent_to_workers_does_not_carry_the_dataset(gsm8k_examples):
    task = MathDatasetTask(examples=gsm8k_examples, format_bonus=0.1)
    payload = pickle.dumps(task.reward)
    assert len(payload) < 1000 < len(pickle.dumps(task))
    example = gsm8k_examples[3]
    assert pickle.loads(payload)(f"#### {example.answer}", example) == 1.0


def test_explicit_held_out_set(gsm8k_examples):
    task = MathDatasetTask(examples=gsm8k_examples[:50], held_out=gsm8k_examples[50:])
    assert {e.id for e in task.eval_examples(10, seed=0)} == {e.id for e in gsm8k_examples[50:]}


def test_unparsable_gold_fails_at_construction():
    bad = Example(id="b", prompt="q", answer="\\frac{", task="math", source="test.jsonl:4")
    with pytest.raises(DatasetError, match=r"test\.jsonl:4: math-verify cannot parse"):
        MathDatasetTask(examples=[bad])
    with pytest.raises(ValueError, match="MathDatasetTask.eval_fraction"):
        MathDatasetTask(examples=[], eval_fraction=0.0)
