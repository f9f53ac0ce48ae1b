"""Tokenizers: Hugging Face `tokenizer.json` checkpoints and a file-free character-level built-in.

Both implement `Tokenizer`: `encode`/`decode`, the special ids the sampler and the rewards need
(`eos_ids` are all ids that stop generation) and chat-template rendering. Chat templates are Jinja
rendered in a sandbox with the same environment settings and helpers as `transformers`
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`).
"""

from __future__ import annotations

import abc
import datetime
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rpegjax.models.json_files import read_json_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
_SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer file that is missing or malformed, or text / ids a tokenizer cannot handle."""


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes; transformers' templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str, *, origin: str = "chat template") -> jinja2.Template:
    """Compiles a chat template in a sandboxed environment configured like `transformers`'."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise TokenizerError(f"{origin}: invalid Jinja template at line {error.lineno}: {error.message}") from None


class Tokenizer(abc.ABC):
    """Text <-> token ids, special ids and chat-template rendering."""

    def __init__(self, *, chat_template: str | None, special_tokens: Mapping[str, str], origin: str):
        self._chat_template_source = chat_template
        self._chat_template = None if chat_template is None else compile_chat_template(chat_template, origin=origin)
        self._special_tokens = dict(special_tokens)  # template variables such as eos_token="<|im_end|>"
        self._origin = origin

    @abc.abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` also the tokenizer's BOS/EOS framing."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; raises TokenizerError for an id outside the vocabulary."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def pad_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a response (the EOS token first, then e.g. `generation_config.json`'s extra stops)."""

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the chat template, as transformers does."""
        if self._chat_template is None:
            raise TokenizerError(f"{self._origin}: this tokenizer has no chat template; use the prompt text directly")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TokenizerError(f"apply_chat_template: messages must be a list of dicts, got {type(messages).__name__}")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise TokenizerError(f"apply_chat_template: message {index} must be a dict with a 'role', got {message!r}")
        try:
            return self._chat_template.render(messages=[dict(message) for message in messages],
                                              add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except jinja2.exceptions.TemplateError as error:
            raise TokenizerError(f"{self._origin}: chat template failed: {error}") from None


# ---- Hugging Face tokenizer.json ----------------------------------------------------------------------------
def _token_content(value: Any, *, field: str, source: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{source}: {field} must be a string or an object with 'content', got {value!r}")


def _read_json_object(path: Path) -> dict:
    return read_json_object(path, TokenizerError)


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of `tokenizer_config.json`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        extra_eos_ids: Sequence[int] = (),
        origin: str,
    ):
        super().__init__(chat_template=chat_template, special_tokens=special_tokens, origin=origin)
        self._backend = backend

        def token_id(field: str) -> int | None:
            token = special_tokens.get(field)
            if token is None:
                return None
            index = backend.token_to_id(token)
            if index is None:
                raise TokenizerError(f"{origin}: {field} {token!r} is not in the vocabulary of {TOKENIZER_FILE}")
            return index

        eos = token_id("eos_token")
        if eos is None and not extra_eos_ids:
            raise TokenizerError(
                f"{origin}: no eos_token in {TOKENIZER_CONFIG_FILE} and no eos_token_id in {GENERATION_CONFIG_FILE}")
        self._eos_ids = tuple(dict.fromkeys(([eos] if eos is not None else []) + list(extra_eos_ids)))
        self._bos = token_id("bos_token")
        pad = token_id("pad_token")
        self._pad = self._eos_ids[0] if pad is None else pad  # the usual fallback; padding is masked anyway
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode: text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        for position, index in enumerate(ids):
            if not 0 <= index < self._vocab_size:
                raise TokenizerError(
                    f"decode: id {index} at position {position} is outside the vocabulary [0, {self._vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_ids[0]

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids


def _chat_template_from_config(value: Any, source: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(f"{source}: chat_template must be a string or a list with a 'default' entry, got {value!r:.200}")


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """Loads `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, which takes priority over the
    config's `chat_template`, and `generation_config.json`'s eos ids) from a local directory."""
    directory = Path(path)
    tokenizer_path, config_path = directory / TOKENIZER_FILE, directory / TOKENIZER_CONFIG_FILE
    for required in (tokenizer_path, config_path):
        if not required.is_file():
            raise TokenizerError(f"{required}: missing {required.name} in tokenizer directory {directory}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # the Rust library raises a bare Exception for malformed files
        raise TokenizerError(f"{tokenizer_path}: cannot be read by the tokenizers library ({error})") from None
    config = _read_json_object(config_path)
    special = {}
    for field in _SPECIAL_TOKEN_FIELDS:
        content = _token_content(config.get(field), field=field, source=config_path)
        if content is not None:
            special[field] = content
    # transformers treats the named special tokens as special (skipped by decode) even when tokenizer.json does not
    known = [content for content in special.values() if backend.token_to_id(content) is not None]
    backend.add_special_tokens([tokenizers.AddedToken(content, special=True, normalized=False) for content in known])
    template_path = directory / CHAT_TEMPLATE_FILE
    if template_path.is_file():
        chat_template, origin = template_path.read_text(encoding="utf-8"), str(template_path)
    else:
        chat_template, origin = _chat_template_from_config(config.get("chat_template"), config_path), str(config_path)
    extra_eos: list[int] = []
    generation_path = directory / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        value = _read_json_object(generation_path).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) for v in values):
            raise TokenizerError(f"{generation_path}: eos_token_id must be an int or a list of ints, got {value!r}")
        extra_eos = values
    return HFTokenizer(backend, special_tokens=special, chat_template=chat_template, extra_eos_ids=extra_eos, origin=origin)


# ---- built-in character-level tokenizer ---------------------------------------------------------------------
BUILTIN_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
BUILTIN_CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII


class CharTokenizer(Tokenizer):
    """One id per character: `<pad>`=0, `<eos>`=1, `<bos>`=2, then newline and printable ASCII (vocab 99).

    Every id fits in a byte, so encoding and decoding are single `bytes.translate` calls.
    Special tokens are never parsed out of text: "<eos>" in a prompt is five characters.
    """

    def __init__(self):
        special = dict(zip(("pad_token", "eos_token", "bos_token"), BUILTIN_SPECIAL_TOKENS, strict=True))
        super().__init__(chat_template=None, special_tokens=special, origin="builtin_tokenizer()")
        offset = len(BUILTIN_SPECIAL_TOKENS)
        encode_table = bytearray(b"\xff" * 256)  # 0xff: unsupported character
        decode_table = bytearray(256)
        for index, character in enumerate(BUILTIN_CHARACTERS):
            encode_table[ord(character)] = index + offset
            decode_table[index + offset] = ord(character)
        self._encode_table = bytes(encode_table)
        self._decode_table = bytes(decode_table)
        self._size = offset + len(BUILTIN_CHARACTERS)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        try:
            raw = text.encode("ascii")
        except UnicodeEncodeError as error:
            raise TokenizerError(
                f"builtin tokenizer: unsupported character {text[error.start]!r} at index {error.start} of {text[:60]!r}"
            ) from None
        except AttributeError:
            raise TokenizerError(f"encode: text must be a str, got {type(text).__name__}") from None
        ids = raw.translate(self._encode_table)
        bad = ids.find(b"\xff")
        if bad >= 0:
            raise TokenizerError(f"builtin tokenizer: unsupported character {text[bad]!r} at index {bad} of {text[:60]!r}")
        return [self.bos_id, *ids] if add_special_tokens else list(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        try:
            raw = bytes(ids)
        except (ValueError, TypeError):
            raw = b""
        if len(raw) != len(ids) or (raw and max(raw) >= self._size):
            position = next(i for i, index in enumerate(ids) if not _is_id_below(index, self._size))
            raise TokenizerError(
                f"builtin tokenizer: id {ids[position]!r} at position {position} is outside the vocabulary [0, {self._size})")
        if skip_special_tokens:
            return raw.translate(self._decode_table, bytes(range(len(BUILTIN_SPECIAL_TOKENS)))).decode("ascii")
        pieces, start = [], 0
        for position, index in enumerate(raw):
            if index < len(BUILTIN_SPECIAL_TOKENS):
                pieces.append(raw[start:position].translate(self._decode_table).decode("ascii"))
                pieces.append(BUILTIN_SPECIAL_TOKENS[index])
                start = position + 1
        pieces.append(raw[start:].translate(self._decode_table).decode("ascii"))
        return "".join(pieces)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eos_id(self) -> int:
        return 1

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 2

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (1,)


def _is_id_below(index: Any, size: int) -> bool:
    try:
        return 0 <= operator.index(index) < size
    except TypeError:
        return False


def builtin_tokenizer() -> CharTokenizer:
    """The character-level tokenizer used by tiny test models and the built-in tasks (no files needed)."""
    return CharTokenizer()
