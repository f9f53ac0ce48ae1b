"""Prompt templating, with and without a chat template."""

import re

import jinja2.sandbox
import pytest

from rpegjax.data.example import Example
from rpegjax.data.prompts import ChatTokenizer, PromptTemplate
from rpegjax.rewards.format import format_reward

# ChatML, as Qwen2 ships it (simplified: no tools).
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EXAMPLE = Example(id="q1", prompt="What is 1/4 + 1/4?", answer="1/2", task="math")


class ChatTemplateTokenizer:
    """A test double: renders a Jinja chat template the way transformers does (sandboxed environment)."""

    def __init__(self, template):
        self._template = None if template is None else jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)
        self.calls = []

    @property
    def has_chat_template(self):
        return self._template is not None

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        self.calls.append((messages, add_generation_prompt))
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_plain_templates():
    assert PromptTemplate.raw().render(EXAMPLE) == "What is 1/4 + 1/4?"
    assert PromptTemplate.plain().render(EXAMPLE) == "What is 1/4 + 1/4?\nAnswer:"
    think = PromptTemplate.think().render(EXAMPLE)
    assert think.endswith("\n\nWhat is 1/4 + 1/4?") and "<think> </think>" in think and "\\boxed{}" in think
    with_system = PromptTemplate(template="Q: {question}", system="Be brief.")
    assert with_system.render(EXAMPLE) == "Be brief.\n\nQ: What is 1/4 + 1/4?"
    braces = PromptTemplate(template="{{literal}} {question}")
    assert braces.render(EXAMPLE) == "{literal} What is 1/4 + 1/4?"


