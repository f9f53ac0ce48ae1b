"""Host bookkeeping of one paged run: which sequence each slot holds, the pages it holds, and preemption.

Plain numpy and lists, no device arrays: `PagedController.run` decides with it what to admit where and which
pages each decode chunk may write, then hands the page table to the compiled programs.
"""

from __future__ import annotations

import numpy as np

from rpegjax.generate.paged_cache import PagePool, pages_for
from rpegjax.generate.requests import Request


class PagedSlots:
    """The slots of a paged sampler during one run, split into `replicas` equal blocks with a page pool each.

    `owners[slot]`: (request index, sample) or None when free; `held[slot]`: its pages in table order (the same
    ids as `table[slot]`); `cache_length[slot]`: tokens it has cached; `admitted_at[slot]`: its admission order
    (preemption takes the newest); `evict[slot]`: preempted since the last decode chunk (the chunk clears the row
    on the device).
    """

    def __init__(self, requests: list[Request], *, num_slots: int, replicas: int, pages_per_replica: int,
                 page_size: int, max_pages: int, chunk_steps: int):
        self.requests = requests  # the run's queue list: it grows in place as a feed adds requests
        self.num_slots = num_slots
        self.replicas = replicas
        self.slots_per_replica = num_slots // replicas
        self.page_size = page_size
        self.chunk_steps = chunk_steps
        self.pool = PagePool(replicas, pages_per_replica)
        self.table = np.zeros((num_slots, max_pages), np.int32)
        self.held: list[list[int]] = [[] for _ in range(num_slots)]
        self.owners: list[tuple[int, int] | None] = [None] * num_slots
        self.admitted_at = np.zeros(num_slots, np.int64)
        self.cache_length = np.zeros(num_slots, np.int64)
        self.evict = np.zeros(num_slots, bool)
        self.admissions = 0  # sequences admitted so far: the next one's `admitted_at`

    def replica_of(self, slot: int) -> int:
        return slot // self.slots_per_replica

    def idle(self) -> bool:
        return all(owner is None for owner in self.owners)

    def running(self) -> list[int]:
        return [slot for slot in range(self.num_slots) if self.owners[slot] is not None]

    def _most_tokens(self, slot: int) -> int:  # the last sampled token is never written to the cache
        request = self.requests[self.owners[slot][0]]
        return request.size + request.budget - 1

    def chunk_need(self, slot: int) -> int:
        """Pages the slot's next chunk writes into, beyond those it holds."""
        tokens = min(int(self.cache_length[slot]) + self.chunk_steps, self._most_tokens(slot))
        return max(0, pages_for(tokens, self.page_size) - len(self.held[slot]))

    def release(self, slot: int) -> None:
        self.pool.release(self.replica_of(slot), self.held[slot])
        self.held[slot] = []
        self.table[slot] = 0
        self.owners[slot] = None

    # ---- admission -----------------------------------------------------------------------------------
    def choose(self, prompt: int, samples: tuple[int, ...]) -> tuple[int, list[int]] | None:
        """The replica and slots for `samples` of request `prompt`: of the replicas with enough free slots and
        free pages for the prompt (full pages shared, a partial one per sample) and each sample's first chunk,
        plus the next chunk of every sequence already running there, the one with the most free pages. None
        when no replica has room."""
        request, page = self.requests[prompt], self.page_size
        size, g = request.size, len(samples)
        full = size // page
        first = pages_for(min(size + self.chunk_steps, size + request.budget - 1), page) - full
        need = full + g * max(first, 1)
        choice = None
        for replica in range(self.replicas):
            block = range(replica * self.slots_per_replica, (replica + 1) * self.slots_per_replica)
            free = [s for s in block if self.owners[s] is None]
            reserve = sum(self.chunk_need(s) for s in block if self.owners[s] is not None)
            if len(free) >= g and self.pool.num_free(replica) >= need + reserve:
                if choice is None or self.pool.num_free(replica) > self.pool.num_free(choice[0]):
                    choice = (replica, free[:g])
        return choice

    def place(self, prompt: int, samples: tuple[int, ...], replica: int, slots: list[int]) -> int:
        """Gives `slots` (one per sample, on `replica`) the prompt's pages: the full ones shared by every sample, a
        partial last one of each sample's own. Returns the page references shared (pages x later samples)."""
        size = self.requests[prompt].size
        shared = self.pool.take(replica, size // self.page_size)
        self.pool.share(replica, shared, len(samples) - 1)
        for slot, sample in zip(slots, samples, strict=True):
            self.held[slot] = shared + self.pool.take(replica, 1 if size % self.page_size else 0)
            self.table[slot, : len(self.held[slot])] = self.held[slot]
            self.owners[slot] = (prompt, sample)
            self.evict[slot] = False  # a slot preempted and refilled before any decode: start_rows resets it
            self.cache_length[slot] = size
            self.admitted_at[slot] = self.admissions
            self.admissions += 1
        return len(shared) * (len(samples) - 1)

    # ---- pages for the next chunk --------------------------------------------------------------------
    def grow_for_next_chunk(self) -> list[tuple[int, int]]:
        """Gives every running slot, oldest first, the pages its next chunk writes; a replica whose pool runs
        dry frees its newest sequences until the slot's need fits (possibly the slot itself). Returns the
        preempted (request index, sample), in order: they restart from their context later."""
        preempted = []
        for slot in sorted(self.running(), key=lambda s: self.admitted_at[s]):
            if self.owners[slot] is None:  # preempted by an older sequence in this pass
                continue
            replica = self.replica_of(slot)
            while self.chunk_need(slot) > self.pool.num_free(replica):
                victim = max((s for s in range(self.num_slots)
                              if self.owners[s] is not None and self.replica_of(s) == replica),
                             key=lambda s: self.admitted_at[s])
                preempted.append(self.owners[victim])
                self.release(victim)
                self.evict[victim] = True
                if victim == slot:
                    break
            if self.owners[slot] is None:
                continue
            extra = self.pool.take(replica, self.chunk_need(slot))
            self.table[slot, len(self.held[slot]): len(self.held[slot]) + len(extra)] = extra
            self.held[slot] += extra
        return preempted

    def record_generated(self, running: list[int], num_generated: np.ndarray) -> None:
        """Cache lengths after a chunk: the context plus every response token but the last (not cached yet)."""
        for slot in running:
            self.cache_length[slot] = self.requests[self.owners[slot][0]].size + int(num_generated[slot]) - 1
