"""Multi-turn episodes driven by the sampler: a real (scripted) model calls the calculator, the tool output is
appended as masked context, and the other slots keep decoding while a tool runs."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx
from scripted_model import EOS, IDS, build_scripted_model, decode, encode, render

from rpegjax.data.example import Example
from rpegjax.envs.calculator import calculator_environment
from rpegjax.envs.protocol import Observation
from rpegjax.envs.rollout import (
    EpisodeConfig,
    EpisodeFinish,
    EpisodeRunner,
    EpisodeTrace,
)
from rpegjax.generate import CacheConfig, Sampler, SamplingConfig, stack_completions
from rpegjax.models.logprobs import token_logprobs
from rpegjax.rewards.arithmetic import ArithmeticTask

SAMPLING = SamplingConfig(max_new_tokens=24, greedy=True, stop_ids=(IDS["</tool>"],))
TWO_TURNS = "<tool>2+3</tool><result>5</result>A:5"


@pytest.fixture(scope="module")
def scripted_model():
    return build_scripted_model()


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def sampler(request, scripted_model):
    cfg, model = scripted_model
    cache = CacheConfig.paged(page_size=4) if request.param == "paged" else None
    return Sampler(cfg, nnx.split(model)[0], num_slots=4, max_prompt_len=8, max_new_tokens=24, chunk_steps=2,
                   window_step=8, cache=cache)


def _runner(sampler, env=None, trace=None, **config):
    config = dict(dict(max_turns=3, token_budget=24), **config)
    return EpisodeRunner(sampler, calculator_environment(instructions="") if env is None else env, SAMPLING,
                         EpisodeConfig(**config), render=render, encode=encode, decode=decode, trace=trace)


def test_two_turn_calculator_episode(sampler, scripted_model):
    _, model = scripted_model
    task = ArithmeticTask()
    example = task.make_example(2, "+", 3)
    episodes = list(_runner(sampler).run(nnx.state(model), [example], group_size=2, key=jax.random.key(0), version=7))
    assert sorted(e.completion.sample_index for e in episodes) == [0, 1]
    for episode in episodes:
        c = episode.completion
        assert decode(c.response_ids) == TWO_TURNS and c.response_ids[-1] == EOS
        assert episode.turns == 2 and episode.finish == EpisodeFinish.DONE and c.version == 7
        assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
        assert episode.messages[2]["content"] == "<result>5</result>"
        assert episode.final_text == "A:5" and task.reward(episode.final_text, example) == 1.0
        np.testing.assert_array_equal(c.model_mask, [True] * 5 + [False] * 3 + [True] * 4)
        np.testing.assert_array_equal(c.behaviour_logprobs[~c.model_mask], 0.0)
        # the model's tokens were sampled with the right context: their behaviour log-probs equal a full forward
        # pass over prompt + turn + tool output + turn (the second turn was prefilled from the extended context)
        tokens = np.concatenate([c.prompt_ids, c.response_ids])[None]
        reference = np.asarray(token_logprobs(model, tokens))[0, c.prompt_ids.size - 1:-1]
        np.testing.assert_allclose(c.behaviour_logprobs[c.model_mask], reference[c.model_mask], atol=1e-5)
        assert np.all(reference[c.model_mask] < -0.1)  # not trivially zero
    batch = stack_completions([e.completion for e in episodes])
    s = episodes[0].completion.prompt_ids.size
    np.testing.assert_array_equal(batch.response_mask[0, s - 1:s - 1 + 12], [1] * 5 + [0] * 3 + [1] * 4)


@pytest.mark.parametrize(("config", "finish", "text"), [
    (dict(max_turns=1), EpisodeFinish.TURN_LIMIT, "<tool>2+3</tool>"),
    (dict(token_budget=8), EpisodeFinish.TOKEN_BUDGET, "<tool>2+3</tool>"),  # the tool output would leave no room
    (dict(token_budget=9), EpisodeFinish.TOKEN_BUDGET, "<tool>2+3</tool><result>5</result>A"),
])
def test_turn_limit_and_token_budget(sampler, scripted_model, config, finish, text):
    example = ArithmeticTask().make_example(2, "+", 3)
    [episode] = _runner(sampler, **config).run(nnx.state(scripted_model[1]), [example], group_size=1,
                                               key=jax.random.key(0))
    assert episode.finish == finish and decode(episode.completion.response_ids) == text
    assert episode.completion.length <= _runner(sampler, **config).config.token_budget


class _GatedCalculator:
    """The calculator, whose tool calls block until `gate` opens (a slow tool); a turn without a call ends."""

    def __init__(self, gate: threading.Event):
        self.inner, self.gate = calculator_environment(instructions=""), gate
        self.call_end = self.inner.call_end

    def reset(self, example):
        return self.inner.reset(example)

    def step(self, messages) -> Observation:
        if self.inner.tool_call(messages[-1]["content"]) is not None and not self.gate.wait(timeout=60):
            raise TimeoutError("the gate never opened: the other episode stopped decoding while this tool ran")
        return self.inner.step(messages)


def test_other_slots_keep_decoding_while_a_tool_runs(sampler, scripted_model):
    """Episode 0 calls a tool that only returns once episode 1 (a long turn without a tool call) has finished:
    the rollout completes only if the controller keeps decoding episode 1 while episode 0's tool waits."""
    gate = threading.Event()

    class OpenOnEpisodeOne(EpisodeTrace):
        def record(self, kind, prompt, sample, turn, decode_calls):
            super().record(kind, prompt, sample, turn, decode_calls)
            if kind == "episode_end" and prompt == 1:
                gate.set()

    trace = OpenOnEpisodeOne()
    examples = [ArithmeticTask().make_example(2, "+", 3), Example(id="long", prompt="y", answer="0", task="none")]
    episodes = list(_runner(sampler, env=_GatedCalculator(gate), trace=trace).run(
        nnx.state(scripted_model[1]), examples, group_size=1, key=jax.random.key(0)))
    by_prompt = {e.completion.prompt_index: e for e in episodes}
    assert decode(by_prompt[0].completion.response_ids) == TWO_TURNS
    assert decode(by_prompt[1].completion.response_ids) == "x" * 24
    events = {(e.kind, e.prompt, e.turn): e for e in trace.events}
    tool_start, tool_end = events[("step_start", 0, 1)], events[("step_end", 0, 1)]
    other_end = events[("episode_end", 1, 1)]
    assert tool_start.seconds <= other_end.seconds <= tool_end.seconds
    assert other_end.decode_calls > tool_start.decode_calls  # decode chunks ran while the tool waited
    assert [e.kind for e in trace.events if e.prompt == 0] == [
        "turn_end", "step_start", "step_end", "readmit", "turn_end", "step_start", "step_end", "episode_end"]


