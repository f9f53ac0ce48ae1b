import jax
import numpy as np
import pytest

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.generate.decode import DecodeStalledError
from rpegjax.generate.paged_cache import CacheConfig, PagePool, pages_for
from rpegjax.options import CacheLayout

SAMPLED = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9)
GREEDY = SamplingConfig(max_new_tokens=12, greedy=True, ignore_eos=True)
PROMPT_LENGTHS = [3, 8, 1, 4, 6, 2, 5]
BUDGETS = [12, 2, 1, 9, 3, 12, 4]


def _paged(cfg, graphdef, **cache) -> Sampler:
    """The conftest sampler's shape (4 slots, prompts <= 8, 12 new tokens, chunks of 3) on a paged cache."""
    return Sampler(cfg, graphdef, num_slots=4, max_prompt_len=8, max_new_tokens=12, chunk_steps=3,
                   cache=CacheConfig.paged(**cache))


def _assert_same(got, expected):
    assert [c.order for c in got] == [c.order for c in expected]
    assert [c.response_ids.tolist() for c in got] == [c.response_ids.tolist() for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def contiguous(tiny_cfg, tiny_split) -> Sampler:
    """The reference layout, same shape (its own sampler: the shared one counts its compiled programs)."""
    return Sampler(tiny_cfg, tiny_split[0], num_slots=4, max_prompt_len=8, max_new_tokens=12, chunk_steps=3,
                   window_step=8)


@pytest.fixture(scope="module")
def small_pool(tiny_cfg, tiny_split):
    """Pages of 4 tokens, a pool of 10 pages (40 tokens for 4 slots of capacity 20: the pool cannot hold every
    slot at full length, so sequences get preempted), prompts prefilled in chunks of 4 tokens."""
    return _paged(tiny_cfg, tiny_split[0], page_size=4, pages_per_replica=10, prefill_chunk=4)


# sampled: slow (35 s; the greedy case runs the same preemption and sharing paths by default)
@pytest.mark.parametrize("sampling", [pytest.param(SAMPLED, marks=pytest.mark.slow), GREEDY], ids=["sampled", "greedy"])
def test_paged_equals_contiguous(contiguous, small_pool, tiny_split, make_prompts, sampling):
    """Same tokens, behaviour log-probs and finish reasons for one key, although the paged run prefills in
    chunks, shares prompt pages within a group and preempts sequences when its small pool runs dry."""
    prompts = make_prompts(PROMPT_LENGTHS, seed=6)
    kwargs = dict(group_size=2, key=jax.random.key(3), budgets=BUDGETS)
    expected = contiguous.generate(tiny_split[1], prompts, sampling, **kwargs)
    before = small_pool.stats.preemptions, small_pool.stats.shared_page_references
    got = small_pool.generate(tiny_split[1], prompts, sampling, **kwargs)
    _assert_same(got, expected)
    assert small_pool.stats.preemptions > before[0]  # the budget really was binding
    assert small_pool.stats.shared_page_references > before[1]  # prompts of 4+ tokens shared a full page
    static = small_pool.generate_static(tiny_split[1], prompts, sampling, **kwargs)
    _assert_same(static, expected)


def _compiled_calls(sampler: Sampler) -> tuple[object, list[str]]:
    names = ["_admit", "_decode", "_rows"] if sampler.paged is None else ["_prefill", "_start", "_decode", "_rows"]
    return sampler.controller, names


@pytest.mark.parametrize("layout", ["contiguous", "small_pool"])
def test_host_never_writes_an_array_it_handed_to_a_compiled_call(request, layout, tiny_split, make_prompts, monkeypatch):
    """The CPU client may read a numpy argument when the program runs, after the call returned (zero-copy
    for aligned buffers), so a host write after the call can change what the program sees (clearing the
    eviction flags in place once made the paged sampler spin forever). Every numpy argument of every
    compiled call turns read-only here: a later write raises at the line that does it."""
    sampler = request.getfixturevalue(layout)
    owner, names = _compiled_calls(sampler)

    def freezing(call):
        def wrapped(*args):
            for leaf in jax.tree.leaves(args):
                if isinstance(leaf, np.ndarray):
                    leaf.flags.writeable = False
            return call(*args)
        return wrapped

    for name in names:
        monkeypatch.setattr(owner, name, freezing(getattr(owner, name)))
    preemptions = sampler.stats.preemptions
    prompts = make_prompts(PROMPT_LENGTHS, seed=6)
    got = sampler.generate(tiny_split[1], prompts, GREEDY, group_size=2, key=jax.random.key(3), budgets=BUDGETS)
    assert [c.length for c in got] == [b for b in BUDGETS for _ in range(2)]
    if layout == "small_pool":
        assert sampler.stats.preemptions > preemptions  # eviction flags were set and handed over


def test_a_decode_chunk_without_progress_raises(contiguous, small_pool, tiny_split, make_prompts, monkeypatch):
    """A chunk that runs no step and finishes nothing is a host/device disagreement: the controller names
    the rows that block the loop instead of dispatching chunks forever. Paged: the decode call loses the
    eviction flags (what the in-place clear above once caused), so a preempted row, free on the host and
    with no pages left, still runs on the device. Contiguous: the chunk is given 0 steps."""
    prompts = make_prompts(PROMPT_LENGTHS, seed=6)
    kwargs = dict(group_size=2, key=jax.random.key(3), budgets=BUDGETS)
    decode = small_pool.paged._decode

    def without_evictions(window, params, state, table, limits, evict, *rest):
        return decode(window, params, state, table, limits, np.zeros_like(evict), *rest)

    monkeypatch.setattr(small_pool.paged, "_decode", without_evictions)
    # every slot decoded: a live bucket would leave the stale row out (unless it pads a bucket) and hide the stall
    monkeypatch.setattr(small_pool.paged, "live_buckets", False)
    with pytest.raises(DecodeStalledError, match=r"paged sampler: decode call \d+ ran 0 steps and finished no sequence "
                       r".* Device rows that stop the loop: slot \d: cache length \d+, limit 0, free on the host[.;] "):
        small_pool.generate(tiny_split[1], prompts, GREEDY, **kwargs)

    contiguous_decode = contiguous.controller._decode
    monkeypatch.setattr(contiguous.controller, "_decode", lambda *args: contiguous_decode(*args[:-1], np.int32(0)))
    with pytest.raises(DecodeStalledError, match=r"contiguous sampler: decode call \d+ ran 0 steps .* stop the loop: "
                                                 r"none\. Running on the host: slots \[0, 1, 2, 3\]"):
        contiguous.generate(tiny_split[1], prompts, GREEDY, **kwargs)


def test_prefix_shared_group_equals_independent_prefill(tiny_cfg, tiny_split, make_prompts):
    """Greedy samples do not depend on the key: a group of 3 sharing one prefill and its full prompt pages
    gives 3 copies of what each prompt gives alone (group 1, its own prefill and pages)."""
    paged = _paged(tiny_cfg, tiny_split[0], page_size=2, prefill_chunk=8)
    prompts = make_prompts([7, 4, 8], seed=11)
    alone = paged.generate(tiny_split[1], prompts, GREEDY, key=jax.random.key(0))
    before = paged.stats.prefilled_prompts, paged.stats.shared_page_references
    grouped = paged.generate(tiny_split[1], prompts, GREEDY, group_size=3, key=jax.random.key(0))
    assert paged.stats.prefilled_prompts - before[0] == 3  # one prefill per prompt, not per sample
    # full prompt pages (3, 2 and 4 of 2 tokens) are referenced by the 2 later samples without a copy
    assert paged.stats.shared_page_references - before[1] == 2 * (3 + 2 + 4)
    for completion in grouped:
        reference = alone[completion.prompt_index]
        assert completion.response_ids.tolist() == reference.response_ids.tolist()
        np.testing.assert_allclose(completion.behaviour_logprobs, reference.behaviour_logprobs, atol=1e-5, rtol=0)


def test_admission_never_exceeds_the_page_budget(tiny_cfg, tiny_split, make_prompts):
    """A pool of 6 pages of 4 tokens (one full-length sequence needs 5) on 4 slots: the pages held never pass
    6, so at most one long sequence runs at a time, and every sequence still completes as the
    contiguous cache (no budget) has it."""
    budget = 6
    paged = _paged(tiny_cfg, tiny_split[0], page_size=4, pages_per_replica=budget, prefill_chunk=8)
    reference = Sampler(tiny_cfg, tiny_split[0], num_slots=4, max_prompt_len=8, max_new_tokens=12, chunk_steps=3)
    prompts = make_prompts([8, 7, 6, 8, 5], seed=2)
    kwargs = dict(key=jax.random.key(1))
    got = paged.generate(tiny_split[1], prompts, SAMPLED.replace(ignore_eos=True), **kwargs)
    _assert_same(got, reference.generate(tiny_split[1], prompts, SAMPLED.replace(ignore_eos=True), **kwargs))
    assert 0 < paged.stats.peak_pages <= budget
    assert paged.new_state().cache.layers[0].k.shape[:3:2] == (1, budget)  # the pool really is that small


def test_page_pool_counts_shared_pages_once():
    pool = PagePool(replicas=2, pages_per_replica=4)
    shared = pool.take(0, 2)
    pool.share(0, shared, 2)  # 3 samples use them
    own = pool.take(0, 1)
    assert (shared, own, pool.num_free(0), pool.num_free(1), pool.held()) == ([0, 1], [2], 1, 4, 3)
    pool.release(0, shared + own)
    pool.release(0, shared)
    assert pool.num_free(0) == 2 and pool.held() == 2
    pool.release(0, shared)
    assert pool.num_free(0) == 4 and pool.held() == 0
    assert pool.take(0, 1) == [0]  # lowest id first: runs are deterministic
    with pytest.raises(ValueError, match="replica 1 has 4 free pages, 5 were asked for"):
        pool.take(1, 5)
    assert pages_for(9, 4) == 3 and pages_for(8, 4) == 2


@pytest.mark.slow  # a sweep of lengths: 30 s
def test_decode_programs_stay_within_the_bound(tiny_cfg, tiny_split, make_prompts):
    """A sweep of sequence lengths up to capacity 64: power-of-two attention windows keep the decode programs
    at most 1 + log2(64 / 8) = 4 (contiguous, window_step 8) and 1 + log2(16) = 5 page windows (paged, pages
    of 4), each with at most 3 live buckets, however many distinct lengths run."""
    shape = dict(num_slots=4, max_prompt_len=16, max_new_tokens=48, chunk_steps=4, window_step=8)
    contiguous = Sampler(tiny_cfg, tiny_split[0], **shape)
    paged = Sampler(tiny_cfg, tiny_split[0], **shape, cache=CacheConfig.paged(page_size=4, prefill_chunk=16))
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0, ignore_eos=True)
    for total in (3, 7, 11, 15, 21, 27, 35, 44, 53, 64):
        prompt = min(16, max(1, total // 3))
        prompts = make_prompts([prompt, max(1, prompt - 1)], seed=total)
        budgets = [total - prompt, max(1, (total - prompt) // 2)]
        for run in (contiguous, paged):
            completions = run.generate(tiny_split[1], prompts, sampling, key=jax.random.key(5), budgets=budgets)
            assert [c.length for c in completions] == budgets
    assert len(contiguous.stats.chunks_per_window) >= 4 and len(paged.stats.chunks_per_window) >= 4
    assert contiguous.compile_counts()["decode"] == len(contiguous.stats.chunks_per_shape)
    assert paged.compile_counts()["decode"] == len(paged.stats.chunks_per_shape)
    assert len(contiguous.stats.chunks_per_window) <= 4 and len(paged.stats.chunks_per_window) <= 5
    assert set(paged.stats.chunks_per_window) <= {1, 2, 4, 8, 16}
    for run in (contiguous, paged):  # live buckets of the 4 slots: 1, 2 or 4 rows
        assert {bucket for _, bucket in run.stats.chunks_per_shape} <= {1, 2, 4}


def test_cache_config_validates_its_fields():
    assert CacheConfig(layout="paged").layout is CacheLayout.PAGED
    with pytest.raises(ValueError, match=r"CacheConfig.layout must be one of \['contiguous', 'paged'\], got 'blocks'"):
        CacheConfig(layout="blocks")
    with pytest.raises(ValueError, match="CacheConfig.page_size must be a positive integer, got 0"):
        CacheConfig.paged(page_size=0)
    with pytest.raises(ValueError, match="CacheConfig.pages_per_replica must be a positive integer or None, got -1"):
        CacheConfig.paged(pages_per_replica=-1)


def test_pool_too_small_for_one_sequence_is_refused(tiny_cfg, tiny_split):
    with pytest.raises(ValueError, match=r"pages_per_replica=4 cannot hold one sequence of the sampler's capacity "
                                         r"\(20 tokens = 5 pages of 4\)"):
        _paged(tiny_cfg, tiny_split[0], page_size=4, pages_per_replica=4)


def test_sharded_paged_equals_unsharded(tiny_cfg, tiny_split, contiguous, make_prompts):
    """fsdp 4 x tensor 2: slots and page pools split over the 4 slot replicas (each device holds 2 of 8
    slots, its replica's pool and one of the 2 KV heads), same sequences as the unsharded contiguous run."""
    from rpegjax.generate import reshard_params
    from rpegjax.sharding import make_mesh

    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    paged = Sampler(tiny_cfg, tiny_split[0], num_slots=8, max_prompt_len=8, max_new_tokens=12, chunk_steps=3,
                    mesh=mesh, cache=CacheConfig.paged(page_size=4, pages_per_replica=8, prefill_chunk=4))
    state = paged.new_state()
    assert {shard.data.shape for shard in state.cache.layers[0].k.addressable_shards} == {(1, 1, 8, 4, 16)}
    assert {shard.data.shape for shard in state.cache.tables[0].addressable_shards} == {(2, 5)}
    prompts = make_prompts(PROMPT_LENGTHS, seed=6)
    kwargs = dict(group_size=2, key=jax.random.key(3), budgets=BUDGETS)
    expected = contiguous.generate(tiny_split[1], prompts, SAMPLED, **kwargs)
    got = paged.generate(reshard_params(tiny_split[1], mesh, paged.rules), prompts, SAMPLED, **kwargs)
    _assert_same(got, expected)


@pytest.mark.parametrize("layout", ["contiguous", "small_pool"])
def test_the_kv_cache_lives_only_while_a_generate_call_runs(request, layout, tiny_split, make_prompts):
    """The planner counts the KV cache as generation's transient (each phase's peak, not generation + training):
    true only if the sampler allocates it per call and drops it when the call returns, so that a colocated update
    never runs beside it."""
    import gc

    sampler = request.getfixturevalue(layout)
    gc.collect()
    before = {id(array) for array in jax.live_arrays()}
    stream = sampler.stream(tiny_split[1], make_prompts(PROMPT_LENGTHS, seed=2), GREEDY, group_size=2,
                            key=jax.random.key(0), budgets=BUDGETS)
    next(stream)  # the first completion: the cache is allocated and in use
    during = [array for array in jax.live_arrays() if id(array) not in before]
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(sampler.new_state().cache))
    largest = sorted(during, key=lambda array: array.nbytes, reverse=True)
    assert sum(array.nbytes for array in largest) >= cache_bytes  # the cache's buffers are live while it runs
    cache_shapes = {leaf.shape for leaf in jax.tree.leaves(sampler.new_state().cache) if leaf.ndim >= 3}
    del during, largest
    list(stream)  # the call ends
    del stream
    gc.collect()
    after = [array for array in jax.live_arrays() if id(array) not in before]
    assert not [array.shape for array in after if array.shape in cache_shapes]


def test_start_samples_each_replicas_rows_on_its_own_devices(tiny_cfg, tiny_split, make_prompts):
    """8 slot replicas of 2 slots, one-sample requests (partial rollouts' carried sequences, up to every slot
    admitted at once): the `start` program gets each replica's prefill logits and start rows on that replica's
    device only (split 8 ways, not replicated: at W-plan shapes replicated logits of every row were 55 GB per
    device), and the sampled tokens and log-probs equal the unsharded paged sampler's."""
    from rpegjax.generate import reshard_params
    from rpegjax.sharding import make_mesh

    mesh = make_mesh({"data": 8})
    shape = dict(num_slots=16, max_prompt_len=8, max_new_tokens=12, chunk_steps=3)
    cache = CacheConfig.paged(page_size=4, prefill_chunk=4)
    unsharded = Sampler(tiny_cfg, tiny_split[0], **shape, cache=cache)
    sharded = Sampler(tiny_cfg, tiny_split[0], **shape, mesh=mesh, cache=cache)
    params = reshard_params(tiny_split[1], mesh, sharded.rules)
    prompts = make_prompts(PROMPT_LENGTHS * 3, seed=11)
    kwargs = dict(group_size=1, key=jax.random.key(5), budgets=BUDGETS * 3)
    _assert_same(sharded.generate(params, prompts, SAMPLED, **kwargs),
                 unsharded.generate(tiny_split[1], prompts, SAMPLED, **kwargs))

    start = sharded.lower_programs(params, SAMPLED, group_size=1)["start"]
    logits, lead = start.compile().input_shardings[0][1:3]
    rows, vocab = 16, tiny_cfg.vocab_size  # one prefill row per slot; [replicas, slots per replica] start rows
    assert logits.shard_shape((rows, vocab)) == (rows // 8, vocab)
    assert lead.shard_shape((8, 2)) == (1, 2)
