"""Decode chunks on live buckets (`rpegjax.generate.live_rows`): same sequences as decoding every slot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig
from rpegjax.generate import contiguous_sampler, paged_sampler
from rpegjax.generate.live_rows import least_busy_first, live_rows, put_rows, take_rows

GREEDY = SamplingConfig(max_new_tokens=24, greedy=True, ignore_eos=True)
SAMPLED = SamplingConfig(max_new_tokens=24, temperature=0.9, top_k=20, top_p=0.9)
# a long tail: most rows end within a few steps, a few run the whole budget, so buckets shrink to 1 and 2
BUDGETS = [24, 2, 3, 1, 2, 20, 1, 2, 3, 1, 2, 2]
PROMPT_LENGTHS = [3, 8, 1, 4, 6, 2, 5, 7, 3, 2, 8, 4]
SHAPE = dict(num_slots=8, max_prompt_len=8, max_new_tokens=24, chunk_steps=2, window_step=8)
LAYOUTS = {"contiguous": None, "paged": CacheConfig.paged(page_size=4, pages_per_replica=24, prefill_chunk=4)}


def test_admission_fills_the_least_busy_replica_first():
    """Replica 0 (slots 0-3) runs 3, replica 1 (4-7) runs 1: its free slots come first until both run 3, then they
    alternate; so four new sequences leave both replicas at 4 running (a bucket of 4, not 8 on one)."""
    order = least_busy_first([3, 5, 6, 7], [0, 1, 2, 4], num_slots=8, replicas=2)
    assert order == [5, 6, 3, 7]
    assert least_busy_first([2, 0, 1], [], num_slots=4, replicas=1) == [2, 0, 1]  # one replica: as given


def test_live_rows_pads_each_replica_to_a_power_of_two_with_its_own_free_slots():
    rows = live_rows([1, 2, 3, 6, 9], num_slots=12, replicas=2)  # replica 0: slots 0-5, replica 1: 6-11
    assert rows.shape == (2, 4)  # 3 running in replica 0 -> a bucket of 4
    assert rows[0].tolist() == [1, 2, 3, 0] and rows[1].tolist() == [0, 3, 1, 2]  # replica-local ids
    for block in rows:
        assert len(set(block.tolist())) == 4  # padding rows are distinct free slots: the scatter back is exact
    assert live_rows([5], num_slots=6, replicas=1).tolist() == [[5]]
    assert live_rows(range(6), num_slots=6, replicas=1).shape == (1, 6)  # capped at the slots of a replica
    assert live_rows([5], num_slots=6, replicas=1, compact=False).tolist() == [list(range(6))]


def test_take_and_put_rows_equal_numpy_indexing():
    x = np.arange(8 * 3 * 10 * 2, dtype=np.float32).reshape(8, 3, 10, 2)
    live = np.array([[3, 0], [1, 2]], np.int32)  # replica 1 holds slots 4-7
    slots = [3, 0, 5, 6]
    np.testing.assert_array_equal(take_rows(jnp.asarray(x), live), x[slots])
    np.testing.assert_array_equal(take_rows(jnp.asarray(x), live, window=4), x[slots][:, :, :4])
    new = -np.ones((4, 3, 4, 2), np.float32)
    expected = x.copy()
    expected[np.array(slots)[:, None], :, np.arange(4)[None, :]] = new.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(put_rows(jnp.asarray(x), live, jnp.asarray(new), window=4), expected)


def test_a_full_bucket_is_every_slot_in_slot_order_sliced_not_gathered():
    """5 of replica 0's 6 slots run: its bucket is capped at 6, every slot, so both replicas list their slots in slot
    order; take / put then equal numpy's slice and write-back, compiled without a gather or scatter."""
    rows = live_rows([5, 0, 1, 2, 3], num_slots=12, replicas=2)
    assert rows.tolist() == [list(range(6))] * 2
    x = np.arange(12 * 3 * 10 * 2, dtype=np.float32).reshape(12, 3, 10, 2)
    np.testing.assert_array_equal(take_rows(jnp.asarray(x), rows, window=4), x[:, :, :4])
    np.testing.assert_array_equal(take_rows(jnp.asarray(x), rows), x)
    new = -np.ones((12, 3, 4, 2), np.float32)
    expected = x.copy()
    expected[:, :, :4] = new
    np.testing.assert_array_equal(put_rows(jnp.asarray(x), rows, jnp.asarray(new), window=4), expected)
    hlo = jax.jit(lambda x, rows, new: put_rows(x, rows, take_rows(x, rows, window=4) + new, window=4)).lower(
        x, rows, new).as_text()
    assert "gather" not in hlo and "scatter" not in hlo


