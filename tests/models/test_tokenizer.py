"""Tokenizers: a BPE tokenizer built here == transformers' AutoTokenizer on the same files; the built-in one."""

from __future__ import annotations

import json
import time

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rpegjax.models.tokenizer import (
    BUILTIN_CHARACTERS,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TokenizerError,
    builtin_tokenizer,
    load_tokenizer,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Exercises what transformers' environment provides: trim/lstrip of blocks, loop controls, tojson,
# raise_exception and the special-token variables.
CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' and loop.first %}
<|im_start|>system
{{ message['content'] | trim }}<|im_end|>
        {% continue %}
    {%- endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if message.get('meta') %} {{ message['meta'] | tojson }}{% endif %}{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
CORPUS = ["What is 12 + 30? The answer is 42.", "Let's think step by step about the sum of two numbers.",
          "Café owners count coins: 1, 2, 3... \u00fcber schnell!", "def add(a, b):\n    return a + b\n"] * 20
MESSAGES = [{"role": "system", "content": "  You are terse.  "},
            {"role": "user", "content": "What is 2+2?", "meta": {"id": 7, "tag": "<b>é</b>"}},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
TEXTS = ["What is 12 + 30?", "<|im_start|>user\nhi<|im_end|>\n", "über 42\ncafé", "  spaces  and\ttabs ", ""]


def _write_bpe_tokenizer(directory, *, chat_template_in_config=True, pad="<|endoftext|>"):
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
              "pad_token": pad, "model_max_length": 1024}
    if chat_template_in_config:
        config["chat_template"] = CHAT_TEMPLATE
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))
    return directory


@pytest.fixture
def bpe_dir(tmp_path):
    return _write_bpe_tokenizer(tmp_path / "tok")


def test_matches_transformers_auto_tokenizer(bpe_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    ours = load_tokenizer(bpe_dir)
    assert ours.vocab_size == len(reference)
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (reference.eos_token_id, reference.pad_token_id, reference.bos_token_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False), text
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert '{"id": 7, "tag": "<b>é</b>"}' in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_round_trip_and_special_ids(bpe_dir):
    tokenizer = load_tokenizer(bpe_dir)
    text = "Let's think step by step: 12 + 30 = 42."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.encode("<|im_start|>")[0] and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.eos_ids == (tokenizer.eos_id,) and tokenizer.has_chat_template


def test_chat_template_file_takes_priority_and_generation_config_adds_stops(tmp_path):
    directory = _write_bpe_tokenizer(tmp_path / "tok", pad=None)
    (directory / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    endoftext = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_FILE)).token_to_id("<|endoftext|>")
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": [endoftext, 5]}))
    tokenizer = load_tokenizer(directory)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "[a][b]"
    eos = tokenizer.encode("<|im_end|>")[0]
    assert tokenizer.eos_ids == (eos, endoftext, 5)
    assert tokenizer.pad_id == eos  # no pad token: padding uses EOS


def test_missing_and_malformed_files(tmp_path, bpe_dir):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing tokenizer\.json"):
        load_tokenizer(tmp_path)
    (bpe_dir / TOKENIZER_CONFIG_FILE).write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not valid JSON"):
        load_tokenizer(bpe_dir)
    (bpe_dir / TOKENIZER_CONFIG_FILE).unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: missing tokenizer_config\.json"):
        load_tokenizer(bpe_dir)


def test_malformed_tokenizer_json(bpe_dir):
    (bpe_dir / TOKENIZER_FILE).write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot be read by the tokenizers library"):
        load_tokenizer(bpe_dir)


def test_bad_special_tokens_and_templates(bpe_dir):
    config = json.loads((bpe_dir / TOKENIZER_CONFIG_FILE).read_text())
    (bpe_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps({**config, "eos_token": "<missing>"}))
    with pytest.raises(TokenizerError, match=r"eos_token '<missing>' is not in the vocabulary"):
        load_tokenizer(bpe_dir)
    (bpe_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps({**config, "chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: invalid Jinja template"):
        load_tokenizer(bpe_dir)
    (bpe_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    tokenizer = load_tokenizer(bpe_dir)
    assert not tokenizer.has_chat_template
    with pytest.raises(TokenizerError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match=r"id 100000 at position 1 is outside the vocabulary"):
        tokenizer.decode([1, 100000])


def test_template_errors_are_reported(bpe_dir):
    tokenizer = load_tokenizer(bpe_dir)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match="message 0 must be a dict with a 'role'"):
        tokenizer.apply_chat_template([{"content": "x"}])


def test_template_sandbox_blocks_python_internals(tmp_path):
    directory = _write_bpe_tokenizer(tmp_path / "tok")
    (directory / CHAT_TEMPLATE_FILE).write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match="chat template failed"):
        load_tokenizer(directory).apply_chat_template([{"role": "user", "content": "x"}])


# ---- built-in ------------------------------------------------------------------------------------------------
def test_builtin_layout_and_round_trip():
    tokenizer = builtin_tokenizer()
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.eos_ids) == (0, 1, 2, (1,))
    assert tokenizer.vocab_size == 3 + len(BUILTIN_CHARACTERS) == 99 <= 128
    assert not tokenizer.has_chat_template
    text = "".join(BUILTIN_CHARACTERS)
    ids = tokenizer.encode(text)
    assert ids == [3 + i for i in range(len(text))]  # one id per character, in table order
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("a\nb", add_special_tokens=True) == [2, 3 + BUILTIN_CHARACTERS.index("a"), 3, 3 + BUILTIN_CHARACTERS.index("b")]
    assert tokenizer.decode([2, 4, 1, 0, 0]) == " "
    assert tokenizer.decode([2, 4, 1, 0], skip_special_tokens=False) == "<bos> <eos><pad>"
    assert tokenizer.encode("") == [] and tokenizer.decode([]) == ""


def test_builtin_errors():
    tokenizer = builtin_tokenizer()
    with pytest.raises(TokenizerError, match=r"unsupported character '\\t' at index 3"):
        tokenizer.encode("abc\tdef")
    with pytest.raises(TokenizerError, match="unsupported character 'é' at index 1"):
        tokenizer.encode("héllo")
    for bad in (99, -1, 300):
        with pytest.raises(TokenizerError, match=rf"id {bad} at position 2 is outside the vocabulary \[0, 99\)"):
            tokenizer.decode([5, 6, bad])
    with pytest.raises(TokenizerError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_builtin_is_deterministic_and_fast():
    tokenizer, other = builtin_tokenizer(), builtin_tokenizer()
    prompts = [f"Q{i}: what is {i} * {i + 3}? Answer:\n" for i in range(5000)]
    start = time.perf_counter()
    encoded = [tokenizer.encode(p) for p in prompts]
    decoded = [tokenizer.decode(ids) for ids in encoded]
    elapsed = time.perf_counter() - start
    assert decoded == prompts and encoded == [other.encode(p) for p in prompts]
    assert elapsed < 1.0, f"5000 encode+decode took {elapsed:.3f}s"  # ~0.02 s measured; generous for a shared CPU
