"""Partial rollouts (`rpegjax.runtime.partial_rollouts`): carried sequences, per-token weights versions, the
staleness bound with `wait` and `drop`, and their bookkeeping, against a full forward under each token's version."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig, stack_completions
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.logprobs import token_logprobs
from rpegjax.models.transformer import KVCache
from rpegjax.runtime.partial_rollouts import (
    CarryMode,
    PartialRolloutConfig,
    PartialRollouts,
    StalePolicy,
)

TEMPERATURE = 0.9
MAX_NEW = 24
STEPS = 6


@pytest.fixture(scope="module")
def models(randomize):
    """One model per weights version 0..STEPS-1 (a version is any set of weights: here unrelated ones)."""
    cfg = ModelConfig.tiny(eos_token_id=None)
    return cfg, [randomize(Decoder(cfg, rngs=nnx.Rngs(seed)), seed) for seed in range(STEPS)]


_SAMPLERS: dict[str, Sampler] = {}


def _sampler(cfg, graphdef, layout: str) -> Sampler:
    """One sampler per cache layout for the module (its programs compile once)."""
    if layout not in _SAMPLERS:
        cache = CacheConfig.paged(page_size=4) if layout == "paged" else None
        _SAMPLERS[layout] = Sampler(cfg, graphdef, num_slots=8, max_prompt_len=8, max_new_tokens=MAX_NEW,
                                    chunk_steps=2, window_step=8, cache=cache)
    return _SAMPLERS[layout]


def _run(models, policy: StalePolicy, *, layout: str = "contiguous", max_token_lag: int = 2, async_bound: int = 0,
         inflight_weights: bool = False, inflight_after: float | None = None, fetch_delay: float = 0.0,
         carry: CarryMode = CarryMode.RECOMPUTE, steps: range = range(STEPS),
         partial: PartialRollouts | None = None, taken: list | None = None):
    """STEPS steps of 2 groups of 2 over prompts 0, 1, 2, ...; every step's weights are model `step - k`. Stop
    tokens (a quarter of the vocabulary) make the response lengths long-tailed. Returns the trained groups per
    step, the metrics, (the prompts taken, those trained) and the partial rollouts object. `inflight_weights`:
    step t's weights (version t) are published at its generation's second decode chunk (asked between chunks), or
    with `inflight_after` f taken once f of the groups a step lacks have completed, each fetched after
    `fetch_delay` seconds (a slow trainer).
    `steps`, `partial`, `taken`: to continue a run (a resume) with its prompts taken so far."""
    cfg, decoders = models
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, stop_ids=tuple(range(0, 128, 4)))
    params = [nnx.split(m)[1] for m in decoders]
    config = PartialRolloutConfig(max_token_lag=max_token_lag, stale_policy=policy, inflight_weights=inflight_weights,
                                  inflight_after=inflight_after, carry=carry)
    if partial is None:
        partial = PartialRollouts(config, sampler=_sampler(cfg, nnx.split(decoders[0])[0], layout),
                                  sampling=sampling, group_size=2, batch_size=2, async_bound=async_bound)
    taken = [] if taken is None else taken

    def take_batch():
        batch = list(range(len(taken), len(taken) + 2))
        taken.extend(batch)
        return batch

    def prompt_ids(examples):  # prompt e's tokens depend on e only
        return [np.random.default_rng(e).integers(0, cfg.vocab_size, 3 + e % 5).tolist() for e in examples]

    trained, metrics, examples = [], [], []
    for step in steps:
        partial.fill(take_batch, prompt_ids)
        version = max(0, step - async_bound)
        asked = []

        def newer(v, step=step):
            asked.append(v)
            return (step, params[step]) if len(asked) >= 2 and v < step else None

        def fetch(v, step=step, version=version):
            assert version < v <= step
            time.sleep(fetch_delay)
            return params[v]

        groups, step_metrics = partial.run_step(step, version, params[version],
                                                jax.random.fold_in(jax.random.key(1), step), newer, fetch=fetch)
        trained.append([g.completions(i, version) for i, g in enumerate(groups)])
        metrics.append(step_metrics)
        examples += [g.example for g in groups]
    return trained, metrics, (taken, examples), partial


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_carried_logprobs_equal_full_forward_under_token_versions(models, layout):
    """Every trained token's recorded log-prob equals a full forward of its sequence under the weights version
    that sampled it (1e-5), for sequences carried over up to two steps; no token lags more than the bound."""
    trained, metrics, _, _ = _run(models, StalePolicy.WAIT, layout=layout)
    completions = [c for step in trained for group in step for c in group]
    spans = [c for c in completions if len(set(c.token_versions.tolist())) > 1]
    assert len(spans) >= 3, "the test needs sequences continued over several versions"
    assert sum(m["partial/carried_sequences"] for m in metrics) >= len(spans)
    _assert_logprobs_are_their_versions(models, completions)
    for step, groups in enumerate(trained):
        for group in groups:
            for c in group:
                assert step - c.token_versions.min() <= 2


def test_weights_taken_in_flight_are_recorded_per_token(models):
    """With k = 1, step t starts with version t - 1 and takes version t when it is published, between decode
    chunks: the sequences running continue (none dropped), each token's recorded version is the one that
    sampled it (its log-prob is that version's full forward) and none lags more than the bound."""
    trained, metrics, _, _ = _run(models, StalePolicy.WAIT, async_bound=1, inflight_weights=True)
    assert sum(m["partial/weight_updates_in_flight"] for m in metrics) >= 1  # short steps often end first
    completions = [c for step in trained for group in step for c in group]
    _assert_logprobs_are_their_versions(models, completions)
    # without weights in flight, step t >= 1 of k = 1 trains no token of version t
    assert any(c.token_versions.max() == step for step, groups in enumerate(trained) if step for g in groups for c in g
               if c.length)
    for step, groups in enumerate(trained):
        assert all(step - 2 <= c.token_versions.min() and c.token_versions.max() <= step for g in groups for c in g)


def test_weights_in_flight_at_a_share_of_the_batch_are_reproducible(models):
    """With `inflight_after` f, a step takes the next version once f of the groups it lacked have completed,
    waiting for it: a slow trainer (each version fetched 50 ms late) gives the same batches, versions and log-probs
    as a fast one; with k = 2 a step takes one version, the next; each token's log-prob is its version's forward."""
    fast, metrics, _, _ = _run(models, StalePolicy.WAIT, async_bound=2, max_token_lag=3, inflight_weights=True,
                               inflight_after=0.5)
    slow, _, _, _ = _run(models, StalePolicy.WAIT, async_bound=2, max_token_lag=3, inflight_weights=True,
                         inflight_after=0.5, fetch_delay=0.05)
    for a, b in zip([c for step in fast for g in step for c in g], [c for step in slow for g in step for c in g],
                    strict=True):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.token_versions, b.token_versions)
        np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert sum(m["partial/weight_updates_in_flight"] for m in metrics) >= 2
    assert max(m["partial/weight_updates_in_flight"] for m in metrics) == 1
    completions = [c for step in fast for group in step for c in group]
    _assert_logprobs_are_their_versions(models, completions)
    for step, groups in enumerate(fast):
        assert all(step - 3 <= c.token_versions.min() and c.token_versions.max() <= step for g in groups for c in g)


