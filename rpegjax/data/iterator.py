"""Endless, seeded, resumable batches of examples: the data position a checkpoint stores."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence

from rpegjax.data.example import Example


def fingerprint(examples: Sequence[Example]) -> str:
    """A short stable digest of the examples' ids in order, to refuse restoring onto another dataset."""
    digest = hashlib.blake2b(digest_size=8)
    for example in examples:
        digest.update(example.id.encode())
        digest.update(b"\0")
    return digest.hexdigest()


class DataIterator:
    """Batches of `batch_size` examples, forever.

    Epoch e visits every example once in the order `random.Random(f"{seed}/{e}")` shuffles them to (or
    in file order when `shuffle=False`); a batch that reaches the end of an epoch continues into the next.
    The order is a function of (seed, epoch) alone, so `state()` — seed, epoch, position within the epoch,
    batch size and a fingerprint of the examples — is all a checkpoint needs, and `restore(state)` resumes
    exactly where the saved iterator was.
    """

    def __init__(self, examples: Sequence[Example], *, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not examples:
            raise ValueError("DataIterator needs at least one example")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"DataIterator.batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"DataIterator.seed must be an integer, got {seed!r}")
        self._examples = tuple(examples)
        self._batch_size, self._seed, self._shuffle = batch_size, seed, shuffle
        self._fingerprint = fingerprint(self._examples)
        self._epoch, self._position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._examples)))
        if self._shuffle:
            random.Random(f"{self._seed}/{epoch}").shuffle(order)
        return order

    @property
    def examples(self) -> tuple[Example, ...]:
        return self._examples

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_batch(self) -> list[Example]:
        batch = []
        while len(batch) < self._batch_size:
            if self._position == len(self._order):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
            take = min(self._batch_size - len(batch), len(self._order) - self._position)
            batch.extend(self._examples[i] for i in self._order[self._position : self._position + take])
            self._position += take
        return batch

    def __iter__(self) -> Iterator[list[Example]]:
        return self

    def __next__(self) -> list[Example]:
        return self.next_batch()

    def state(self) -> dict[str, int | str]:
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "batch_size": self._batch_size,
            "shuffle": int(self._shuffle),
            "fingerprint": self._fingerprint,
        }

    def restore(self, state: Mapping[str, int | str]) -> None:
        """Resume from `state()`; it must come from an iterator over the same examples with the same settings."""
        expected = self.state()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"DataIterator.restore: the saved data position lacks {missing} (got {dict(state)})")
        for key in ("seed", "batch_size", "shuffle", "fingerprint"):
            if state[key] != expected[key]:
                raise ValueError(
                    f"DataIterator.restore: saved {key}={state[key]!r} but this iterator has {expected[key]!r}; "
                    "the checkpoint was written for other data or settings"
                )
        epoch, position = state["epoch"], state["position"]
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(position, int) or not 0 <= position <= len(self._examples):
            raise ValueError(f"DataIterator.restore: bad position epoch={epoch!r} position={position!r}")
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)
