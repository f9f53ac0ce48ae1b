"""Admission across slot replicas (`PagedSlots.admit`): no replica idles while a request waits, and the tokens do not
depend on where a sample runs."""

import collections

import jax
import numpy as np
import pytest

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig, reshard_params
from rpegjax.generate.paged_slots import PagedSlots
from rpegjax.generate.requests import Request
from rpegjax.sharding import make_mesh


def _slots(requests, *, replicas=2, num_slots=8, pages_per_replica=64) -> PagedSlots:
    return PagedSlots(requests, num_slots=num_slots, replicas=replicas, pages_per_replica=pages_per_replica,
                      page_size=4, max_pages=8, chunk_steps=2)


def _group(index: int, size: int = 6, samples: int = 4) -> Request:
    return Request(tokens=np.arange(size, dtype=np.int32), budget=8, samples=samples, key_index=index)


def test_a_group_no_replica_holds_is_split_over_the_free_slots():
    """Two replicas of 4 slots, each with 2 free: the next group of 4 fits neither whole, so 2 samples go to each
    (before, it waited at the head of the queue while 4 slots idled); the group after it waits, no slot idles.
    With 3 slots free in all, a group of 4 waits (it would start in part: its samples share one prefill)."""
    slots = _slots([_group(i) for i in range(4)])
    assert slots.admit(collections.deque([(0, (0, 1, 2, 3)), (1, (0, 1, 2, 3))])) == [
        (0, (0, 1, 2, 3), [0, 1, 2, 3]), (1, (0, 1, 2, 3), [4, 5, 6, 7])]
    for slot in (0, 1, 5, 6):
        slots.release(slot)
    pending = collections.deque([(2, (0, 1, 2, 3)), (3, (0, 1, 2, 3))])
    assert slots.admit(pending) == [(2, (0, 1), [0, 1]), (2, (2, 3), [5, 6])]
    assert list(pending) == [(3, (0, 1, 2, 3))] and all(owner is not None for owner in slots.owners)
    # each part shares its own copy of the prompt's full page: one prefill per replica
    assert slots.held[0][0] == slots.held[1][0] and slots.held[5][0] == slots.held[6][0]
    for slot in (0, 5, 6):
        slots.release(slot)
    assert slots.admit(pending) == [] and list(pending) == [(3, (0, 1, 2, 3))]


def test_a_whole_group_goes_to_the_least_busy_replica():
    """A group goes whole to the replica with the most free slots (a chunk's live bucket is as wide as the busiest
    replica's running sequences); when none holds it whole, it is spread one sample per free slot."""
    slots = _slots([_group(0, samples=3), _group(1, samples=1), _group(2, samples=2), _group(3, samples=2)])
    slots.admit(collections.deque([(0, (0, 1, 2)), (1, (0,))]))
    assert [slots.replica_of(s) for s in slots.running()] == [0, 0, 0, 1]
    assert slots.admit(collections.deque([(2, (0, 1))])) == [(2, (0, 1), [5, 6])]
    # now 3 and 3 running: the next group of 2 fits neither whole, one sample each
    assert slots.admit(collections.deque([(3, (0, 1))])) == [(3, (0,), [3]), (3, (1,), [7])]


def test_no_replica_idles_while_a_request_waits():
    """Random skewed occupancy, groups of 1 to 4 on 3 replicas of 4 slots (pages plentiful): after admission either
    nothing waits or the free slots of every replica together cannot take the next request (a group waits for
    room rather than start in part: its samples share a prefill)."""
    rng = np.random.default_rng(0)
    for trial in range(50):
        requests = [_group(i, size=int(rng.integers(1, 12)), samples=int(rng.integers(1, 5))) for i in range(12)]
        slots = _slots(requests, replicas=3, num_slots=12)
        pending = collections.deque((i, tuple(range(r.samples))) for i, r in enumerate(requests))
        for _ in range(4):
            slots.admit(pending)
            free = sum(owner is None for owner in slots.owners)
            assert not pending or free < len(pending[0][1]), trial
            for slot in slots.running():
                if rng.random() < 0.5:
                    slots.release(slot)


KEYS = 16  # keys tried for a run that splits a group (with the inverse-CDF sampler, key 6 is the first)


def test_split_groups_sample_the_same_tokens(tiny_cfg, tiny_split, make_prompts):
    """Two slot replicas of 4 slots, groups of 4 whose samples end apart (a quarter of the vocabulary stops a
    response): under the first key that splits a group over the replicas (more prefills than prompts), and under
    every key tried before it, every sequence equals the unsharded sampler's: a sample's tokens depend on its
    (prompt, sample, step) key, not on its replica or slot."""
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.9, stop_ids=tuple(range(1, tiny_cfg.vocab_size, 4)))
    shape = dict(num_slots=8, max_prompt_len=8, max_new_tokens=12, chunk_steps=3)
    mesh = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    split = Sampler(tiny_cfg, tiny_split[0], **shape, mesh=mesh, cache=CacheConfig.paged(page_size=4, prefill_chunk=8))
    reference = Sampler(tiny_cfg, tiny_split[0], **shape)
    prompts = make_prompts([5, 8, 3, 6, 7, 4], seed=3)
    params = reshard_params(tiny_split[1], mesh, split.rules)
    for seed in range(KEYS):  # where samples end is drawn: the first key under which a group is split
        kwargs = dict(group_size=4, key=jax.random.key(seed), budgets=[12, 2, 3, 12, 5, 1])
        prefilled = split.stats.prefilled_prompts
        got = split.generate(params, prompts, sampling, **kwargs)
        expected = reference.generate(tiny_split[1], prompts, sampling, **kwargs)
        assert [c.response_ids.tolist() for c in got] == [c.response_ids.tolist() for c in expected]
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)
        if split.stats.prefilled_prompts - prefilled > len(prompts):  # some group ran on both replicas
            break
    else:
        pytest.fail(f"none of {KEYS} keys split a group over the replicas")
