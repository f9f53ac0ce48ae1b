import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rpegjax.generate.sampling import (
    SamplingConfig,
    draw_from_weights,
    filter_logits,
    row_step_keys,
    sample_tokens,
    sampling_arrays,
)


# ---- config validation -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(stop_ids=5), "stop_ids"),
        (dict(stop_ids=(3, -1)), "stop_ids"),
        (dict(stop_sequences=(3, 4)), "stop_sequences"),
        (dict(stop_sequences=((),)), "stop_sequences"),
        (dict(stop_sequences=((3, -1),)), "stop_sequences"),
        (dict(stop_sequences="</tool>"), "stop_sequences"),
        (dict(eos_id=-2), "eos_id"),
    ],
)
def test_bad_sampling_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**{"max_new_tokens": 4, **changes})


def test_greedy_accepts_any_temperature_and_stop_ids_become_a_tuple():
    config = SamplingConfig(max_new_tokens=4, greedy=True, temperature=0.0, stop_ids=[3, 5])
    assert config.stop_ids == (3, 5)
    arrays = sampling_arrays(config, vocab_size=8, default_eos_id=7)
    assert float(arrays.temperature) == 1.0 and int(arrays.eos_id) == 7
    np.testing.assert_array_equal(np.flatnonzero(arrays.is_stop), [3, 5])
    assert int(sampling_arrays(config.replace(ignore_eos=True), vocab_size=8, default_eos_id=7).eos_id) == -1
    with pytest.raises(ValueError, match="stop_ids: 9 is outside the vocabulary"):
        sampling_arrays(config.replace(stop_ids=(9,)), vocab_size=8, default_eos_id=None)
    with pytest.raises(ValueError, match="EOS id 8 is outside"):
        sampling_arrays(config, vocab_size=8, default_eos_id=8)


# ---- filters on hand-built logits ------------------------------------------------------------------
PROBS = np.array([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 0.5 (1), 0.2 (3), 0.15 (0), 0.1 (4), 0.05 (2)


def _kept(**kwargs) -> set[int]:
    logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
    out = np.asarray(filter_logits(logits, **kwargs))[0]
    assert np.all((out == np.asarray(logits[0])) | np.isneginf(out)), "kept logits must be unchanged"
    return set(np.flatnonzero(np.isfinite(out)).tolist())


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(), {0, 1, 2, 3, 4}),
        (dict(top_k=1), {1}),
        (dict(top_k=2), {1, 3}),
        (dict(top_k=4), {0, 1, 3, 4}),
        (dict(top_p=0.5), {1}),  # mass before the 2nd token is 0.5, not < 0.5
        (dict(top_p=0.75), {0, 1, 3}),  # 0.7 < 0.75 keeps the 3rd, 0.85 drops the 4th
        (dict(top_p=0.01), {1}),  # the most likely token always stays
        (dict(min_p=0.3), {0, 1, 3}),  # p >= 0.15
        (dict(min_p=0.5), {1}),  # p >= 0.25
        # top-k first renormalises over {0.5, 0.2, 0.15, 0.1}: mass before the 3rd is 0.7/0.95 = 0.737 >= 0.72
        (dict(top_k=4, top_p=0.72), {1, 3}),
        (dict(top_p=0.72), {0, 1, 3}),  # without top-k the same top-p keeps three (0.7 < 0.72)
        (dict(top_k=3, min_p=0.35), {1, 3}),
    ],
)
def test_filter_masks_match_hand_computed_sets(kwargs, expected):
    assert _kept(**kwargs) == expected


