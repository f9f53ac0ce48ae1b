"""Partial rollouts (`rpegjax.runtime.partial_rollouts`): carried sequences, per-token weights versions, the
staleness bound with `wait` and `drop`, and their bookkeeping, against a full forward under each token's version."""

import jax
import numpy as np
import pytest
from flax import nnx

from rpegjax.generate import CacheConfig, Sampler, SamplingConfig, stack_completions
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.logprobs import token_logprobs
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig, PartialRollouts, StalePolicy

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
         inflight_weights: bool = False):
    """STEPS steps of 2 groups of 2 over prompts 0, 1, 2, ...; every step's weights are model `step - k`. Stop
    tokens (a quarter of the vocabulary) make the response lengths long-tailed. Returns the trained groups per
    step, the metrics, (the prompts taken, those trained) and the partial rollouts object. `inflight_weights`:
    step t's weights (version t) are published at its generation's second decode chunk (asked between chunks)."""
    cfg, decoders = models
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, stop_ids=tuple(range(0, 128, 4)))
    params = [nnx.split(m)[1] for m in decoders]
    config = PartialRolloutConfig(max_token_lag=max_token_lag, stale_policy=policy, inflight_weights=inflight_weights)
    partial = PartialRollouts(config,
                              sampler=_sampler(cfg, nnx.split(decoders[0])[0], layout), sampling=sampling,
                              group_size=2, batch_size=2, async_bound=async_bound)
    rng = np.random.default_rng(0)
    taken = []

    def take_batch():
        batch = list(range(len(taken), len(taken) + 2))
        taken.extend(batch)
        return batch

    def prompt_ids(examples):
        return [rng.integers(0, cfg.vocab_size, 3 + e % 5).tolist() for e in examples]

    trained, metrics, examples = [], [], []
    for step in range(STEPS):
        partial.fill(take_batch, prompt_ids)
        version = max(0, step - async_bound)
        asked = []

        def newer(v, step=step):
            asked.append(v)
            return (step, params[step]) if len(asked) >= 2 and v < step else None

        groups, step_metrics = partial.run_step(step, version, params[version],
                                                jax.random.fold_in(jax.random.key(1), step), newer)
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
