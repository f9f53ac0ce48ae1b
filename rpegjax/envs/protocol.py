"""The environment protocol of multi-turn rollouts, and the tagged-tool environment the built-in tools use.

An episode is a conversation: `reset(example)` gives its opening messages (rendered into the prompt),
then after every model turn the driver (`rpegjax.envs.rollout`) appends the turn as an assistant message and
calls `step(messages)`: the environment runs the tool call the turn ends with and answers an `Observation`,
whose text is appended to the episode as tool tokens (context the model reads, never a loss term), or ends the
episode (`done`), optionally with its reward (None: the task's reward of the last model turn decides).

A `TaggedToolEnvironment` recognises a tool call as a span `<open>argument</close>` that ends the turn: the
sampler stops on the close tag's tokens (a `SamplingConfig.stop_sequences` entry), the tool runs on the argument and
its output comes back wrapped as `<result_open>output<result_close>`. A turn without a tool call ends the
episode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from rpegjax.data.example import Example

Message = dict[str, str]  # {"role": "system" | "user" | "assistant" | "tool", "content": text}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """What an environment answers a turn with: `text` to append as tool tokens (ignored when `done`), whether
    the episode ends, and the episode's reward when it does (None: the task's reward of the last turn)."""

    text: str = ""
    done: bool
    reward: float | None = None


class Environment(Protocol):
    """A multi-turn environment; `step` may be called from worker threads, for several episodes at once, so it
    must keep no per-episode state outside `messages`."""

    @property
    def call_end(self) -> str:
        """The text that ends a turn with a tool call (the sampler stops on its tokens)."""
        ...

    def reset(self, example: Example) -> list[Message]:
        """The opening messages of an episode on `example`."""
        ...

    def step(self, messages: Sequence[Message]) -> Observation:
        """The answer to the last message (the model's turn)."""
        ...


WorkedEpisode = list[tuple[str, bool]]
"""An episode written out for supervised training: its texts in order after the prompt, each with whether it is
the model's (trained) or the tool's (context)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaggedToolEnvironment:
    """An environment of one tool called as `<open>argument<close>` at the end of a turn; `tool(argument)`
    returns the output text (errors are outputs too: the model should see them). `instructions` is prepended to
    the user's message so the model knows the tool."""

    name: str
    tool: Callable[[str], str]
    call_start: str
    call_end: str
    result_start: str
    result_end: str
    instructions: str = ""

    def __post_init__(self) -> None:
        for field in ("call_start", "call_end", "result_start", "result_end"):
            if not getattr(self, field):
                raise ValueError(f"TaggedToolEnvironment({self.name}).{field} must be non-empty")

    def reset(self, example: Example) -> list[Message]:
        return [{"role": "user", "content": self.instructions + example.prompt}]

    def tool_call(self, text: str) -> str | None:
        """The argument of the tool call `text` ends with, or None when it ends with none."""
        if not text.endswith(self.call_end):
            return None
        start = text.rfind(self.call_start)
        if start < 0:
            return None
        return text[start + len(self.call_start): len(text) - len(self.call_end)]

    def worked_episode(self, argument: str, answer: str) -> WorkedEpisode:
        """A model turn that calls the tool on `argument`, the tool's real output, and a last turn `answer`."""
        return [(self.call_start + argument + self.call_end, True),
                (self.result_start + self.tool(argument) + self.result_end, False), (answer, True)]

    def step(self, messages: Sequence[Message]) -> Observation:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(f"{self.name}: step needs the model's turn as the last message, got "
                             f"{messages[-1] if messages else 'no messages'}")
        argument = self.tool_call(messages[-1]["content"])
        if argument is None:
            return Observation(done=True)
        return Observation(text=self.result_start + self.tool(argument) + self.result_end, done=False)