def _reference_filter(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straight from the definitions, one row at a time, in float64."""
    out = np.full_like(logits, -np.inf)
    for row, values in enumerate(logits.astype(np.float64)):
        order = np.argsort(-values, kind="stable")
        keep = np.ones(values.size, bool)
        if top_k:
            keep[order[top_k:]] = False
        p = np.where(keep, np.exp(values - values.max()), 0.0)
        p /= p.sum()
        before = 0.0
        for index in order:
            if keep[index] and before >= top_p:
                keep[index] = False
            before += p[index]
        keep &= np.exp(values - values.max()) >= min_p
        out[row, keep] = logits[row, keep]
    return out


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(0, 0.9, 0.0), (7, 1.0, 0.0), (0, 1.0, 0.05), (10, 0.8, 0.02)])
def test_filter_matches_a_reference_on_random_logits(top_k, top_p, min_p):
    logits = np.asarray(jax.random.normal(jax.random.key(3), (16, 40)) * 2.0)
    expected = _reference_filter(logits, top_k, top_p, min_p)
    got = filter_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p if top_p < 1 else None,
                        min_p=min_p if min_p > 0 else None)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    np.testing.assert_allclose(np.where(np.isfinite(expected), got, 0), np.where(np.isfinite(expected), expected, 0))


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(40, 0.9, 0.0), (0, 0.9, 0.0), (40, 1.0, 0.0), (40, 0.95, 0.05)])
def test_draws_are_those_of_the_reference_filter_for_the_same_keys(top_k, top_p, min_p):
    """With top-k on, the filters rank only the k largest logits: the kept set is still the float64 reference's over
    the whole vocabulary, and each row draws the token that the inverse CDF over the reference's kept weights
    draws with the same key (with and without top-k)."""
    rows, vocab, temperature = 64, 1000, 0.7
    logits = jax.random.normal(jax.random.key(4), (rows, vocab)) * 3.0
    keys = jax.random.split(jax.random.key(5), rows)
    config = SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens, _ = sample_tokens(logits, keys, sampling_arrays(config, vocab_size=vocab, default_eos_id=None))
    scaled = logits / temperature
    kept = np.isfinite(_reference_filter(np.asarray(scaled), top_k, top_p, min_p))
    assert 1 < kept.sum(-1).max() < vocab  # the filters cut, and rows keep several tokens
    got = filter_logits(scaled, top_k=top_k, top_p=top_p if top_p < 1 else None, min_p=min_p if min_p > 0 else None)
    np.testing.assert_array_equal(np.isfinite(got), kept)
    weights = jnp.where(kept, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)
    np.testing.assert_array_equal(tokens, draw_from_weights(weights, uniforms))


# ---- sampled tokens and behaviour log-probs ----------------------------------------------------------
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_behaviour_logprobs_are_unfiltered_and_temperature_scaled():
    logits = jax.random.normal(jax.random.key(0), (6, 30)) * 3.0
    keys = jax.random.split(jax.random.key(1), 6)
    config = SamplingConfig(max_new_tokens=1, temperature=0.6, top_k=3, top_p=0.9)
    tokens, logprobs = sample_tokens(logits, keys, sampling_arrays(config, vocab_size=30, default_eos_id=None))
    reference = _log_softmax(np.asarray(logits) / 0.6)
    np.testing.assert_allclose(logprobs, reference[np.arange(6), tokens], atol=1e-5)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    assert all(t in row for t, row in zip(tokens.tolist(), top3, strict=True))

    greedy = SamplingConfig(max_new_tokens=1, greedy=True, temperature=0.6)
    tokens, logprobs = sample_tokens(logits, keys, sampling_arrays(greedy, vocab_size=30, default_eos_id=None))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    np.testing.assert_allclose(logprobs, _log_softmax(np.asarray(logits))[np.arange(6), tokens], atol=1e-5)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square goodness of fit over the tokens with nonzero probability."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.7)])
def test_empirical_frequencies_match_the_filtered_softmax(temperature, top_k, top_p):
    """20,000 draws from fixed logits: chi-square p-value > 1e-3 against the filtered, temperature-scaled
    softmax, < 1e-6 against the distribution without the temperature/filter (so the test can fail), and no
    draw outside the filter's support."""
    base = np.array([1.2, 0.3, -0.4, 0.9, -1.5, 0.0, 0.6, -0.8], np.float32)
    n = 20000
    config = SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    keys = row_step_keys(jax.random.key(7), jnp.arange(n), jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32))
    tokens, _ = jax.jit(sample_tokens)(jnp.broadcast_to(jnp.asarray(base), (n, 8)), keys,
                                       sampling_arrays(config, vocab_size=8, default_eos_id=None))
    counts = np.bincount(np.asarray(tokens), minlength=8)
    filtered = np.asarray(filter_logits(jnp.asarray(base / temperature)[None], top_k=top_k,
                                        top_p=top_p if top_p < 1 else None))[0]
    probs = np.exp(_log_softmax(filtered))
    assert counts[probs == 0].sum() == 0
    assert _chi_square_p(counts, probs) > 1e-3
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        assert _chi_square_p(counts, np.exp(_log_softmax(base))) < 1e-6


