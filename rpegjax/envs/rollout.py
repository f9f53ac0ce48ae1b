"""Multi-turn rollouts: the sampler's continuous batching drives episodes of model turns and tool calls.

Every episode starts as one sample of its prompt's group (`Sampler.stream`, prompts rendered from
`env.reset(example)`). When a turn finishes, its text is appended as an assistant message and
`env.step(messages)` runs on a worker thread; the controller meanwhile keeps decoding the other slots (the
turn's slot is free already). The observation's tokens are appended to the episode and the extended
context comes back to the sampler as a new request (`generate.requests.RequestFeed`), admitted into the next
free slot like a prompt (prefilled again: the slot's cache was released) with what is left of the episode's
token budget. So a slow tool holds no slot and stalls no other sequence.

An episode ends when the environment says so (a turn without a tool call), after `max_turns` model turns,
or when its `token_budget` (model and tool tokens after the prompt) is spent. Its `Completion` holds the prompt
and every turn and observation in order; `model_mask` is False at observation tokens, whose behaviour log-probs
are 0 and which the training batch keeps out of the loss (`learners.batch.pack_rollouts` loss masks).

PRNG streams: turn k of sample s of prompt p draws with (p, k * group_size + s, step), a function of the
episode alone, so results do not depend on tool timing or slot order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from rpegjax.data.example import Example
from rpegjax.envs.protocol import Environment, Message, Observation
from rpegjax.generate.completion import Completion, FinishReason
from rpegjax.generate.requests import Request
from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig


class EpisodeFinish(enum.StrEnum):
    DONE = "done"  # the environment ended it
    TURN_LIMIT = "turn_limit"  # max_turns model turns were taken
    TOKEN_BUDGET = "token_budget"  # no room left in the episode's token budget


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """`max_turns`: model turns per episode; `token_budget`: response tokens per episode, model and tool
    together (at most the sampler's max_new_tokens, so the episode fits a training row); `tool_workers`: environment
    steps run at once; `step_timeout_s`: the longest wait for one step (a hung environment is an error)."""

    max_turns: int = 4
    token_budget: int
    tool_workers: int = 4
    step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "token_budget", "tool_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EpisodeConfig.{name} must be a positive integer, got {value!r}")
        value = self.step_timeout_s
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"EpisodeConfig.step_timeout_s must be a positive number of seconds, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Episode:
    """A finished episode: the training row (`completion`, tool tokens masked), its conversation, how it ended
    and the environment's reward (None: the task's reward of `final_text` decides)."""

    completion: Completion
    messages: list[Message]
    turns: int
    finish: EpisodeFinish
    reward: float | None

    @property
    def final_text(self) -> str:
        """The last model turn: what the task's reward reads (tool output never counts as the answer)."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "assistant")


@dataclasses.dataclass(frozen=True)
class EpisodeEvent:
    """One entry of an `EpisodeTrace`: `decode_calls` is the sampler's count of decode chunks at that moment."""

    seconds: float
    kind: str  # turn_end | step_start | step_end | readmit | episode_end
    prompt: int
    sample: int
    turn: int
    decode_calls: int


class EpisodeTrace:
    """Thread-safe record of episode events (environment steps run on worker threads)."""

    def __init__(self) -> None:
        self.events: list[EpisodeEvent] = []
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def record(self, kind: str, prompt: int, sample: int, turn: int, decode_calls: int) -> None:
        with self._lock:
            self.events.append(EpisodeEvent(time.monotonic() - self._start, kind, prompt, sample, turn, decode_calls))


@dataclasses.dataclass
class _Running:
    prompt: int
    sample: int
    prompt_ids: np.ndarray
    messages: list[Message]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    turns: int = 0
    last_finish: FinishReason = FinishReason.LENGTH


class EpisodeRunner:
    """Runs the episodes of one rollout (see the module docstring): the sampler's `RequestFeed`, and the
    generator of finished `Episode`s (`run`)."""

    def __init__(self, sampler: Sampler, env: Environment, sampling: SamplingConfig, config: EpisodeConfig, *,
                 render: Callable[[Sequence[Message]], list[int]], encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], trace: EpisodeTrace | None = None):
        call_end = tuple(encode(env.call_end))
        if not call_end or (call_end not in sampling.stop_sequences
                            and not (len(call_end) == 1 and call_end[0] in sampling.stop_ids)):
            raise ValueError(f"the environment's tool call ends with {env.call_end!r}, which encodes to {list(call_end)}; "
                             f"it must be one of SamplingConfig.stop_sequences {sampling.stop_sequences} (or, as one "
                             f"token, of stop_ids {sampling.stop_ids}), so that the sampler stops a turn at the call")
        if config.token_budget > min(sampler.max_new_tokens, sampling.max_new_tokens):
            raise ValueError(f"EpisodeConfig.token_budget={config.token_budget} exceeds max_new_tokens (sampler "
                             f"{sampler.max_new_tokens}, sampling {sampling.max_new_tokens}): an episode must fit a row")
        self.sampler, self.env, self.sampling, self.config = sampler, env, sampling, config
        self.render, self.encode, self.decode = render, encode, decode
        self.trace = trace

    def with_sampling(self, sampling: SamplingConfig) -> EpisodeRunner:
        """This runner decoding with `sampling` (e.g. greedy, for evaluation), its turns still stopping at the
        tool call's closing tag."""
        sampling = sampling.replace(stop_ids=self.sampling.stop_ids, stop_sequences=self.sampling.stop_sequences)
        return EpisodeRunner(self.sampler, self.env, sampling, self.config, render=self.render, encode=self.encode,
                             decode=self.decode, trace=self.trace)

    def run(self, params, examples: Sequence[Example], *, group_size: int, key: jax.Array,
            version: int | None = None, stats=None) -> Iterator[Episode]:
        """Yields every episode (group_size per example) as it finishes; `Episode.completion.prompt_index` is the
        example's index. `stats`: a `SamplerStats` that also counts this run's decode chunks."""
        run = _Rollout(self, examples, group_size, version)
        prompts = [episodes[0].prompt_ids.tolist() for episodes in run.groups]
        stream = self.sampler.stream(params, prompts, self.sampling, group_size=group_size, key=key, version=version,
                                     budgets=[self.config.token_budget] * len(prompts), feed=run, stats=stats)
        try:
            for completion in stream:
                run.turn_finished(completion)
                yield from run.take_finished()
            yield from run.take_finished()
        finally:
            run.pool.shutdown(wait=False, cancel_futures=True)


