"""Dynamic sampling and reward shaping in the runtime's rollout stage: only groups with differing rewards reach
the update, the batch keeps its shape, every row is generated with the version the asynchrony bound allows,
the extra generation is logged, and the data position covers every round."""

import dataclasses
import zlib

import jax
import numpy as np
import pytest

from rpegjax.data.iterator import DataIterator
from rpegjax.graph.trace import Trace, max_staleness
from rpegjax.learners.group_filter import DynamicSamplingConfig, DynamicSamplingError
from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
from rpegjax.runtime.controller import Runtime
from rpegjax.train.build import build, build_graph
from rpegjax.train.config import (
    DataSection,
    GraphSection,
    ModelSection,
    RolloutSection,
    RunConfig,
    TrainSection,
    WarmStartSection,
)
from rpegjax.train.trainer import make_programs

PROMPTS, GROUP, NEW_TOKENS = 4, 2, 6


def tiny_config(prompts: int = PROMPTS, **graph) -> RunConfig:
    return RunConfig(
        model=ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64),
        data=DataSection(train_size=64, eval_size=4),
        rollout=RolloutSection(prompts_per_step=prompts, group_size=GROUP, max_prompt_len=12,
                               max_new_tokens=NEW_TOKENS, num_slots=8, chunk_steps=3),
        warm_start=WarmStartSection(steps=0),
        graph=GraphSection(**{"async_bound": 1, **graph}),
        train=TrainSection(steps=4, reward_workers=1),
    )


_BUILT = {}


def built(cfg: RunConfig):
    key = cfg.replace(graph=GraphSection()).to_json()
    if key not in _BUILT:
        _BUILT[key] = build(cfg, log=lambda _: None)
    return dataclasses.replace(_BUILT[key], cfg=cfg, graph=build_graph(cfg, num_devices=jax.device_count()))


def _decided(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 2 == 0


def _half_decided_reward(text, example):
    """About half of the prompts always score 0.5 (a group that never differs: always dropped); the others score
    the response length's parity, which differs within about half of the groups of an untrained model."""
    return 0.5 if _decided(example.prompt) else float(len(text) % 2)


def _constant_reward(text, example):
    return 1.0


def run(cfg: RunConfig, steps: int, reward, *, dynamic: DynamicSamplingConfig | None, shaping=None):
    parts = built(cfg)
    rewards = RewardRunner(reward, RewardRunnerConfig(timeout_s=5.0, workers=1, isolation=parts.task.isolation))
    programs = make_programs(parts, rewards)
    generated = []  # every completion any round generated
    generate = programs.generate

    def counting_generate(*args, **kwargs):
        for piece in generate(*args, **kwargs):
            generated.append(piece.completions)
            yield piece

    programs.generate = counting_generate
    data = DataIterator(parts.train_examples, batch_size=cfg.rollout.prompts_per_step, seed=0)
    trace = Trace()
    runtime = Runtime(parts.graph, programs, data, prompt_ids=parts.prompt_ids, key=jax.random.key(3), trace=trace,
                      dynamic_sampling=dynamic, reward_shaping=shaping)
    results = []
    try:
        runtime.run(parts.learner.init_state(), start_step=0, num_steps=steps,
                    on_step=lambda result, _: results.append(result))
    finally:
        rewards.close()
    return parts, results, trace, generated


def test_every_trained_group_has_differing_rewards_and_versions_stay_exact_under_bound_one():
    cfg = tiny_config(async_bound=1)
    parts, results, trace, generated = run(cfg, 4, _half_decided_reward,
                                           dynamic=DynamicSamplingConfig(max_extra_rounds=30))
    rounds = 0
    for result in results:
        m = result.metrics
        assert m["dynamic_sampling/cap_hit"] == 0.0
        assert len(result.completions) == PROMPTS * GROUP  # the batch keeps its shape
        # each group of the training batch: two samples of one prompt whose rewards differ
        for start in range(0, len(result.completions), GROUP):
            group = result.completions[start:start + GROUP]
            assert len({id(c) for c in group}) == GROUP
            texts = [parts.decode(c.response_ids) for c in group]
            question = _prompt_of(parts, group[0])
            assert not _decided(question)
            rewards = [float(len(t) % 2) for t in texts]
            assert max(rewards) > min(rewards)
        assert m["advantage/zero_variance_group_fraction"] == 0.0
        # versions: every row of every round read the weights the bound allows, no older
        assert {c.version for c in result.completions} == {result.version} == {max(0, result.step - 1)}
        assert m["staleness"] == result.step - result.version
        assert m["dynamic_sampling/kept_groups"] == PROMPTS
        assert m["dynamic_sampling/sampled_groups"] == m["dynamic_sampling/rounds"] * PROMPTS
        assert m["dynamic_sampling/dropped_groups"] >= m["dynamic_sampling/rounds"] * PROMPTS / 2  # even ids
        assert m["dynamic_sampling/extra_rounds"] == m["dynamic_sampling/rounds"] - 1
        rounds += int(m["dynamic_sampling/rounds"])
        # the data position covers every round's prompts: a resumed run continues after them
        assert result.data_state["epoch"] * len(parts.train_examples) + result.data_state["position"] == rounds * PROMPTS
    assert rounds > len(results)  # extra rounds were needed
    assert max_staleness(trace) == 1
    # the extra generation is logged: every sequence and token generated by any round, counted independently
    assert sum(r.metrics["dynamic_sampling/generated_sequences"] for r in results) == sum(len(g) for g in generated)
    assert sum(r.metrics["dynamic_sampling/generated_tokens"] for r in results) == sum(
        c.length for g in generated for c in g)


def _prompt_of(parts, completion) -> str:
    """The question a completion answered, found by its prompt tokens (the reward above depends only on it)."""
    prompt = list(completion.prompt_ids)
    questions = {e.prompt for e in parts.train_examples if parts.prompt_ids([e])[0] == prompt}
    assert len(questions) == 1
    return questions.pop()


def test_at_the_cap_the_step_trains_on_what_it_found_and_says_so():
    # every group agrees: nothing to keep; one extra round, then the batch is all filler, masked out of the loss
    _, results, _, generated = run(tiny_config(async_bound=0), 1, _constant_reward,
                                   dynamic=DynamicSamplingConfig(max_extra_rounds=1))
    m = results[0].metrics
    assert m["dynamic_sampling/cap_hit"] == 1.0
    assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/kept_groups"], m["dynamic_sampling/filler_groups"]) == (
        2.0, 0.0, PROMPTS)
    assert len(generated) == 2 and len(results[0].completions) == PROMPTS * GROUP
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0  # filler rows carry no loss and no gradient
    assert "dynamic_sampling/batch_reward" not in m  # no trained row to average


