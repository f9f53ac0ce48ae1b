"""Seeded epochs, batches across epoch boundaries, and exact resumption from a saved position."""

import json

import pytest

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator

EXAMPLES = [Example(id=f"e{i}", prompt=f"question {i}", answer=str(i), task="toy") for i in range(10)]


def ids(batch):
    return [example.id for example in batch]


def test_epochs_are_seeded_permutations():
    iterator = DataIterator(EXAMPLES, batch_size=5, seed=3)
    epoch_0 = ids(iterator.next_batch() + iterator.next_batch())
    epoch_1 = ids(iterator.next_batch() + iterator.next_batch())
    assert sorted(epoch_0) == sorted(epoch_1) == sorted(ids(EXAMPLES))
    assert epoch_0 != epoch_1  # reshuffled each epoch
    again = DataIterator(EXAMPLES, batch_size=5, seed=3)
    assert ids(again.next_batch() + again.next_batch()) == epoch_0
    other = DataIterator(EXAMPLES, batch_size=5, seed=4)
    assert ids(other.next_batch() + other.next_batch()) != epoch_0


def test_batches_cross_epoch_boundaries():
    iterator = DataIterator(EXAMPLES, batch_size=4, seed=0, shuffle=False)
    batches = [ids(next(iterator)) for _ in range(3)]
    assert batches == [["e0", "e1", "e2", "e3"], ["e4", "e5", "e6", "e7"], ["e8", "e9", "e0", "e1"]]
    assert iterator.epoch == 1
    small = DataIterator(EXAMPLES[:3], batch_size=7, seed=0)
    batch = ids(small.next_batch())
    assert len(batch) == 7 and small.epoch == 2 and sorted(batch[:3]) == ["e0", "e1", "e2"]


def test_restore_resumes_exactly():
    iterator = DataIterator(EXAMPLES, batch_size=3, seed=11)
    for _ in range(5):  # into the second epoch, mid-way
        iterator.next_batch()
    saved = json.loads(json.dumps(iterator.state()))  # what a checkpoint would write
    expected = [ids(iterator.next_batch()) for _ in range(6)]
    resumed = DataIterator(EXAMPLES, batch_size=3, seed=11)
    resumed.restore(saved)
    assert [ids(resumed.next_batch()) for _ in range(6)] == expected


def test_restore_refuses_other_data_or_settings():
    saved = DataIterator(EXAMPLES, batch_size=3, seed=11).state()
    with pytest.raises(ValueError, match="seed"):
        DataIterator(EXAMPLES, batch_size=3, seed=12).restore(saved)
    with pytest.raises(ValueError, match="batch_size"):
        DataIterator(EXAMPLES, batch_size=4, seed=11).restore(saved)
    with pytest.raises(ValueError, match="fingerprint"):
        DataIterator(EXAMPLES[::-1], batch_size=3, seed=11).restore(saved)
    with pytest.raises(ValueError, match="lacks"):
        DataIterator(EXAMPLES, batch_size=3, seed=11).restore({"seed": 11})
    with pytest.raises(ValueError, match="bad position"):
        DataIterator(EXAMPLES, batch_size=3, seed=11).restore({**saved, "position": 99})


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one example"):
        DataIterator([], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        DataIterator(EXAMPLES, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        DataIterator(EXAMPLES, batch_size=1, seed="0")
