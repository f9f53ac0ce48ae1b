"""Sequences a paged sampler keeps across `Sampler.serve` calls: their KV pages stay in the pool, unprefilled.

Partial rollouts with `carry=pages` (`rpegjax.runtime.partial_rollouts`) interrupt a step's generation and continue
the sequences still decoding at the next step, with newer weights. Instead of handing their slots back, an
interrupted call given a `KeptPages` keeps them: the decode state (pools, rows) and the host bookkeeping of the
slots (`PagedSlots`) stay in the `KeptPages`, each kept sequence under (request index, sample) of that call. The
next call continues a kept sequence when one of its requests names the slot (`Request.kept`, context = prompt +
the tokens handed out so far): the request's row keeps its pages and its device row, takes the request's PRNG
stream and decodes on. Kept slots that no request claims are freed (their sequences were dropped).

The KV of a kept sequence's earlier tokens was written by the weights of the calls that decoded them: each
position's keys and values are those of the version whose decode step read that token (the version that sampled
the next one; the prompt's, the version that sampled the first response token). A recorded log-prob is thus that of
a decode that builds the cache token by token with each token's version, not a full forward under one version
(which `carry=recompute` gives, at the price of a prefill of every carried context).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from jaxtyping import Array, Int

from rpegjax.generate.decode import DecodeState
from rpegjax.generate.paged_cache import pow2_at_least
from rpegjax.generate.paged_slots import PagedSlots
from rpegjax.generate.requests import Request


class KeptPages:
    """The sequences a caller's last interrupted paged call kept (`kept`: (request index, sample) -> slot), with the
    decode state and slots that hold them; empty (`state` None) before a first interruption and after a call that
    ended with nothing running."""

    def __init__(self) -> None:
        self.state: DecodeState | None = None
        self.slots: PagedSlots | None = None
        self.kept: dict[tuple[int, int], int] = {}

    def take(self) -> tuple[DecodeState | None, PagedSlots | None, set[int]]:
        """Hands the state, slots and kept slots to a call and empties itself (a call that fails keeps nothing:
        its state was donated to the programs it ran)."""
        taken = (self.state, self.slots, set(self.kept.values()))
        self.state, self.slots, self.kept = None, None, {}
        return taken

    def keep(self, state: DecodeState, slots: PagedSlots, kept: dict[tuple[int, int], int]) -> None:
        self.state, self.slots, self.kept = state, slots, dict(kept)

    def slot_of(self, prompt_index: int, sample_index: int) -> int | None:
        """The slot keeping sample `sample_index` of request `prompt_index` of the last call (None: not kept)."""
        return self.kept.get((prompt_index, sample_index))


def claim(slots: PagedSlots, requests: list[Request], kept: set[int], pending: deque) -> dict[int, int]:
    """Gives each request that names a kept slot (`Request.kept`) that slot: its owner becomes (request, 0) (its
    `offset`, set when it was kept, counts the response tokens its row holds: the context's past the prompt); frees
    (and marks for eviction on the device) the kept slots no request claims; drops the claiming requests'
    entries from the queue's `pending` (they are running). Returns slot -> request index.
    Raises when a request names a slot that keeps nothing, two name one slot, or a context does not end where
    the slot's cache does (the caller's tokens and the device's disagree)."""
    claimed: dict[int, int] = {}
    if not kept and all(request.kept is None for request in requests):
        return claimed
    for index, request in enumerate(requests):
        slot = request.kept
        if slot is None:
            continue
        if slot not in kept or slot in claimed:
            raise ValueError(f"request {index} continues kept slot {slot}, which "
                             f"{'another request continues' if slot in claimed else 'keeps no sequence'} "
                             f"(kept: {sorted(kept)})")
        if int(slots.cache_length[slot]) + 1 != request.size:
            raise ValueError(f"request {index} continues kept slot {slot} with a context of {request.size} tokens; "
                             f"the slot caches {int(slots.cache_length[slot])} + its last sampled token")
        claimed[slot] = index
    for slot in sorted(kept - set(claimed)):
        slots.release(slot)
        slots.evict[slot] = True
    slots.requests = requests
    for slot, index in claimed.items():
        slots.owners[slot] = (index, 0)
    running = [entry for entry in pending if requests[entry[0]].kept is None]
    pending.clear()
    pending.extend(running)
    return claimed


def retag_rows(claimed: dict[int, int], requests: list[Request], num_slots: int, *, bucket: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The claimed slots' new PRNG streams (the requests' key_index and first sample), `bucket` rows (default: a
    power of two) padded with a slot past the end (dropped): the arguments of `retag` but the state."""
    bucket = pow2_at_least(len(claimed), num_slots) if bucket is None else bucket
    rows = np.full((bucket,), num_slots, np.int32)
    prompt_index, sample_index = np.zeros((bucket,), np.int32), np.zeros((bucket,), np.int32)
    for i, (slot, index) in enumerate(sorted(claimed.items())):
        rows[i], prompt_index[i], sample_index[i] = slot, requests[index].key_index, requests[index].first_sample
    return rows, prompt_index, sample_index


def retag(state: DecodeState, rows: Int[Array, " r"], prompt_index: Int[Array, " r"], sample_index: Int[Array, " r"]
          ) -> DecodeState:
    """Kept rows take their new requests' PRNG streams (a row >= num_slots is padding)."""
    return state.replace(prompt_index=state.prompt_index.at[rows].set(prompt_index, mode="drop"),
                         sample_index=state.sample_index.at[rows].set(sample_index, mode="drop"))
