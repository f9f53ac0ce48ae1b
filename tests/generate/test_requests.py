"""Requests fed to a running stream: admitted between chunks with their own PRNG stream, contexts longer than
max_prompt_len when context + budget fit the capacity, equal to the same context run as a prompt."""

import jax
import numpy as np
import pytest

from rpegjax.generate import CacheConfig, Request, Sampler, SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=6, temperature=0.9)


class Feed:
    """Feeds `requests` one by one: the next one after each completion of the stream (never all at once)."""

    def __init__(self, requests):
        self.waiting = list(requests)
        self.fed = 0

    def poll(self):
        return []

    def wait(self):
        if not self.waiting:
            return []
        self.fed += 1
        return [self.waiting.pop(0)]


@pytest.fixture(scope="module")
def contexts(make_prompts):
    return make_prompts([3, 7], seed=11)  # a prompt, and a context longer than max_prompt_len=4 below


@pytest.fixture(scope="module")
def expected(tiny_cfg, tiny_split, contexts):
    """The long context as prompt 5 of a sampler whose prompts may be that long: its samples 4 and 5 draw with
    the PRNG streams (5, 4) and (5, 5)."""
    graphdef, params = tiny_split
    wide = Sampler(tiny_cfg, graphdef, num_slots=6, max_prompt_len=8, max_new_tokens=6, chunk_steps=3, window_step=8)
    grouped = wide.generate(params, [[1]] * 5 + [contexts[1]], SAMPLING, group_size=6, key=jax.random.key(0),
                            budgets=[1] * 5 + [3])
    return [c for c in grouped if c.prompt_index == 5 and c.sample_index in (4, 5)]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_fed_requests_equal_the_same_contexts_as_prompts(tiny_cfg, tiny_split, contexts, expected, layout):
    graphdef, params = tiny_split
    cache = CacheConfig.paged(page_size=4) if layout == "paged" else None
    sampler = Sampler(tiny_cfg, graphdef, num_slots=2, max_prompt_len=4, max_new_tokens=6, chunk_steps=3,
                      window_step=8, cache=cache)
    prompt, long_context = contexts
    feed = Feed([Request(tokens=np.array(long_context), budget=3, samples=2, key_index=5, first_sample=4)])
    out = list(sampler.stream(params, [prompt], SAMPLING, group_size=1, key=jax.random.key(0), feed=feed))
    assert feed.fed == 1 and [c.order for c in out] == [(0, 0), (1, 0), (1, 1)]
    fed = out[1:]
    assert all(c.prompt_ids.tolist() == long_context and c.length <= 3 for c in fed)
    assert len(expected) == 2
    for got, want in zip(fed, expected, strict=True):
        assert got.response_ids.tolist() == want.response_ids.tolist()
        np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=1e-5)


class Ready:
    """Hands out `requests` at the first poll, before anything is admitted."""

    def __init__(self, requests):
        self.requests = requests

    def poll(self):
        requests, self.requests = self.requests, []
        return requests

    def wait(self):
        return []


def test_a_fed_request_that_does_not_fit_is_refused(sampler, tiny_split):
    too_long = Ready([Request(tokens=np.arange(1, 18), budget=4, key_index=0)])  # checked before anything runs
    with pytest.raises(ValueError, match=r"fed request 0: 17 context tokens \+ budget 4 exceed the sampler's capacity "
                                         r"of 20 tokens"):
        list(sampler.stream(tiny_split[1], [[1, 2]], SamplingConfig(max_new_tokens=4), key=jax.random.key(0),
                            feed=too_long))


def test_request_queue_takes_ready_requests_and_blocks_on_the_feed_only_when_idle():
    from rpegjax.generate.requests import RequestQueue

    first, second, third = (Request(tokens=np.array([i + 1]), budget=2, samples=2, key_index=i) for i in range(3))

    class Recorded:
        def __init__(self):
            self.ready, self.later, self.waits = [], [[third], []], 0

        def poll(self):
            ready, self.ready = self.ready, []
            return ready

        def wait(self):
            self.waits += 1
            return self.later.pop(0)

    feed = Recorded()
    queue = RequestQueue([first], lambda index, request: (index, tuple(range(request.samples))))
    assert list(queue.pending) == [(0, (0, 1))]
    feed.ready = [second]
    assert queue.refill(feed, idle=True) and feed.waits == 0  # something waits: no blocking
    assert queue.requests == [first, second] and list(queue.pending) == [(0, (0, 1)), (1, (0, 1))]
    queue.pending.clear()
    assert queue.refill(feed, idle=False) and feed.waits == 0  # slots still run: the controller decodes on
    assert queue.refill(feed, idle=True) and feed.waits == 1 and list(queue.pending) == [(2, (0, 1))]
    queue.pending.clear()
    assert not queue.refill(feed, idle=True) and feed.waits == 2  # the feed has nothing more: done
    assert not RequestQueue([], lambda index, _: index).refill(None, idle=True)  # no feed, nothing left: done
