"""The Pallas paged-attention decode (`DecodeAttention.PALLAS`) against the gathered path, in Pallas interpret mode
(the kernel is a CUDA kernel: on CPU it runs only interpreted). Tiny shapes: interpret mode is slow."""

import jax
import numpy as np
import pytest

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.generate.paged_cache import CacheConfig
from rpegjax.models.full_attention import POOL_AXES, attend_pages
from rpegjax.models.paged_attention import kernel_blocks, paged_decode_attention
from rpegjax.generate.weight_sync import generation_rules
from rpegjax.options import DecodeAttention
from rpegjax.sharding import make_mesh
from rpegjax.sharding.rules import ActivationSharding


def _gathered(q, pool_k, pool_v, table, positions):
    """The gathered path per replica (`attend_pages` over the full table: masked past each row's index)."""
    r = pool_k.shape[0]
    split = lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:])  # noqa: E731
    out = jax.vmap(lambda k, v, t, q, i: attend_pages(q, k[:, t], v[:, t], i))(
        pool_k, pool_v, split(table), split(q), split(positions))
    return out.reshape(q.shape)


def test_kernel_equals_the_gathered_pages_on_rows_of_very_different_lengths():
    """4 slot replicas (fsdp 4 x tensor 2: a replica's pool and one of 2 KV heads per device), 2 rows each, GQA
    (4 query heads on 2 KV heads), rows from 1 key to a full 5-page table: the kernel inside `shard_map` equals the
    gathered path at 1e-5 in float32, unsharded too; a row that is not live (finished, bucket padding) reads nothing
    and gives 0."""
    r, rows, kv, g, pages, n, e, m = 4, 2, 2, 2, 12, 4, 16, 5
    keys = jax.random.split(jax.random.key(0), 3)
    pool_k, pool_v = (jax.random.normal(k, (r, kv, pages, n, e)) for k in keys[:2])
    q = jax.random.normal(keys[2], (r * rows, 1, kv * g, e))
    rng = np.random.default_rng(0)
    table = np.stack([rng.permutation(pages)[:m] for _ in range(r * rows)]).astype(np.int32)
    positions = np.array([[0], [19], [3], [4], [11], [1], [17], [8]], np.int32)  # cache index of the new token
    live = np.array([True] * 5 + [False] + [True] * 2)
    expected = _gathered(q, pool_k, pool_v, table, positions).at[5].set(0.0)

    plain = paged_decode_attention(q, pool_k, pool_v, table, positions, live, sharding=None, pool_spec=None,
                                   interpret=True)
    np.testing.assert_allclose(plain, expected, atol=1e-5, rtol=0)

    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    sharding = ActivationSharding(mesh, generation_rules())
    spec = sharding.spec(POOL_AXES, pool_k.shape)
    assert spec == jax.sharding.PartitionSpec("fsdp", "tensor", None, None, None)
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in (pool_k, pool_v)]
    run = jax.jit(lambda q, k, v, t, i, live: paged_decode_attention(q, k, v, t, i, live, sharding=sharding,
                                                                     pool_spec=spec, interpret=True))
    np.testing.assert_allclose(run(q, *placed, table, positions, live), expected, atol=1e-5, rtol=0)


def test_kernel_blocks_tile_any_table_width():
    assert kernel_blocks(5) == (4, 2, 8)
    assert kernel_blocks(1) == (1, 1, 1)
    assert kernel_blocks(1024) == (8, 16, 1024)
    assert kernel_blocks(257) == (8, 16, 384)


GREEDY = SamplingConfig(max_new_tokens=6, greedy=True, ignore_eos=True)


def _sampler(cfg, graphdef, attention, **shape):
    cache = CacheConfig.paged(page_size=4, prefill_chunk=8, decode_attention=attention,
                              pallas_interpret=attention is DecodeAttention.PALLAS)
    return Sampler(cfg, graphdef, num_slots=4, max_prompt_len=8, max_new_tokens=6, chunk_steps=3, cache=cache,
                   **shape)


def test_greedy_sampler_with_the_kernel_equals_the_gathered_path(tiny_cfg, tiny_split, make_prompts):
    """A greedy run of prompts of 1 to 8 tokens with different budgets (rows of very different lengths in each
    step): the same tokens, and behaviour log-probs at 1e-5, with each row reading its own pages."""
    prompts = make_prompts([8, 1, 5, 2], seed=4)
    kwargs = dict(key=jax.random.key(2), budgets=[6, 2, 5, 1])
    expected = _sampler(tiny_cfg, tiny_split[0], DecodeAttention.GATHER).generate(tiny_split[1], prompts, GREEDY,
                                                                                  **kwargs)
    got = _sampler(tiny_cfg, tiny_split[0], DecodeAttention.PALLAS).generate(tiny_split[1], prompts, GREEDY, **kwargs)
    assert [c.response_ids.tolist() for c in got] == [c.response_ids.tolist() for c in expected]
    assert [c.length for c in got] == [6, 2, 5, 1]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)


def test_the_kernel_is_refused_off_gpu_and_on_a_contiguous_cache(tiny_cfg, tiny_split):
    with pytest.raises(ValueError, match=r"paged sampler: decode_attention=pallas runs the Pallas paged-attention "
                                         r"kernel, a CUDA \(Triton\) kernel; the sampler's devices are 'cpu'"):
        Sampler(tiny_cfg, tiny_split[0], num_slots=4, max_prompt_len=8, max_new_tokens=6,
                cache=CacheConfig.paged(decode_attention="pallas"))
    with pytest.raises(ValueError, match="CacheConfig.decode_attention=pallas reads a paged pool; the contiguous"):
        CacheConfig(decode_attention="pallas")
    with pytest.raises(ValueError, match=r"CacheConfig.decode_attention must be one of \['gather', 'pallas'\]"):
        CacheConfig.paged(decode_attention="flash")


@pytest.mark.slow  # ~50 s loaded: the kernel in shard_map is covered fast above
def test_kernel_logits_equal_on_a_sharded_sampler(tiny_cfg, tiny_split, make_prompts):
    """Data 4 x tensor 2: each replica's rows through the kernel on its own devices; greedy tokens equal the
    unsharded gathered run."""
    from rpegjax.generate import reshard_params

    mesh = make_mesh({"data": 4, "tensor": 2})
    prompts = make_prompts([3, 8, 1, 6, 2], seed=1)
    kwargs = dict(key=jax.random.key(0), budgets=[6, 1, 4, 2, 5])
    expected = _sampler(tiny_cfg, tiny_split[0], DecodeAttention.GATHER).generate(tiny_split[1], prompts, GREEDY,
                                                                                  **kwargs)
    sharded = Sampler(tiny_cfg, tiny_split[0], num_slots=8, max_prompt_len=8, max_new_tokens=6, chunk_steps=3,
                      mesh=mesh, cache=CacheConfig.paged(page_size=4, prefill_chunk=8, decode_attention="pallas",
                                                         pallas_interpret=True))
    got = sharded.generate(reshard_params(tiny_split[1], mesh, sharded.rules), prompts, GREEDY, **kwargs)
    assert [c.response_ids.tolist() for c in got] == [c.response_ids.tolist() for c in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)