def test_chat_template_is_used_when_the_tokenizer_has_one():
    tokenizer = ChatTemplateTokenizer(CHATML)
    assert isinstance(tokenizer, ChatTokenizer)
    text = PromptTemplate(template="{question}\nAnswer:", system="You are a careful solver.").render(EXAMPLE, tokenizer)
    assert text == (
        "<|im_start|>system\nYou are a careful solver.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1/4 + 1/4?\nAnswer:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.calls[-1][1] is True
    no_system = PromptTemplate.raw().render(EXAMPLE, tokenizer)
    assert no_system == "<|im_start|>user\nWhat is 1/4 + 1/4?<|im_end|>\n<|im_start|>assistant\n"
    # The think-format instruction survives the chat template, and its requested shape is what format_reward accepts.
    assert "<think> </think>" in PromptTemplate.think().render(EXAMPLE, tokenizer)
    assert format_reward("<think>1/4+1/4=2/4</think>\\boxed{1/2}") == 1.0


def test_without_a_chat_template_the_text_is_used_directly():
    tokenizer = ChatTemplateTokenizer(None)
    assert PromptTemplate.plain().render(EXAMPLE, tokenizer) == "What is 1/4 + 1/4?\nAnswer:"
    assert PromptTemplate(chat_template="none").render(EXAMPLE, ChatTemplateTokenizer(CHATML)) == EXAMPLE.prompt
    assert tokenizer.calls == []


def test_builtin_tokenizer_prompts_are_raw():
    tokenizer_module = pytest.importorskip("rpegjax.models.tokenizer")
    tokenizer = tokenizer_module.builtin_tokenizer()
    assert PromptTemplate.raw().render(EXAMPLE, tokenizer) == EXAMPLE.prompt
    assert PromptTemplate.raw().render_all([EXAMPLE, EXAMPLE], tokenizer) == [EXAMPLE.prompt] * 2


@pytest.mark.parametrize("template", ["no field", "{q}", "{question} {other}", "{question:>10}", "{question!r}", "{", "{0}"])
def test_bad_templates_are_rejected(template):
    with pytest.raises(ValueError, match="PromptTemplate.template"):
        PromptTemplate(template=template)


def test_a_template_returning_ids_is_an_error():
    class IdsTokenizer(ChatTemplateTokenizer):
        def apply_chat_template(self, messages, *, add_generation_prompt=True):
            return [1, 2, 3]

    with pytest.raises(TypeError, match="expected str"):
        PromptTemplate.raw().render(EXAMPLE, IdsTokenizer(CHATML))


def test_chat_template_modes():
    chat, plain = ChatTemplateTokenizer(CHATML), ChatTemplateTokenizer(None)
    expected = "<|im_start|>user\nWhat is 1/4 + 1/4?<|im_end|>\n<|im_start|>assistant\n"
    assert PromptTemplate(chat_template="auto").render(EXAMPLE, chat) == expected
    assert PromptTemplate(chat_template="required").render(EXAMPLE, chat) == expected
    assert PromptTemplate(chat_template="auto").render(EXAMPLE, plain) == EXAMPLE.prompt
    assert PromptTemplate(chat_template="none").render(EXAMPLE, chat) == EXAMPLE.prompt
    with pytest.raises(ValueError, match="chat_template='required' but the tokenizer has no chat template"):
        PromptTemplate(chat_template="required").render(EXAMPLE, plain)
    with pytest.raises(ValueError, match="chat_template must be one of"):
        PromptTemplate(chat_template="always")


CONVERSATION = Example(id="c1", prompt="And 1/3 + 1/3?", answer="2/3", task="math", source="chat.jsonl:4",
                       messages=[("system", "Answer in \\boxed{}."), ("user", "What is 1/4 + 1/4?"),
                                 ("assistant", "\\boxed{1/2}"), ("user", "And 1/3 + 1/3?")])


def test_a_conversational_prompt_goes_through_the_chat_template_as_messages():
    """TRL's conversational format: the messages as they are, the template on the last user message."""
    tokenizer = ChatTemplateTokenizer(CHATML)
    text = PromptTemplate(template="{question}\nAnswer:").render(CONVERSATION, tokenizer)
    assert text == ("<|im_start|>system\nAnswer in \\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is 1/4 + 1/4?<|im_end|>\n"
                    "<|im_start|>assistant\n\\boxed{1/2}<|im_end|>\n<|im_start|>user\nAnd 1/3 + 1/3?\nAnswer:<|im_end|>\n"
                    "<|im_start|>assistant\n")
    one_turn = Example(id="c2", prompt="Hi", answer="1", task="math", messages=[("user", "Hi")])
    with_system = PromptTemplate(system="Be brief.").render(one_turn, tokenizer)
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>")


@pytest.mark.parametrize("template, tokenizer, message", [
    (PromptTemplate(), None, "chat.jsonl:4: a conversational prompt (a list of messages) needs a tokenizer with a chat "
                             "template, and this one has none"),
    (PromptTemplate(), ChatTemplateTokenizer(None), "needs a tokenizer with a chat template"),
    (PromptTemplate(chat_template="none"), ChatTemplateTokenizer(CHATML), "but chat_template is 'none'"),
    (PromptTemplate(system="x"), ChatTemplateTokenizer(CHATML), "has its own system message and a system prompt"),
])
def test_a_conversational_prompt_without_a_chat_template_is_an_error(template, tokenizer, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        template.render(CONVERSATION, tokenizer)


def test_loaded_verl_and_trl_rows_render_through_the_chat_template(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rpegjax.data.files import load_examples

    verl = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "verl.parquet")
    trl = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"}]
    (tmp_path / "trl.jsonl").write_text(json.dumps(trl[0]) + "\n")
    tokenizer = ChatTemplateTokenizer(CHATML)
    [verl_example] = load_examples(tmp_path / "verl.parquet")
    [trl_example] = load_examples(tmp_path / "trl.jsonl")
    assert PromptTemplate().render(verl_example, tokenizer) == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert PromptTemplate().render(trl_example, tokenizer) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="trl.jsonl:1: a conversational prompt .* needs a tokenizer with a chat template"):
        PromptTemplate().render(trl_example, None)