def test_bad_tool_tag_or_budget_is_refused(sampler):
    env = calculator_environment(instructions="", call_end="</tool>")
    with pytest.raises(ValueError, match="must be one of SamplingConfig.stop_sequences"):
        EpisodeRunner(sampler, env, SAMPLING.replace(stop_ids=()), EpisodeConfig(token_budget=8), render=render,
                      encode=encode, decode=decode)
    as_sequence = SAMPLING.replace(stop_ids=(), stop_sequences=((IDS["</tool>"],),))
    EpisodeRunner(sampler, env, as_sequence, EpisodeConfig(token_budget=8), render=render, encode=encode,
                  decode=decode)  # the call end as a stop sequence is accepted
    with pytest.raises(ValueError, match="token_budget=30 exceeds max_new_tokens"):
        EpisodeRunner(sampler, env, SAMPLING, EpisodeConfig(token_budget=30), render=render, encode=encode,
                      decode=decode)


@pytest.mark.parametrize("sampler", ["contiguous"], indirect=True)  # the paged layout adds nothing here
def test_rollout_stage_trains_on_episodes_with_tool_tokens_masked(sampler, scripted_model):
    """`StagePrograms.generate` with an episode runner: pieces of whole groups, the batch's response mask leaves
    out the tool output, the reward reads the last model turn (the task's reward: 1 for `A:5`)."""
    from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
    from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
    from rpegjax.runtime.programs import StagePrograms

    _, model = scripted_model
    task = ArithmeticTask()
    rewards = RewardRunner(task.reward, RewardRunnerConfig(isolation="thread", workers=1))
    examples = [task.make_example(2, "+", 3), task.make_example(2, "+", 2)]  # the script answers 5 to both
    programs = StagePrograms(learner=GRPOLearner(GRPOConfig(group_size=2), model), sampler=sampler, sampling=SAMPLING,
                             group_size=2, rewards=rewards, decode=decode, pad_id=IDS["<pad>"],
                             episodes=_runner(sampler))
    try:
        pieces = list(programs.generate(nnx.state(model), examples, [[0]] * 2, key=jax.random.key(1), version=0,
                                        pieces=2))
        scores = [programs.collect_rewards(piece)[0] for piece in sorted(pieces, key=lambda p: p.index)]
    finally:
        rewards.close()
    assert sorted(p.index for p in pieces) == [0, 1]
    for piece in pieces:
        assert [c.order for c in piece.completions] == [(piece.index, 0), (piece.index, 1)]
        for row, c in enumerate(piece.completions):
            s = c.prompt_ids.size
            assert decode(c.response_ids) == TWO_TURNS
            np.testing.assert_array_equal(piece.batch.response_mask[row, s:s + 12], [1] * 5 + [0] * 3 + [1] * 4)
            assert not piece.batch.response_mask[row, s + 12:].any()
            np.testing.assert_array_equal(piece.batch.token_mask[row, :s + 12], True)
    wrong = task.reward("A:5", examples[1])
    assert wrong < 1.0
    np.testing.assert_array_equal(np.concatenate(scores), np.array([1.0, 1.0, wrong, wrong], np.float32))


def test_held_out_evaluation_of_a_tool_run_answers_in_episodes(sampler, scripted_model):
    """Evaluation decodes greedily through the episode runner: the answer is the whole transcript, judged on the
    last model turn (a single-turn evaluation would stop at the tool call and never see the result)."""
    from rpegjax.train.evaluation import evaluate_accuracy, generate_answers

    _, model = scripted_model
    task = ArithmeticTask()
    examples = [task.make_example(2, "+", 3), task.make_example(1, "+", 1)]  # the script answers 5 to both
    runner = _runner(sampler)
    accuracy, answers = evaluate_accuracy(sampler, nnx.state(model), examples, [], is_correct=task.is_correct,
                                          decode=decode, max_new_tokens=24, episodes=runner)
    assert accuracy == 0.5 and [a.correct for a in answers] == [True, False]
    assert all(a.response == TWO_TURNS and a.finish_reason == EpisodeFinish.DONE for a in answers)
    sampled = generate_answers(sampler, nnx.state(model), examples, [], is_correct=task.is_correct, decode=decode,
                               sampling=SamplingConfig(max_new_tokens=24, temperature=1e-3), samples_per_example=2,
                               episodes=runner)
    assert [[a.correct for a in group] for group in sampled] == [[True, True], [False, False]]
