"""Host controller of the paged sampler: page tables, admission by free pages, preemption, chunked prefill.

Per decode chunk the controller (1) admits pending groups while a replica has enough free slots and
free pages for the group's prompt and first chunk plus the next chunk of every sequence already
running there (a group that no single replica holds, but the replicas together do, is split over
them: no replica idles while a request it could take waits), (2) gives every running sequence the pages its next chunk writes, preempting the most
recently admitted sequence of a replica whose pool ran dry (its pages are freed and it restarts from
its prompt later: per-row keys make the restart draw the same tokens), (3) runs the chunk on the live
bucket of the running slots (`live_rows`) over a power-of-two number of page-table columns and (4) fetches to the host only the small per-slot arrays
plus the rows of the sequences that finished. The slots' owners, pages and preemption choices are host
bookkeeping of one run (`paged_slots.PagedSlots`); this module holds the compiled programs and the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.generate.completion import FINISH_CODES, Completion, FinishReason, unstarted
from rpegjax.generate.decode import DecodeStalledError, abstract_state_of
from rpegjax.generate.live_rows import finished_rows, live_rows, padded_rows
from rpegjax.generate.page_carry import KeptPages, claim, retag, retag_rows
from rpegjax.generate.paged_cache import CacheConfig, pages_for, pow2_at_least
from rpegjax.generate.paged_decode import (
    decode_paged,
    empty_paged_state,
    paged_state_shardings,
    prefill_pages,
    start_rows,
)
from rpegjax.generate.paged_slots import PagedSlots
from rpegjax.generate.requests import Request, RequestFeed, RequestQueue
from rpegjax.models.config import ModelConfig
from rpegjax.models.layer_stack import page_groups
from rpegjax.models.paged_attention import check_kernel
from rpegjax.options import CacheLayout, DecodeAttention
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding


class PagedController:
    """Compiled functions and host bookkeeping of a paged sampler (built by `Sampler`)."""

    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, cache: CacheConfig, *, num_slots: int,
                 replicas: int, capacity: int, max_new_tokens: int, chunk_steps: int, stats,
                 mesh: Mesh | None, activation: ActivationSharding | None, params_sharding, live_buckets: bool,
                 record_routing: bool = False):
        self.cfg = cfg
        self.record_routing = record_routing
        self.live_buckets = live_buckets
        self.page_size = cache.page_size
        self.prefill_chunk = cache.prefill_chunk
        self.num_slots = num_slots
        self.replicas = replicas
        self.slots_per_replica = num_slots // replicas
        self.chunk_steps = chunk_steps
        self.max_pages = pages_for(capacity, cache.page_size)
        self.pages_per_replica = (self.slots_per_replica * self.max_pages if cache.pages_per_replica is None
                                  else cache.pages_per_replica)
        if self.pages_per_replica < self.max_pages:
            raise ValueError(
                f"CacheConfig.pages_per_replica={self.pages_per_replica} cannot hold one sequence of the sampler's "
                f"capacity ({capacity} tokens = {self.max_pages} pages of {cache.page_size})"
            )
        self.stats = stats
        groups, _ = page_groups(cfg)
        if len(groups) != 1:
            raise ValueError(f"paged sampler: the model's layers keep pages in {len(groups)} page groups {groups}; "
                             "this sampler keeps one (every layer's pages cover every position)")
        self.decode_attention = _checked_decode_attention(cache, cfg, mesh)
        self._empty = partial(empty_paged_state, cfg, num_slots=num_slots, replicas=replicas,
                              pages_per_replica=(self.pages_per_replica,), page_size=cache.page_size,
                              max_pages=self.max_pages, max_new_tokens=max_new_tokens, record_routing=record_routing)

        def prefill_fn(window_pages, *arrays):
            return prefill_pages(graphdef, *arrays, window_pages=window_pages, sharding=activation)

        def decode_fn(window_pages, *arrays):
            return decode_paged(graphdef, *arrays, window_pages=window_pages, decode_attention=cache.decode_attention,
                                pallas_interpret=cache.pallas_interpret, sharding=activation)

        self._state_sharding = None
        # prefill's float32 logits [p v], p replica-major: each replica's block stays on its devices
        self._logits = None if mesh is None else activation.sharding((axes.BATCH, None), (replicas, cfg.vocab_size),
                                                                      name="prefill logits")
        if mesh is None:
            self._prefill = jax.jit(prefill_fn, static_argnums=(0,), donate_argnums=(2,))
            self._start = jax.jit(start_rows, donate_argnums=(0,))
            self._decode = jax.jit(decode_fn, static_argnums=(0,), donate_argnums=(2,))
            self._build_state = jax.jit(self._empty)
            self._rows = jax.jit(finished_rows)
            self._retag = jax.jit(retag, donate_argnums=(0,))
        else:
            state_sharding = paged_state_shardings(jax.eval_shape(self._empty), activation)
            self._state_sharding = state_sharding
            replicated = NamedSharding(mesh, PartitionSpec())
            rows = activation.sharding((axes.BATCH,), (num_slots,), name="slot rows")
            # [r q] start rows and [r c] page copies, replica i's on replica i's devices
            per_replica = activation.sharding((axes.BATCH, None), (replicas, 1), name="start rows")
            self._prefill = jax.jit(prefill_fn, static_argnums=(0,),
                                    in_shardings=(params_sharding, state_sharding) + (replicated,) * 5 + (self._logits, replicated),
                                    out_shardings=(state_sharding, self._logits), donate_argnums=(2,))
            self._start = jax.jit(start_rows,
                                  in_shardings=(state_sharding, self._logits) + (per_replica,) * 9 + (replicated,) * 2,
                                  out_shardings=state_sharding, donate_argnums=(0,))
            self._decode = jax.jit(
                decode_fn, static_argnums=(0,),
                in_shardings=(params_sharding, state_sharding, state_sharding.cache.tables, rows, rows,
                              replicated, replicated, replicated, replicated),
                out_shardings=(state_sharding, replicated), donate_argnums=(2,))
            self._build_state = jax.jit(self._empty, out_shardings=state_sharding)
            # only finished rows come back, replicated, so every process can read them
            self._rows = jax.jit(finished_rows, out_shardings=replicated)
            self._retag = jax.jit(retag, in_shardings=(state_sharding,) + (replicated,) * 3,
                                  out_shardings=state_sharding, donate_argnums=(0,))

    def compile_counts(self) -> dict[str, int]:
        return {"prefill": self._prefill._cache_size(), "start": self._start._cache_size(),
                "decode": self._decode._cache_size()}

    def new_state(self):
        return self._build_state()

    # ---- lowering ahead of time ----------------------------------------------------------------------
    def abstract_state(self):
        """The paged decode state's shapes and dtypes with its shardings (nothing allocated)."""
        return abstract_state_of(self._empty, self._state_sharding)

    def lower_programs(self, params, state, key, arrays, *, max_prompt_len: int, group_size: int
                       ) -> dict[str, jax.stages.Lowered]:
        """`prefill`, `start` and `decode` lowered at the largest shapes `run` gives them (`Sampler.lower_programs`):
        every replica's groups prefilled at once in a chunk of the longest prompts over all their pages, every slot
        started, a decode chunk over a sequence's every page."""
        per_replica = pow2_at_least(max(self.slots_per_replica // group_size, 1), self.slots_per_replica)
        p = per_replica * self.replicas
        chunk = pow2_at_least(min(self.prefill_chunk, max_prompt_len), self.prefill_chunk)
        window = pow2_at_least(pages_for(max_prompt_len, self.page_size), self.max_pages)
        ints = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        prefill = self._prefill.lower(window, params, state, (ints(p, self.max_pages),), ints(p), ints(p, chunk), ints(p),
                                      np.zeros((p,), bool), np.zeros((p, self.cfg.vocab_size), np.float32), ints(p))
        logits = jax.ShapeDtypeStruct((p, self.cfg.vocab_size), jnp.float32, sharding=self._logits)
        # every slot of every replica started; a copy of the prompt's partial last page for each sample but a
        # group's first
        r, q = self.replicas, self.slots_per_replica
        c = pow2_at_least(max((group_size - 1) * (q // group_size), 1), q)
        start = self._start.lower(state, logits, *(ints(r, q) for _ in range(7)), *((ints(r, c),) for _ in range(2)),
                                  key, arrays)
        every = live_rows([], num_slots=self.num_slots, replicas=self.replicas, compact=False)
        decode = self._decode.lower(self.max_pages, params, state, (ints(self.num_slots, self.max_pages),),
                                    ints(self.num_slots), np.zeros((self.num_slots,), bool), every, key, arrays,
                                    np.int32(self.chunk_steps))
        return {"prefill": prefill, "start": start, "decode": decode}

    def lower_retag(self, state) -> jax.stages.Lowered:
        """The program that gives kept sequences their new PRNG streams (`page_carry`), at its largest shape."""
        return self._retag.lower(state, *retag_rows({}, [], self.num_slots, bucket=self.num_slots))

    # ---- the controller ----------------------------------------------------------------------------
    def run(self, params, requests: list[Request], arrays, key: jax.Array, version, *, continuous: bool,
            feed: RequestFeed | None = None, interrupt: Callable[[], bool] | None = None,
            tally=None, keep: KeptPages | None = None) -> Iterator[Completion]:
        """Serves `requests`, and those `feed` adds before each chunk (blocking on `feed.wait()` when idle).
        `interrupt()` is asked before each chunk: once True, every running and pending sequence is handed out
        as a `PARTIAL` completion (its tokens so far) and the run ends. `tally`: a `SamplerStats` that also
        counts this call's decode chunks. `keep`: the running sequences an interruption hands out keep their
        slots and pages there, and requests naming them (`Request.kept`) continue them (`page_carry`)."""
        queue = RequestQueue(requests, lambda index, request: (index, tuple(range(request.samples))))
        requests = queue.requests  # grown in place as the feed adds requests
        state, slots, kept = keep.take() if keep is not None else (None, None, set())
        if slots is None:
            slots = PagedSlots(requests, num_slots=self.num_slots, replicas=self.replicas,
                               pages_per_replica=self.pages_per_replica, page_size=self.page_size,
                               max_pages=self.max_pages, chunk_steps=self.chunk_steps)
            state = self.new_state()
        if claimed := claim(slots, requests, kept, queue.pending):
            state = self._retag(state, *retag_rows(claimed, requests, self.num_slots))
        pending = queue.pending
        while True:
            if interrupt is not None and interrupt():
                yield from self._interrupted(state, slots, pending, version, keep)
                return
            if not queue.refill(feed, idle=slots.idle()):
                return
            if continuous or slots.idle():
                state = self._admit_pending(params, state, slots, pending, key, arrays)
            preempted = slots.grow_for_next_chunk()
            for prompt, sample in preempted:
                pending.appendleft((prompt, (sample,)))
            self.stats.preemptions += len(preempted)
            running = slots.running()
            self.stats.peak_pages = max(self.stats.peak_pages, slots.pool.held())
            if not running:
                continue
            state, finished, num_generated, finish = self._decode_chunk(params, state, slots, running, key, arrays,
                                                                        tally)
            if finished:
                yield from self._hand_out(state, slots, finished, num_generated, finish, version)

    def _admit_pending(self, params, state, slots: PagedSlots, pending, key, arrays):
        """Admits pending requests, in order, while a replica has room for the next one (`PagedSlots.admit`: a group
        that no single replica holds is split over several), then prefills them, contexts of one length class at
        a time."""
        shared = slots.shared_references
        admitted = slots.admit(pending)
        self.stats.shared_page_references += slots.shared_references - shared
        if admitted:
            # one prefill per length class (a power of two of pages): a prefill call computes every row as long as
            # its longest, and carried partial rollouts mix contexts of every length with short prompts
            classes: dict[int, list] = {}
            for item in admitted:
                pages = pow2_at_least(pages_for(slots.requests[item[0]].size, self.page_size), self.max_pages)
                classes.setdefault(pages, []).append(item)
            for pages in sorted(classes):
                state = self._admit(params, state, slots.requests, classes[pages], slots.table, slots.held, key, arrays)
            return state
        if slots.idle():
            prompt = pending[0][0]
            raise ValueError(
                f"paged sampler: not one sample of request {prompt} ({slots.requests[prompt].size} tokens) fits an "
                f"empty replica of {self.pages_per_replica} pages of {self.page_size} tokens; raise "
                "CacheConfig.pages_per_replica"
            )
        return state

    def _decode_chunk(self, params, state, slots: PagedSlots, running: list[int], key, arrays, tally=None):
        """One decode chunk on the running slots' live bucket (`live_rows`) over a power-of-two number of
        page-table columns; returns the state and the finished
        slots with every slot's response length and finish code. Raises when the chunk ran no step and finished
        nothing (the host and the device disagree)."""
        page = self.page_size
        limits = np.array([len(h) * page for h in slots.held], np.int32)
        if self.decode_attention is DecodeAttention.PALLAS:  # the kernel stops at each row's length: one window
            window = self.max_pages
        else:
            window = pow2_at_least(max(len(slots.held[s]) for s in running), self.max_pages)
        before = int(slots.cache_length[running].sum())
        # copies: the CPU client may read an aligned numpy argument when the program runs, after this call
        # returns (clearing `evict` in place below once hid an eviction from the chunk: every chunk stalled)
        live = live_rows(running, num_slots=self.num_slots, replicas=self.replicas, compact=self.live_buckets)
        state, steps = self._decode(window, params, state, (slots.table.copy(),), limits, slots.evict.copy(), live, key,
                                    arrays, np.int32(self.chunk_steps))
        slots.evict[:] = False
        done, num_generated, finish = jax.device_get((state.done, state.num_generated, state.finish))
        steps = int(steps)
        slots.record_generated(running, num_generated)
        after = int(slots.cache_length[running].sum())
        for stats in (self.stats, tally)[: 1 + (tally is not None)]:
            stats.record_chunk(steps, window=window, bucket=live.shape[1], rows=live.size, slots=self.num_slots,
                               live_tokens=after - before)
        self.stats.record_memory(steps, reserved=slots.pool.held() * page, cached=(before + after) / 2)
        finished = [slot for slot in running if done[slot]]
        if steps == 0 and not finished:
            lengths = jax.device_get(state.cache.lengths)
            raise DecodeStalledError.describe(CacheLayout.PAGED, self.stats.decode_calls, running, done, lengths,
                                              limits)
        return state, finished, num_generated, finish

    def _interrupted(self, state, slots: PagedSlots, pending, version, keep: KeptPages | None
                     ) -> Iterator[Completion]:
        """Every running sequence's tokens so far and every pending one (none), as `PARTIAL` completions; with
        `keep`, the running ones keep their slots there (`page_carry`)."""
        running = slots.running()
        if running:
            num_generated = jax.device_get(state.num_generated)
            yield from self._hand_out(state, slots, running, num_generated, None, version, FinishReason.PARTIAL,
                                      keep=keep is not None)
            if keep is not None:
                keep.keep(state, slots, {slots.owners[slot]: slot for slot in running})
        for prompt, samples in pending:
            for sample in samples:
                yield unstarted(prompt, sample, slots.requests[prompt].tokens, version)

    def _hand_out(self, state, slots: PagedSlots, finished: list[int], num_generated, finish, version,
                  reason: FinishReason | None = None, *, keep: bool = False) -> Iterator[Completion]:
        """Completions of the `finished` slots (their tokens past the slot's `offset`), whose pages return to the
        pool unless `keep` (their offsets then move past the tokens handed out); `reason`: instead of the finish
        codes."""
        tokens, logprobs, routing = jax.device_get(
            self._rows(state.tokens, state.logprobs, state.routing, padded_rows(finished, self.num_slots)))
        for row, slot in enumerate(finished):
            prompt, sample = slots.owners[slot]
            n, first = int(num_generated[slot]), int(slots.offset[slot])
            size = slots.requests[prompt].size
            if keep:
                slots.offset[slot] = n
            else:
                slots.release(slot)
            yield Completion(prompt_index=prompt, sample_index=sample, prompt_ids=slots.requests[prompt].tokens.copy(),
                             response_ids=np.array(tokens[row, first:n]),
                             behaviour_logprobs=np.array(logprobs[row, first:n]),
                             finish_reason=reason or FINISH_CODES[int(finish[slot])], version=version,
                             expert_ids=None if routing is None else np.array(routing[row, :size + n]))

    def _admit(self, params, state, requests, admitted, table, held, key, arrays):
        """Chunked prefill of the admitted prompts through their first sample's pages, then the start of every sample."""
        page = self.page_size
        by_replica = [[] for _ in range(self.replicas)]
        for item in admitted:
            by_replica[item[2][0] // self.slots_per_replica].append(item)
        per_replica = pow2_at_least(max(map(len, by_replica)), self.slots_per_replica)
        p = per_replica * self.replicas  # prefill rows, replica-major like the slots
        lengths = np.zeros((p,), np.int64)
        prefill_table = np.zeros((p, self.max_pages), np.int32)
        lead_slots = np.full((p,), self.num_slots, np.int32)  # prefill row -> its first sample's slot (routing)
        for replica, items in enumerate(by_replica):
            for i, (prompt, _, slots) in enumerate(items):
                row = replica * per_replica + i
                lengths[row] = requests[prompt].size
                prefill_table[row] = table[slots[0]]
                lead_slots[row] = slots[0]
        logits = jnp.zeros((p, self.cfg.vocab_size), jnp.float32, device=self._logits)  # made where it is read
        longest = int(lengths.max())
        chunk = min(self.prefill_chunk, longest)
        chunk = pow2_at_least(chunk, self.prefill_chunk)  # few chunk shapes
        for start in range(0, longest, chunk):
            counts = np.clip(lengths - start, 0, chunk).astype(np.int32)
            tokens = np.zeros((p, chunk), np.int32)
            for replica, items in enumerate(by_replica):
                for i, (prompt, _, _) in enumerate(items):
                    row = replica * per_replica + i
                    tokens[row, : counts[row]] = requests[prompt].tokens[start: start + counts[row]]
            ends = (lengths > start) & (lengths <= start + chunk)
            window = pow2_at_least(pages_for(min(longest, start + chunk), page), self.max_pages)
            state, logits = self._prefill(window, params, state, (prefill_table,), np.full((p,), start, np.int32), tokens,
                                          counts, ends, logits, lead_slots)
            self.stats.prefill_calls += 1
        self.stats.prefilled_prompts += len(admitted)

        rows = start_row_arrays(requests, by_replica, held, slots_per_replica=self.slots_per_replica,
                                page_size=self.page_size, pages_per_replica=self.pages_per_replica)
        return self._start(state, logits, *rows, key, arrays)


def _checked_decode_attention(cache: CacheConfig, cfg: ModelConfig, mesh: Mesh | None) -> DecodeAttention:
    """The cache's decode attention, the Pallas kernel refused on devices it does not compile for."""
    if cache.decode_attention is DecodeAttention.PALLAS:
        platform = (jax.devices() if mesh is None else mesh.devices.flat)[0].platform
        check_kernel(platform, page_size=cache.page_size, head_dim=cfg.head_dim, interpret=cache.pallas_interpret,
                     where="paged sampler")
    return cache.decode_attention


def start_row_arrays(requests, by_replica, held, *, slots_per_replica: int, page_size: int,
                     pages_per_replica: int) -> list[np.ndarray]:
    """`start_rows`' per-replica arrays for the admitted entries `by_replica` (a list per slot replica of (prompt,
    samples, slots), in prefill-row order): [r q] lead rows, the replica-local slots of their groups' first samples
    (where the prefill wrote the prompt's routing), replica-local slots, prompt lengths, key indices (prompt, sample) and budgets,
    then [r c] page copies (source, target) of each page group, each padded to a power of two."""
    replicas = len(by_replica)
    q = pow2_at_least(max(sum(len(item[1]) for item in items) for items in by_replica), slots_per_replica)
    slot_ids = np.full((replicas, q), slots_per_replica, np.int32)  # past the replica's slots: dropped
    lead_rows, lead_slots, prompt_lengths, prompt_index, sample_index = (np.zeros((replicas, q), np.int32)
                                                                         for _ in range(5))
    row_budgets = np.ones((replicas, q), np.int32)
    copies = [[] for _ in range(replicas)]  # (source page, target page): each later sample's own last page
    for replica, items in enumerate(by_replica):
        j = 0
        for i, (prompt, samples, slots) in enumerate(items):
            request = requests[prompt]
            for sample, slot in zip(samples, slots, strict=True):
                slot_ids[replica, j], lead_rows[replica, j] = slot % slots_per_replica, i
                lead_slots[replica, j] = slots[0] % slots_per_replica
                prompt_lengths[replica, j] = request.size
                prompt_index[replica, j] = request.key_index
                sample_index[replica, j] = request.first_sample + sample
                row_budgets[replica, j] = request.budget
                if request.size % page_size and slot != slots[0]:
                    copies[replica].append((held[slots[0]][-1], held[slot][-1]))
                j += 1
    c = pow2_at_least(max(1, *map(len, copies)), slots_per_replica)
    copy_source = np.zeros((replicas, c), np.int32)
    copy_target = np.full((replicas, c), pages_per_replica, np.int32)  # past the pool: dropped
    for replica, pairs in enumerate(copies):
        if pairs:
            copy_source[replica, : len(pairs)], copy_target[replica, : len(pairs)] = np.array(pairs, np.int32).T
    return [lead_rows, lead_slots, slot_ids, prompt_lengths, prompt_index, sample_index, row_budgets, (copy_source,),
            (copy_target,)]