@pytest.fixture(scope="module")
def samplers(tiny_cfg, tiny_split):
    """Per layout: (live buckets, every slot) samplers of one shape."""
    return {name: tuple(Sampler(tiny_cfg, tiny_split[0], **SHAPE, cache=cache, live_buckets=live)
                        for live in (True, False)) for name, cache in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("sampling", [GREEDY, pytest.param(SAMPLED, marks=pytest.mark.slow)], ids=["greedy", "sampled"])
def test_live_buckets_give_the_same_tokens_and_logprobs_as_every_slot(samplers, layout, sampling, tiny_split,
                                                                      make_prompts):
    """Identical tokens and finish reasons, behaviour log-probs within 1e-5, while later chunks decode 1 or 2 rows
    instead of 8. (Not bit-identical: each bucket size is its own XLA program, and the CPU backend's matmuls of
    1-2 rows round differently from those of 8, about 1e-6 on the logits.)"""
    live, every = samplers[layout]
    prompts = make_prompts(PROMPT_LENGTHS, seed=4)
    kwargs = dict(key=jax.random.key(7), budgets=BUDGETS)
    expected = every.generate(tiny_split[1], prompts, sampling, **kwargs)
    before = live.stats.live_row_steps
    got = live.generate(tiny_split[1], prompts, sampling, **kwargs)
    assert [c.order for c in got] == [c.order for c in expected]
    assert [c.response_ids.tolist() for c in got] == [c.response_ids.tolist() for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)
    assert [c.length for c in got] == BUDGETS
    assert {bucket for _, bucket in every.stats.chunks_per_shape} == {8}
    assert min(bucket for _, bucket in live.stats.chunks_per_shape) <= 2
    # one step per running row and token but the first (sampled at admission)
    assert live.stats.live_row_steps - before == sum(BUDGETS) - len(BUDGETS)
    assert live.stats.live_row_steps == every.stats.live_row_steps
    assert live.stats.bucket_occupancy() > 0.6 > every.stats.bucket_occupancy()
    assert every.stats.slot_occupancy() == every.stats.bucket_occupancy()
    assert {bucket for _, bucket in live.stats.chunks_per_shape} <= {1, 2, 4, 8}
    # one program per (window, bucket) and sampling switches (greedy and sampled runs share the module's samplers)
    assert len(live.stats.chunks_per_shape) <= live.compile_counts()["decode"] <= 2 * len(live.stats.chunks_per_shape)


@pytest.mark.slow  # 8 devices, its own programs: ~100 s on the loaded machine
def test_sharded_live_buckets_equal_unsharded(tiny_cfg, tiny_split, make_prompts):
    """fsdp 4 x tensor 2, paged: each of the 4 slot replicas compacts its own running slots (gathers stay on the
    replica's devices), same sequences as the unsharded sampler that decodes every slot."""
    from rpegjax.generate import reshard_params
    from rpegjax.sharding import make_mesh

    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    sharded = Sampler(tiny_cfg, tiny_split[0], **SHAPE, mesh=mesh, cache=LAYOUTS["paged"])
    every = Sampler(tiny_cfg, tiny_split[0], **SHAPE, live_buckets=False)
    prompts = make_prompts(PROMPT_LENGTHS, seed=4)
    kwargs = dict(key=jax.random.key(7), budgets=BUDGETS)
    expected = every.generate(tiny_split[1], prompts, SAMPLED, **kwargs)
    got = sharded.generate(reshard_params(tiny_split[1], mesh, sharded.rules), prompts, SAMPLED, **kwargs)
    assert [c.response_ids.tolist() for c in got] == [c.response_ids.tolist() for c in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)
    assert min(bucket for _, bucket in sharded.stats.chunks_per_shape) == 1  # one running slot in a replica


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_freed_slots_refill_while_prompts_wait(samplers, layout, tiny_split, make_prompts, monkeypatch):
    """Continuous batching: every chunk that starts while prompts are still waiting decodes every slot."""
    live, _ = samplers[layout]
    module = contiguous_sampler if layout == "contiguous" else paged_sampler
    handed_out, running_per_chunk = [], []

    def spy(running, **kwargs):
        running_per_chunk.append((len(running), len(handed_out)))
        return live_rows(running, **kwargs)

    monkeypatch.setattr(module, "live_rows", spy)
    prompts = make_prompts(PROMPT_LENGTHS, seed=4)
    for completion in live.stream(tiny_split[1], prompts, GREEDY, key=jax.random.key(7), budgets=BUDGETS):
        handed_out.append(completion)
    waiting = [(running, done) for running, done in running_per_chunk if done + running < len(prompts)]
    assert waiting and all(running == SHAPE["num_slots"] for running, _ in waiting)
