"""Turn an `Example` into the text the policy continues: a template, then the chat template if any."""

from __future__ import annotations

import dataclasses
import enum
import string
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from rpegjax.data.example import Example

_THINK_INSTRUCTION = (
    "Solve the problem. First think step by step inside <think> </think>, "
    "then give the final answer in \\boxed{{}}.\n\n{question}"
)


@runtime_checkable
class ChatTokenizer(Protocol):
    """What prompting needs from a tokenizer (`rpegjax.models.tokenizer.Tokenizer` provides it)."""

    @property
    def has_chat_template(self) -> bool: ...

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str: ...


class ChatTemplateMode(enum.StrEnum):
    AUTO = "auto"  # the tokenizer's chat template when it has one (an instruct model), else the plain text
    NONE = "none"  # never: the plain text (a base model, or prompts already in the model's format)
    REQUIRED = "required"  # always: a tokenizer without a chat template is an error


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptTemplate:
    """`template` with a `{question}` field (literal braces doubled, `{{ }}`) becomes the user turn;
    `system`, if set, the system turn. Under `chat_template` (`ChatTemplateMode`) the turns go through
    `tokenizer.apply_chat_template(..., add_generation_prompt=True)`; otherwise the text is
    `system + "\\n\\n" + user` (or just the user turn). A conversational example (TRL's list of messages)
    keeps its messages, the template applied to its last user message (`conversation`)."""

    template: str = "{question}"
    system: str | None = None
    chat_template: ChatTemplateMode = ChatTemplateMode.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.template, str):
            raise ValueError(f"PromptTemplate.template must be a string, got {self.template!r}")
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(self.template)]
        except ValueError as error:
            raise ValueError(f"PromptTemplate.template {self.template!r} is malformed ({error}); double literal braces") from None
        fields = [field for field in fields if field[0] is not None]
        if not fields or any(field != ("question", "", None) for field in fields):
            raise ValueError(
                f"PromptTemplate.template must use the field {{question}} and no other field or format spec, got {self.template!r}"
            )
        if self.system is not None and not isinstance(self.system, str):
            raise ValueError(f"PromptTemplate.system must be a string or None, got {self.system!r}")
        try:
            object.__setattr__(self, "chat_template", ChatTemplateMode(self.chat_template))
        except ValueError:
            raise ValueError(f"PromptTemplate.chat_template must be one of {[m.value for m in ChatTemplateMode]}, "
                             f"got {self.chat_template!r}") from None

    def uses_chat_template(self, tokenizer: ChatTokenizer | None) -> bool:
        """Whether prompts for `tokenizer` go through its chat template; `REQUIRED` without one raises."""
        has_template = tokenizer is not None and tokenizer.has_chat_template
        if self.chat_template is ChatTemplateMode.REQUIRED and not has_template:
            raise ValueError("PromptTemplate.chat_template='required' but the tokenizer has no chat template "
                             "(use 'auto' or 'none' for a base model)")
        return has_template and self.chat_template is not ChatTemplateMode.NONE

    @classmethod
    def raw(cls) -> PromptTemplate:
        """The question as it is (the built-in tasks' prompts are already in their training format)."""
        return cls(template="{question}")

    @classmethod
    def plain(cls) -> PromptTemplate:
        return cls(template="{question}\nAnswer:")

    @classmethod
    def think(cls) -> PromptTemplate:
        """Ask for `<think>…</think>` reasoning, then a boxed answer (what `format_reward` checks)."""
        return cls(template=_THINK_INSTRUCTION)

    def user_message(self, example: Example) -> str:
        return self.template.format(question=example.prompt)

    def render(self, example: Example, tokenizer: ChatTokenizer | None = None) -> str:
        """The prompt text for `example` (see the class docstring); a conversational example (`Example.messages`)
        always goes through the chat template (`conversation`)."""
        if example.messages:
            return self._apply(self.conversation(example, tokenizer), tokenizer, example)
        user = self.user_message(example)
        if self.uses_chat_template(tokenizer):
            messages = [{"role": "system", "content": self.system}] if self.system is not None else []
            messages.append({"role": "user", "content": user})
            return self._apply(messages, tokenizer, example)
        return user if self.system is None else f"{self.system}\n\n{user}"

    def conversation(self, example: Example, tokenizer: ChatTokenizer | None) -> list[dict[str, str]]:
        """The messages of a conversational example: its own, the template applied to its last user message,
        `system` as the first message when set (a conversation with its own system message and `system` set is
        an error). It needs the tokenizer's chat template: without one, or under `chat_template='none'`, it is
        an error (flattening the messages into text would train on a format the model was not given)."""
        where = example.where()
        if self.chat_template is ChatTemplateMode.NONE:
            raise ValueError(f"{where}: a conversational prompt (a list of messages) goes through the tokenizer's "
                             "chat template, but chat_template is 'none'")
        if tokenizer is None or not tokenizer.has_chat_template:
            raise ValueError(f"{where}: a conversational prompt (a list of messages) needs a tokenizer with a chat "
                             "template, and this one has none (give --model an instruct model's directory, or "
                             "write the prompts as text)")
        roles = [role for role, _ in example.messages]
        if self.system is not None and "system" in roles:
            raise ValueError(f"{where}: the conversation has its own system message and a system prompt is set too; "
                             "drop one")
        last_user = len(roles) - 1 - roles[::-1].index("user")
        messages = [{"role": role, "content": self.template.format(question=content) if i == last_user else content}
                    for i, (role, content) in enumerate(example.messages)]
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + messages

    @staticmethod
    def _apply(messages: list[dict[str, str]], tokenizer: ChatTokenizer, example: Example) -> str:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str (example {example.id!r})")
        return text

    def render_all(self, examples: Sequence[Example], tokenizer: ChatTokenizer | None = None) -> list[str]:
        return [self.render(example, tokenizer) for example in examples]
