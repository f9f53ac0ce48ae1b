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
    on the device); `offset[slot]`: response tokens its row held when its request began (a sequence kept across
    calls, `page_carry.KeptPages`: its request's context already ends with them).
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
        self.offset = np.zeros(num_slots, np.int64)
        self.admissions = 0  # sequences admitted so far: the next one's `admitted_at`
        self.shared_references = 0  # prompt pages a sample uses without a copy of its own, over admissions

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
    def _room(self, replica: int, prompt: int, samples: int) -> tuple[list[int], int]:
        """`replica`'s free slots and how many of `samples` samples of request `prompt` its free pages hold: the
        prompt's full pages (shared) plus each sample's partial page and first chunk, beyond the next chunk of every
        sequence already running there."""
        request, page = self.requests[prompt], self.page_size
        size = request.size
        full = size // page
        per_sample = max(pages_for(min(size + self.chunk_steps, size + request.budget - 1), page) - full, 1)
        block = range(replica * self.slots_per_replica, (replica + 1) * self.slots_per_replica)
        free = [s for s in block if self.owners[s] is None]
        reserve = sum(self.chunk_need(s) for s in block if self.owners[s] is not None)
        spare = self.pool.num_free(replica) - reserve - full
        return free, max(0, min(len(free), samples, spare // per_sample))

    def choose(self, prompt: int, samples: tuple[int, ...]) -> tuple[int, list[int]] | None:
        """The replica and slots for the first samples of `samples` of request `prompt` (one slot each, in order).
        Every sample on one replica when one has room for them all (they share the prompt's pages): the one with
        the most free slots, then the most free pages (a chunk's live bucket is as wide as the busiest replica's
        running rows, so they are spread). Otherwise, when the replicas together have room for them all, as many
        as the roomiest replica holds (the rest go to the next: a prefill of the prompt on each), so no replica
        idles while a request they could take waits. None when the request must wait."""
        best, room = None, 0
        for replica in range(self.replicas):
            free, fits = self._room(replica, prompt, len(samples))
            room += fits
            rank = (fits == len(samples), fits, len(free), self.pool.num_free(replica))
            if fits and (best is None or rank > best[0]):
                best = (rank, replica, free[:fits])
        return None if best is None or room < len(samples) else (best[1], best[2])

    def admit(self, pending) -> list[tuple[int, tuple[int, ...], list[int]]]:
        """Places pending entries (request index, samples), in order, while the replicas have room for the next one
        (`choose`), popping them from the deque `pending`; returns what was placed: (request index, samples, slots),
        one entry per replica a request's samples went to."""
        admitted = []
        while pending:
            prompt, samples = pending[0]
            choice = self.choose(prompt, samples)
            if choice is None:
                break
            pending.popleft()
            replica, chosen = choice
            placed, rest = samples[: len(chosen)], samples[len(chosen):]
            if rest:
                pending.appendleft((prompt, rest))
            self.shared_references += self.place(prompt, placed, replica, chosen)
            admitted.append((prompt, placed, chosen))
        return admitted

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
            self.offset[slot] = 0
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
            generated = int(num_generated[slot]) - int(self.offset[slot])
            self.cache_length[slot] = self.requests[self.owners[slot][0]].size + generated - 1