def test_at_the_cap_the_run_stops_with_an_error_when_configured_so():
    with pytest.raises(DynamicSamplingError, match=r"step 0: dynamic sampling found 0 of 4 groups .* 3 rounds"):
        run(tiny_config(async_bound=1), 2, _constant_reward,
            dynamic=DynamicSamplingConfig(max_extra_rounds=2, on_cap="error"))


def _numpy_overlong(length: int, max_length: int, cache: int, factor: float) -> float:
    """DAPO eq. 13 (Yu et al. 2025), scaled by the penalty factor."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return factor * ((max_length - cache) - length) / cache
    return -factor


def test_overlong_shaping_is_added_to_the_rewards_the_advantages_read():
    cfg = tiny_config(async_bound=0)
    section = dataclasses.replace(cfg.grpo, overlong_buffer=4, overlong_penalty=0.5)
    parts, results, _, _ = run(cfg, 2, _length_reward, dynamic=None, shaping=section.overlong_shaping(NEW_TOKENS))
    for result in results:
        lengths = [c.length for c in result.completions]
        texts_reward = np.array([_length_reward(parts.decode(c.response_ids), None) for c in result.completions])
        shaping = np.array([_numpy_overlong(length, NEW_TOKENS, 4, 0.5) for length in lengths])
        assert result.metrics["reward/shaping"] == pytest.approx(shaping.mean(), abs=1e-6)
        assert result.metrics["reward"] == pytest.approx(texts_reward.mean(), abs=1e-6)  # the task's, unshaped
        # the advantage stage read task reward + shaping
        assert result.metrics["advantage/reward_mean"] == pytest.approx((texts_reward + shaping).mean(), abs=1e-6)


def _length_reward(text, example):
    return float(len(text) % 3) / 2


@pytest.mark.slow  # about 40 s on a loaded 2-core machine (a build of its own); not essential for CI
def test_a_batch_handed_over_in_pieces_trains_like_the_whole_batch():
    """With two generation micro-batches the kept groups go downstream piece by piece (the first before the
    rounds end when it is full); the step must train on the same rows as without pieces."""
    # 8 prompts: each piece's 8 rows divide the 8 devices
    dynamic = DynamicSamplingConfig(max_extra_rounds=30)
    _, whole, _, _ = run(tiny_config(prompts=8, async_bound=0), 2, _half_decided_reward, dynamic=dynamic)
    _, pieces, trace, _ = run(tiny_config(prompts=8, async_bound=0, generate_microbatches=2), 2, _half_decided_reward,
                              dynamic=dynamic)
    for a, b in zip(whole, pieces):
        assert [list(c.response_ids) for c in a.completions] == [list(c.response_ids) for c in b.completions]
        assert a.metrics["dynamic_sampling/rounds"] == b.metrics["dynamic_sampling/rounds"]
        assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-5)
    assert sorted(e.microbatch for e in trace.events if "old_logprob" in e.stage and e.step == 0) == [0, 1]
