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


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_fed_requests_equal_the_same_contexts_as_prompts(tiny_cfg, tiny_split, make_prompts, layout):
    graphdef, params = tiny_split
    cache = CacheConfig.paged(page_size=4) if layout == "paged" else None
    sampler = Sampler(tiny_cfg, graphdef, num_slots=2, max_prompt_len=4, max_new_tokens=6, chunk_steps=3,
                      window_step=8, cache=cache)
    prompt, long_context = make_prompts([3, 7], seed=11)  # 7 > max_prompt_len: only as a fed request
    feed = Feed([Request(tokens=np.array(long_context), budget=3, samples=2, key_index=5, first_sample=4)])
    out = list(sampler.stream(params, [prompt], SAMPLING, group_size=1, key=jax.random.key(0), feed=feed))
    assert feed.fed == 1 and [c.order for c in out] == [(0, 0), (1, 0), (1, 1)]
    fed = out[1:]
    assert all(c.prompt_ids.tolist() == long_context and c.length <= 3 for c in fed)

    # the reference: a sampler whose prompts may be that long; samples 4 and 5 of prompt 5 draw the same keys
    wide = Sampler(tiny_cfg, graphdef, num_slots=6, max_prompt_len=8, max_new_tokens=6, chunk_steps=3, window_step=8)
    grouped = wide.generate(params, [[1]] * 5 + [long_context], SAMPLING, group_size=6, key=jax.random.key(0),
                            budgets=[1] * 5 + [3])
    expected = [c for c in grouped if c.prompt_index == 5 and c.sample_index in (4, 5)]
    for got, want in zip(fed, expected, strict=True):
        assert got.response_ids.tolist() == want.response_ids.tolist()
        np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=1e-5)


def test_a_fed_request_that_does_not_fit_is_refused(sampler, tiny_split):
    too_long = Feed([Request(tokens=np.arange(1, 18), budget=4, key_index=0)])
    with pytest.raises(ValueError, match=r"fed request 0: 17 context tokens \+ budget 4 exceed the sampler's capacity "
                                         r"of 20 tokens"):
        list(sampler.stream(tiny_split[1], [[1, 2]], SamplingConfig(max_new_tokens=4), key=jax.random.key(0),
                            feed=too_long))
