import jax
import jax.numpy as jnp
import numpy as np

from rpegjax.generate.completion import EOS_CODE, LENGTH_CODE, RUNNING_CODE, STOP_CODE
from rpegjax.generate.decode import DecodeState, admit, decode, prefill, record_tokens, step_state
from rpegjax.generate.sampling import SamplingConfig, sampling_arrays
from rpegjax.generate.live_rows import live_rows


def test_cache_decode_logits_equal_full_forward_at_every_position(tiny_cfg, tiny_model):
    """Right-padded prefill of prompts of different lengths, then teacher-forced decode steps through
    the sampler's own step function: every step's logits equal the full forward's at that position."""
    lengths = np.array([3, 6, 1])
    steps = 7
    tokens = jax.random.randint(jax.random.key(4), (3, 6 + steps), 0, tiny_cfg.vocab_size)
    full = jax.jit(lambda t: tiny_model(t))(tokens)  # each row unpadded, as one sequence

    cache, first, _ = jax.jit(lambda t, n: prefill(tiny_model, t, n, None))(tokens[:, :6], jnp.asarray(lengths))
    np.testing.assert_allclose(first, full[np.arange(3), lengths - 1], atol=1e-5)

    state = DecodeState.empty(tiny_cfg, 3, 6 + steps, steps)
    grown = cache.capacity
    layers = tuple(layer.replace(k=layer.k.at[..., :grown].set(prefilled.k), v=layer.v.at[:, :, :grown].set(prefilled.v))
                   for layer, prefilled in zip(state.cache.layers, cache.layers))
    state = state.replace(
        cache=state.cache.replace(layers=layers, lengths=cache.lengths),
        done=jnp.zeros(3, bool),
    )
    step = jax.jit(lambda s: step_state(tiny_model, s, None))
    for j in range(steps):
        position = lengths + j
        state = state.replace(last_token=tokens[np.arange(3), position])
        logits, stepped = step(state)
        new_cache = stepped.cache
        if j < steps - 1:  # the last fed token is the last one the full forward has a next-token logit for
            np.testing.assert_allclose(logits, full[np.arange(3), position], atol=1e-5)
        np.testing.assert_array_equal(new_cache.lengths, position + 1)
        state = state.replace(cache=new_cache)


def test_finish_codes_eos_over_stop_over_length(tiny_cfg):
    """Rows with budgets 1, 5, 5, 5 sample (from one-hot logits) tokens 9, 3 (EOS), 4 (stop), 9."""
    vocab = tiny_cfg.vocab_size
    state = DecodeState.empty(tiny_cfg, 4, 8, 5).replace(done=jnp.zeros(4, bool), budget=jnp.array([1, 5, 5, 5]))
    wanted = jnp.array([9, 3, 4, 9])
    logits = jnp.where(jnp.arange(vocab)[None] == wanted[:, None], 50.0, 0.0)
    arrays = sampling_arrays(SamplingConfig(max_new_tokens=5, greedy=True, eos_id=3, stop_ids=(4, 9)),
                             vocab_size=vocab, default_eos_id=None)
    record = jax.jit(record_tokens)
    after = record(state, logits, jax.random.key(0), arrays)
    np.testing.assert_array_equal(after.finish, [STOP_CODE, EOS_CODE, STOP_CODE, STOP_CODE])
    no_stop = sampling_arrays(SamplingConfig(max_new_tokens=5, greedy=True, eos_id=3), vocab_size=vocab, default_eos_id=None)
    after = record(state, logits, jax.random.key(0), no_stop)
    np.testing.assert_array_equal(after.finish, [LENGTH_CODE, EOS_CODE, RUNNING_CODE, RUNNING_CODE])
    np.testing.assert_array_equal(after.done, [True, True, False, False])
    np.testing.assert_array_equal(after.tokens[:, 0], wanted)


def test_admit_prefills_once_and_decode_stops_when_all_done(tiny_cfg, tiny_split):
    """Two prompts x group 2 into slots [3, 0, 1, 2]; a padding row (slot 4 = past the end) is dropped."""
    graphdef, params = tiny_split
    state = DecodeState.empty(tiny_cfg, 4, 12, 6)
    prompts = jnp.array([[5, 6, 7, 0], [8, 9, 0, 0], [0, 0, 0, 0]])
    arrays = sampling_arrays(SamplingConfig(max_new_tokens=6), vocab_size=tiny_cfg.vocab_size, default_eos_id=None)
    admit_fn = jax.jit(admit, static_argnums=0, static_argnames="group_size")
    state = admit_fn(graphdef, params, state, prompts, jnp.array([3, 2, 1]), jnp.array([3, 0, 1, 2, 4, 4]),
                  jnp.array([0, 0, 1, 1, 0, 0]), jnp.array([0, 1, 0, 1, 0, 1]), jnp.array([6, 2, 6, 4, 1, 1]),
                  jax.random.key(0), arrays, group_size=2)
    np.testing.assert_array_equal(state.cache.lengths, [3, 2, 2, 3])
    np.testing.assert_array_equal(state.num_generated, [1, 1, 1, 1])
    np.testing.assert_array_equal(state.prompt_index, [0, 1, 1, 0])
    np.testing.assert_array_equal(state.sample_index, [1, 0, 1, 0])
    # the two samples of a prompt share the prefill: identical cache rows
    for layer in state.cache.layers:
        np.testing.assert_array_equal(layer.k[3, ..., :3], layer.k[0, ..., :3])
    run = jax.jit(decode, static_argnums=0, static_argnames="window")
    every = jnp.asarray(live_rows(range(4), num_slots=4, replicas=1, compact=False))  # one replica, every slot
    # a window of 6 cache positions: the loop stops before row 0 (3 cached tokens + 3 more) would overflow it
    windowed, steps = run(graphdef, params, state, every, jax.random.key(0), arrays, jnp.int32(100), window=6)
    assert int(steps) == 3 and int(windowed.cache.lengths.max()) == 6 and not bool(windowed.done.all())
    windowed, _ = run(graphdef, params, windowed, every, jax.random.key(0), arrays, jnp.int32(100))
    state, steps = run(graphdef, params, state, every, jax.random.key(0), arrays, jnp.int32(100))
    for name in ("tokens", "logprobs", "num_generated", "finish"):  # a window changes the cost, not the result
        np.testing.assert_allclose(getattr(windowed, name), getattr(state, name), atol=1e-6, err_msg=name)
    assert int(steps) == 5  # the longest budget is 6 tokens, the first came from the prefill
    np.testing.assert_array_equal(state.num_generated, [2, 6, 4, 6])
    np.testing.assert_array_equal(state.finish, [LENGTH_CODE] * 4)
    # finished rows froze: cache lengths stopped, nothing written past each row's own tokens
    np.testing.assert_array_equal(state.cache.lengths, [3 + 1, 2 + 5, 2 + 3, 3 + 5])
    written = np.arange(6)[None, :] < np.asarray(state.num_generated)[:, None]
    assert np.all(np.asarray(state.tokens)[~written] == 0) and np.all(np.asarray(state.logprobs)[~written] == 0)
    assert np.all(np.asarray(state.logprobs)[written] < 0)