def _draw_counts(weights: np.ndarray, n: int, *, same_uniform: bool = False) -> np.ndarray:
    """Counts of n draws of `draw_from_weights` from one row of weights (fixed seed); `same_uniform`: a
    deliberately wrong sampler that reuses the block level's uniform inside the block."""
    uniforms = jax.random.uniform(jax.random.key(11), (n, 2))
    if same_uniform:
        uniforms = uniforms.at[:, 1].set(uniforms[:, 0])
    tokens = jax.jit(draw_from_weights)(jnp.broadcast_to(jnp.asarray(weights, jnp.float32), (n, weights.size)),
                                        uniforms)
    return np.bincount(np.asarray(tokens), minlength=weights.size)


def _pooled_chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value with the tokens expected fewer than 5 times pooled into one cell (the test's
    validity condition)."""
    expected = probs * counts.sum()
    rare = expected < 5
    observed = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("vocab", [37, 40])  # prime (blocks zero-padded) and 8 blocks of 5
def test_inverse_cdf_draws_match_exact_probabilities(vocab):
    """200,000 draws from weights spanning 7 orders of magnitude with zeros among them, in a padded and an unpadded
    block layout: chi-square p > 1e-3 against the exact probabilities and nothing drawn where the weight is 0; the
    same draws fail (p < 1e-6) against a distribution 3% off (up and down by rank), and a sampler that reuses one
    uniform for both levels fails against the exact probabilities."""
    rng = np.random.default_rng(5)
    weights = np.exp(rng.uniform(-16.0, 0.0, vocab))
    weights[rng.choice(vocab, 6, replace=False)] = 0.0
    weights[np.argmax(weights)] = 1.0
    probs = weights / weights.sum()
    n = 200_000
    counts = _draw_counts(weights, n)
    assert counts[weights == 0].sum() == 0 and counts.sum() == n
    assert _pooled_chi_square_p(counts, probs) > 1e-3
    wrong = probs * np.where(np.argsort(np.argsort(-probs)) % 2 == 0, 1.03, 0.97)
    assert _pooled_chi_square_p(counts, wrong / wrong.sum()) < 1e-6
    assert _pooled_chi_square_p(_draw_counts(weights, n, same_uniform=True), probs) < 1e-6


def test_inverse_cdf_takes_only_positive_weights_at_the_ends_of_the_unit_interval():
    """u = 0 takes the first positive weight, u just below 1 the last one, whatever zeros surround them."""
    weights = jnp.asarray([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0]] * 2 + [[0.0] * 6 + [3.0]] * 2)
    uniforms = jnp.asarray([[0.0, 0.0], [np.nextafter(np.float32(1), np.float32(0))] * 2] * 2)
    np.testing.assert_array_equal(draw_from_weights(weights, uniforms), [2, 4, 6, 6])


def test_row_keys_depend_only_on_prompt_sample_and_step():
    key = jax.random.key(0)
    a = row_step_keys(key, jnp.array([3, 1, 3]), jnp.array([0, 2, 1]), jnp.array([5, 5, 5]))
    b = row_step_keys(key, jnp.array([3, 3, 1]), jnp.array([1, 0, 2]), jnp.array([5, 5, 5]))  # rows permuted
    data_a, data_b = np.asarray(jax.random.key_data(a)), np.asarray(jax.random.key_data(b))
    np.testing.assert_array_equal(data_a[[0, 2, 1]], data_b[[1, 0, 2]])
    assert len({tuple(np.asarray(row)) for row in data_a}) == 3


def test_stop_sequences_become_a_right_aligned_table_and_single_tokens_stop_ids():
    config = SamplingConfig(max_new_tokens=4, stop_sequences=[[5, 6, 7], (2,), [1, 3]])
    assert config.stop_sequences == ((5, 6, 7), (2,), (1, 3))
    arrays = sampling_arrays(config, vocab_size=8, default_eos_id=None)
    np.testing.assert_array_equal(arrays.stop_table, [[5, 6, 7], [-1, 1, 3]])
    np.testing.assert_array_equal(np.flatnonzero(arrays.is_stop), [2])
    assert sampling_arrays(SamplingConfig(max_new_tokens=4), vocab_size=8, default_eos_id=None).stop_table is None
    with pytest.raises(ValueError, match=r"stop_sequences: \(1, 9\) holds a token outside the vocabulary"):
        sampling_arrays(config.replace(stop_sequences=((1, 9),)), vocab_size=8, default_eos_id=None)