def _assert_logprobs_are_their_versions(models, completions) -> None:
    """Each recorded log-prob equals a full forward of its sequence under the version that sampled the token."""
    _, decoders = models
    batch = stack_completions(completions)
    versions = np.full(batch.tokens.shape, -1)
    for row, c in enumerate(completions):
        s = len(c.prompt_ids)
        versions[row, s - 1:s - 1 + c.length] = c.token_versions
    forward = jax.jit(lambda model, tokens, mask: token_logprobs(model, tokens, mask=mask, temperature=TEMPERATURE))
    expected = np.zeros(batch.tokens.shape, np.float32)
    for version in np.unique(versions[batch.response_mask]):
        rows = versions == version
        expected[rows] = np.asarray(forward(decoders[version], batch.tokens, batch.attention_mask))[rows]
    mask = batch.response_mask
    np.testing.assert_allclose(batch.behaviour_logprobs[mask], expected[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", [StalePolicy.WAIT, StalePolicy.DROP])
def test_bound_and_bookkeeping(models, policy):
    """Every prompt taken is trained once, dropped (counted) or still in flight, never twice; no trained token
    lags more than max_token_lag, with an asynchrony bound of 1 too."""
    for async_bound, lag in ((0, 1), (1, 2)):
        trained, metrics, (taken, trained_prompts), partial = _run(models, policy, max_token_lag=lag,
                                                                   async_bound=async_bound)
        for step, groups in enumerate(trained):
            assert len(groups) == 2
            for group in groups:
                assert all(c.finish_reason is not None and c.finish_reason != "partial" for c in group)
                assert max(step - c.token_versions.min() for c in group if c.length) <= lag
        dropped = sum(m["partial/dropped_groups"] for m in metrics)
        in_flight = [g.example for g in partial.pool]
        assert len(set(trained_prompts)) == len(trained_prompts)
        assert not set(trained_prompts) & set(in_flight)
        assert len(trained_prompts) + dropped + len(in_flight) == len(taken)
        if policy == StalePolicy.WAIT:
            assert dropped == 0


def test_config_refuses_a_bound_that_carries_nothing(models):
    cfg, decoders = models
    with pytest.raises(ValueError, match="max_token_lag=1 must exceed the asynchrony bound 1"):
        PartialRollouts(PartialRolloutConfig(max_token_lag=1), sampler=_sampler(cfg, nnx.split(decoders[0])[0], "contiguous"),
                        sampling=SamplingConfig(max_new_tokens=4), group_size=2, batch_size=2, async_bound=1)
    with pytest.raises(ValueError, match="inflight_batches must be an integer >= 2"):
        PartialRolloutConfig(max_token_lag=2, inflight_batches=1)


# ---- carry=pages: carried sequences keep their KV pages ----------------------------------------------------------
def _kv_reference(decoders, completion, recomputed_at: int | None = None) -> np.ndarray:
    """The log-prob of each response token from a decode that builds the KV cache token by token, each position
    written by the version that reads it: the version that sampled the next token (the prompt's: the first
    response token's). `recomputed_at`: a prefix length m whose context (prompt + m tokens) was prefilled at once
    by the version of response token m (a resume's recompute: only the log-probs of tokens m on follow it)."""
    cfg = decoders[0].cfg
    graphdef = nnx.split(decoders[0])[0]
    tokens = np.concatenate([completion.prompt_ids, completion.response_ids]).astype(np.int32)
    s, versions = len(completion.prompt_ids), completion.token_versions
    reader = np.array([versions[max(p + 1 - s, 0)] for p in range(len(tokens) - 1)])
    if recomputed_at is not None:
        reader[: s + recomputed_at] = versions[recomputed_at]
    cache = KVCache.zeros(cfg, 1, len(tokens), jnp.float32)
    out = []
    for p in range(len(tokens) - 1):
        logits, cache = _decode_one(graphdef, nnx.split(decoders[int(reader[p])])[1], cache,
                                    jnp.asarray(tokens[None, p:p + 1]), jnp.full((1, 1), p, jnp.int32))
        out.append(float(jax.nn.log_softmax(logits / TEMPERATURE)[tokens[p + 1]]))
    return np.array(out[s - 1:], np.float32)


@jax.jit
def _decode_one(graphdef, params, cache, token, position):
    model = nnx.merge(graphdef, params)
    hidden, cache = model.hidden_states(token, position, cache=cache)
    return model.logits(hidden)[0, 0], cache


@pytest.mark.parametrize("async_bound,inflight", [(0, False), (1, True)])
def test_kept_pages_logprobs_follow_each_tokens_version(models, async_bound, inflight):
    """carry=pages: carried sequences decode on in their kept pages (no recompute); every recorded log-prob equals a
    token-by-token decode whose cache positions were written by the version that read them (1e-5), not the full
    forward under each token's version (which recompute gives); no token lags more than the bound."""
    _, decoders = models
    trained, metrics, (taken, trained_prompts), partial = _run(
        models, StalePolicy.WAIT, layout="paged", carry=CarryMode.PAGES, async_bound=async_bound,
        max_token_lag=2 + async_bound, inflight_weights=inflight)
    assert sum(m["partial/kept_sequences"] for m in metrics) >= 3
    assert sum(m["partial/recomputed_sequences"] for m in metrics) == 0
    if inflight:
        assert sum(m["partial/weight_updates_in_flight"] for m in metrics) >= 1
    completions = [c for step in trained for group in step for c in group]
    spans = [c for c in completions if len(set(c.token_versions.tolist())) > 1]
    assert len(spans) >= 3, "the test needs sequences continued over several versions"
    for c in completions:
        np.testing.assert_allclose(c.behaviour_logprobs, _kv_reference(decoders, c), atol=1e-5, rtol=0)
    with pytest.raises(AssertionError):  # a kept cache is not a full forward under each token's version
        _assert_logprobs_are_their_versions(models, spans)
    for step, groups in enumerate(trained):
        assert all(step - c.token_versions.min() <= 2 + async_bound for g in groups for c in g)
    assert len(set(trained_prompts)) == len(trained_prompts)
    assert len(trained_prompts) + len(partial.pool) == len(taken)


@pytest.mark.slow  # twelve steps and a token-by-token reference (~50 s of CPU)
def test_kept_pages_resume_recomputes_carried_sequences(models):
    """A snapshot holds no pages: a run restored from step 3's snapshot (a new `PartialRollouts`, as a restarted
    process builds it) continues the carried sequences by recomputing their contexts once, then keeps pages again.
    Resumed, it takes the same prompts, skips and repeats none, its restored tokens, log-probs and versions are the
    snapshot's, and its log-probs follow the recompute (a token-by-token reference, 1e-5)."""
    _, decoders = models
    cut = 3
    first, _, (taken, trained_first), partial = _run(models, StalePolicy.WAIT, layout="paged", carry=CarryMode.PAGES,
                                                     steps=range(cut))
    whole, _, (taken_whole, trained_whole), _ = _run(models, StalePolicy.WAIT, layout="paged", carry=CarryMode.PAGES)
    snapshot = partial.snapshot(list(range(100)))
    started = {(g["example"], j): len(smp["tokens"]) for g in snapshot["groups"]
               for j, smp in enumerate(g["samples"]) if smp["tokens"] and smp["finish"] is None}
    assert started, "the snapshot must hold carried sequences"
    resumed = PartialRollouts(partial.config, sampler=partial.sampler, sampling=partial.sampling, group_size=2,
                              batch_size=2, async_bound=0)
    resumed.restore(snapshot, list(range(100)))
    assert resumed.snapshot(list(range(100))) == snapshot
    again, metrics, (taken_again, trained_again), _ = _run(models, StalePolicy.WAIT, layout="paged",
                                                          carry=CarryMode.PAGES, steps=range(cut, STEPS),
                                                          partial=resumed, taken=list(taken))
    assert metrics[0]["partial/recomputed_sequences"] == len(started)
    assert metrics[0]["partial/kept_sequences"] == 0
    assert sum(m["partial/recomputed_sequences"] for m in metrics[1:]) == 0
    assert taken_again == taken_whole  # the same prompts, in order
    trained = trained_first + trained_again
    assert len(set(trained)) == len(trained)
    assert sorted(trained + [g.example for g in resumed.pool]) == sorted(taken_again)
    by_example = {(g["example"], j): smp for g in snapshot["groups"] for j, smp in enumerate(g["samples"])}
    for i, groups in enumerate(again):
        for index, group in enumerate(groups):
            example = trained_again[2 * i + index]
            for j, c in enumerate(group):
                restored = by_example.get((example, j))
                prefix = len(restored["tokens"]) if restored is not None else 0
                if restored is not None:  # the snapshot's tokens, log-probs and versions lead the sequence
                    np.testing.assert_array_equal(c.response_ids[:prefix], restored["tokens"])
                    np.testing.assert_array_equal(c.behaviour_logprobs[:prefix],
                                                  np.asarray(restored["logprobs"], np.float32))
                    np.testing.assert_array_equal(c.token_versions[:prefix], restored["versions"])
                expected = _kv_reference(decoders, c)
                if (example, j) in started:  # its tokens from the resume on follow the recompute
                    expected[prefix:] = _kv_reference(decoders, c, prefix)[prefix:]
                np.testing.assert_allclose(c.behaviour_logprobs, expected, atol=1e-5, rtol=0)
