"""One training or evaluation problem: a prompt, its gold answer, and where it came from."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping

SOLUTION_KEY = "solution"
"""`Example.meta` key of a row's worked solution (GSM8K `answer`, MATH `solution`) when its file has one."""


class DatasetError(ValueError):
    """A dataset row (or a generated example) is malformed; the message names the file and line when known."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example(Mapping):
    """A problem shown to the policy and the answer its reward checks against.

    `prompt` is the raw question (templating into an instruction or a chat turn happens later, see
    `rpegjax.data.prompts`). `answer` is the gold answer as text (a GSM8K number, the content of a MATH
    `\\boxed{}`, a Countdown target...). `task` names the task that knows how to verify it. `meta` holds
    task-specific fields as sorted `(key, value)` string pairs, so an Example stays hashable, immutable and
    picklable (reward functions receive it in worker processes); pass a dict and it is converted.
    `source` is `file:line` for rows read from a file, else empty. `messages` holds a conversational prompt
    (TRL's and verl's format: a list of `{role, content}` messages) as `(role, content)` pairs, and `prompt` is
    then its last user message; such a prompt goes to the model through its chat template. `json_fields` names
    the meta fields that hold a row's non-string value as JSON text (`columns()` decodes them).

    An Example also reads as a (read-only) dict (a user's reward function gets a `dict` copy):
    `example["prompt"]`, `example["answer"]`, `example["id"]`, `example["task"]`, then the `meta` fields
    (a dataset row's further fields), e.g. `example.get("difficulty")`; `dict(example)` copies it.
    """

    id: str
    prompt: str
    answer: str
    task: str
    meta: tuple[tuple[str, str], ...] = ()
    source: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    json_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f" ({self.source})" if self.source else ""
        for name in ("id", "prompt", "answer", "task", "source"):
            if not isinstance(getattr(self, name), str):
                raise DatasetError(f"Example.{name} must be a string, got {getattr(self, name)!r}{where}")
        for name in ("id", "task"):
            if not getattr(self, name):
                raise DatasetError(f"Example.{name} must be non-empty{where}")
        if not self.prompt.strip():
            raise DatasetError(f"Example.prompt is empty (id {self.id!r}){where}")
        meta = self.meta.items() if isinstance(self.meta, Mapping) else self.meta
        pairs = tuple(sorted(tuple(pair) for pair in meta))
        for pair in pairs:
            if len(pair) != 2 or not all(isinstance(part, str) for part in pair):
                raise DatasetError(f"Example.meta entries must be (str, str) pairs, got {pair!r}{where}")
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise DatasetError(f"Example.meta has duplicate keys {keys!r}{where}")
        object.__setattr__(self, "meta", pairs)
        turns = tuple(tuple(turn) for turn in self.messages)
        for turn in turns:
            if len(turn) != 2 or not all(isinstance(part, str) for part in turn):
                raise DatasetError(f"Example.messages entries must be (role, content) string pairs, got {turn!r}{where}")
        object.__setattr__(self, "messages", turns)
        object.__setattr__(self, "json_fields", tuple(sorted(self.json_fields)))
        unknown = sorted(set(self.json_fields) - set(keys))
        if unknown:
            raise DatasetError(f"Example.json_fields names {unknown}, which are not meta fields{where}")

    def meta_value(self, key: str) -> str:
        """The value of `meta[key]`; a missing key raises naming the example."""
        for name, value in self.meta:
            if name == key:
                return value
        raise KeyError(f"example {self.id!r} of task {self.task!r} has no meta field {key!r}; it has {[k for k, _ in self.meta]}")

    def _own(self) -> dict[str, str]:
        return {"prompt": self.prompt, "answer": self.answer, "id": self.id, "task": self.task}

    def __getitem__(self, key: str) -> str:
        own = self._own()
        if key in own:
            return own[key]
        for name, value in self.meta:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        own = self._own()
        yield from own
        yield from (name for name, _ in self.meta if name not in own)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def columns(self) -> dict[str, object]:
        """The fields as a dataset row held them: `dict(self)` with the `json_fields` decoded."""
        row: dict[str, object] = dict(self)
        for key in self.json_fields:
            row[key] = json.loads(row[key])
        return row

    def chat_prompt(self) -> str | list[dict[str, str]]:
        """The prompt as TRL passes it to reward functions: the messages `[{role, content}, ...]` of a
        conversational prompt, else the text."""
        if self.messages:
            return [{"role": role, "content": content} for role, content in self.messages]
        return self.prompt

    def where(self) -> str:
        """`file:line` when known, else the example id — for error messages."""
        return self.source or f"example {self.id!r}"