class _Rollout:
    """The state of one `EpisodeRunner.run`: episodes, environment steps in flight, requests to feed."""

    def __init__(self, runner: EpisodeRunner, examples: Sequence[Example], group_size: int, version: int | None):
        self.runner, self.group_size, self.version = runner, group_size, version
        self.groups: list[list[_Running]] = []
        for index, example in enumerate(examples):
            messages = list(runner.env.reset(example))
            ids = np.asarray(runner.render(messages), np.int32)
            self.groups.append([_Running(index, sample, ids, [dict(m) for m in messages]) for sample in range(group_size)])
        self.fed: list[_Running] = []  # the episode of fed request k (the sampler's request len(examples) + k)
        self.ready: list[Request] = []
        self.finished: list[Episode] = []
        self.answers: queue.Queue = queue.Queue()  # (episode, future of its step)
        self.in_flight = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(runner.config.tool_workers, thread_name_prefix="rpegjax-env")

    def _record(self, kind: str, episode: _Running) -> None:
        if self.runner.trace is not None:
            self.runner.trace.record(kind, episode.prompt, episode.sample, episode.turns,
                                     self.runner.sampler.stats.decode_calls)

    # ---- the sampler side -------------------------------------------------------------------------
    def turn_finished(self, completion: Completion) -> None:
        index = completion.prompt_index
        episode = (self.groups[index][completion.sample_index] if index < len(self.groups)
                   else self.fed[index - len(self.groups)])
        episode.tokens += completion.response_ids.tolist()
        episode.logprobs += completion.behaviour_logprobs.tolist()
        episode.mask += [True] * completion.length
        episode.turns += 1
        episode.last_finish = completion.finish_reason
        episode.messages.append({"role": "assistant", "content": self.runner.decode(completion.response_ids)})
        self._record("turn_end", episode)
        if len(episode.tokens) >= self.runner.config.token_budget:
            self._finish(episode, EpisodeFinish.TOKEN_BUDGET, None)
            return
        self._record("step_start", episode)
        self.in_flight += 1
        future = self.pool.submit(self.runner.env.step, list(episode.messages))
        future.add_done_callback(lambda f, e=episode: self.answers.put((e, f)))

    def poll(self) -> list[Request]:
        while True:
            try:
                self._answered(*self.answers.get_nowait())
            except queue.Empty:
                break
        ready, self.ready = self.ready, []
        return ready

    def wait(self) -> list[Request]:
        while not self.ready and self.in_flight:
            try:
                answer = self.answers.get(timeout=self.runner.config.step_timeout_s)
            except queue.Empty:
                raise TimeoutError(f"an environment step took longer than EpisodeConfig.step_timeout_s="
                                   f"{self.runner.config.step_timeout_s}") from None
            self._answered(*answer)
        return self.poll()

    # ---- the environment side ---------------------------------------------------------------------
    def _answered(self, episode: _Running, future: concurrent.futures.Future) -> None:
        self.in_flight -= 1
        observation: Observation = future.result()  # an environment that raises fails the rollout, loudly
        self._record("step_end", episode)
        config = self.runner.config
        if observation.done:
            self._finish(episode, EpisodeFinish.DONE, observation.reward)
            return
        if episode.turns >= config.max_turns:
            self._finish(episode, EpisodeFinish.TURN_LIMIT, None)
            return
        ids = self.runner.encode(observation.text)
        left = config.token_budget - len(episode.tokens) - len(ids)
        if left < 1:  # the output leaves no room for a model token
            self._finish(episode, EpisodeFinish.TOKEN_BUDGET, None)
            return
        episode.tokens += ids
        episode.logprobs += [0.0] * len(ids)
        episode.mask += [False] * len(ids)
        episode.messages.append({"role": "tool", "content": observation.text})
        self.fed.append(episode)
        self.ready.append(Request(tokens=np.concatenate([episode.prompt_ids, np.asarray(episode.tokens, np.int32)]),
                                  budget=left, samples=1, key_index=episode.prompt,
                                  first_sample=episode.turns * self.group_size + episode.sample))
        self._record("readmit", episode)

    def _finish(self, episode: _Running, finish: EpisodeFinish, reward: float | None) -> None:
        completion = Completion(
            prompt_index=episode.prompt, sample_index=episode.sample, prompt_ids=episode.prompt_ids.copy(),
            response_ids=np.asarray(episode.tokens, np.int32), behaviour_logprobs=np.asarray(episode.logprobs, np.float32),
            finish_reason=episode.last_finish, version=self.version, model_mask=np.asarray(episode.mask, bool))
        self.finished.append(Episode(completion=completion, messages=episode.messages, turns=episode.turns,
                                     finish=finish, reward=reward))
        self._record("episode_end", episode)

    def take_finished(self) -> list[Episode]:
        finished, self.finished = self.finished, []
        return finished
