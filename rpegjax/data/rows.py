"""Dataset rows (JSON objects, Parquet or Arrow records) into checked `Example`s: the row formats (GSM8K,
MATH, plain, verl), field mapping (nested fields by dotted names: `reward_model.ground_truth`), conversational
prompts (TRL's and verl's list of `{role, content}` messages), and the checks every row passes whatever file it
came from."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Collection, Iterable

from rpegjax.data.answers import extract_boxed, extract_gsm8k_answer
from rpegjax.data.example import SOLUTION_KEY, DatasetError, Example

ID_FIELD = "id"


class DatasetFormat(enum.StrEnum):
    GSM8K = "gsm8k"  # {"question": ..., "answer": "...reasoning... #### 72"}
    MATH = "math"  # {"problem": ..., "solution": "...\\boxed{\\frac{1}{2}}..."}
    PLAIN = "plain"  # {"prompt": ..., "answer": "1/2"}; TRL's conversational rows have a list of messages as prompt
    # verl's GSM8K/MATH Parquet: {"data_source": ..., "prompt": [{"role": "user", "content": ...}], "ability": ...,
    # "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {...}}
    VERL = "verl"


FIELDS: dict[DatasetFormat, tuple[str, str]] = {
    DatasetFormat.GSM8K: ("question", "answer"),
    DatasetFormat.MATH: ("problem", "solution"),
    DatasetFormat.PLAIN: ("prompt", "answer"),
    DatasetFormat.VERL: ("prompt", "reward_model.ground_truth"),
}
ROLES = ("system", "user", "assistant")


def has_field(row: dict, field: str) -> bool:
    """Whether `row` has `field`: a key of that name, else a path of nested keys (`reward_model.ground_truth`)."""
    try:
        field_value(row, field)
    except KeyError:
        return False
    return True


def field_value(row: dict, field: str) -> object:
    """`row[field]`, or for a dotted name without such a key the nested value; KeyError when absent."""
    if field in row:
        return row[field]
    value: object = row
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(field)
        value = value[part]
    return value


def column_of(field: str, columns: Collection[str]) -> str:
    """The top-level column that holds `field` (itself, or the first part of a dotted name)."""
    return field if field in columns else field.split(".")[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSchema:
    """How to read a row: its `dataset_format` (None: detected from the first row) and the names of its
    prompt and answer fields (None: the format's own, `FIELDS`). The format says how the gold answer is
    written: GSM8K after `####`, MATH in the last `\\boxed{}`, plain as it is."""

    dataset_format: DatasetFormat | None = None
    prompt_field: str | None = None
    answer_field: str | None = None

    def __post_init__(self) -> None:
        if self.dataset_format is not None:
            try:
                object.__setattr__(self, "dataset_format", DatasetFormat(self.dataset_format))
            except ValueError:
                known = [f.value for f in DatasetFormat]
                raise DatasetError(f"unknown dataset format {self.dataset_format!r}; known: {known}") from None
        for name in ("prompt_field", "answer_field"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise DatasetError(f"RowSchema.{name} must be a non-empty string or None, got {value!r}")
        if self.prompt_field is not None and self.prompt_field == self.answer_field:
            raise DatasetError(f"the prompt and answer fields are both {self.prompt_field!r}")

    def fields(self, dataset_format: DatasetFormat) -> tuple[str, str]:
        """(prompt field, answer field) of a row of `dataset_format` under this mapping."""
        prompt, answer = FIELDS[dataset_format]
        return self.prompt_field or prompt, self.answer_field or answer

    def resolve(self, row: dict, where: str) -> DatasetFormat:
        """The format of `row`: the given one, else the first whose (mapped) fields the row has; when the
        field mapping makes several formats match, the first whose gold answer the row's answer field holds
        (`####` for GSM8K, `\\boxed{}` for MATH), else plain."""
        if self.dataset_format is not None:
            return self.dataset_format
        matching = [f for f in DatasetFormat if all(has_field(row, field) for field in self.fields(f))]
        if not matching:
            expected = " or ".join(f"({a!r}, {b!r})" for a, b in dict.fromkeys(map(self.fields, DatasetFormat)))
            raise DatasetError(f"{where}: cannot tell the dataset format: the row has fields {sorted(row)}, "
                               f"expected {expected} (map yours with --prompt-field / --answer-field)")
        if len(matching) == 1:
            return matching[0]
        for dataset_format in matching:
            try:
                _gold_answer(dataset_format, field_value(row, self.fields(dataset_format)[1]))
                return dataset_format
            except (ValueError, TypeError):
                continue
        return matching[-1]


def _gold_answer(dataset_format: DatasetFormat, solution: str) -> str:
    if not isinstance(solution, str):
        raise TypeError(f"not a string: {solution!r}")
    if dataset_format is DatasetFormat.GSM8K:
        return extract_gsm8k_answer(solution)
    if dataset_format is DatasetFormat.MATH:
        return extract_boxed(solution)
    return solution.strip()


def _field_text(value: object, where: str, column: str) -> str:
    """A further field of the row as text for `Example.meta`: strings as they are, other JSON values encoded."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: field {column!r} holds {type(value).__name__} {value!r:.80}, which is not a "
                           "JSON value (rewards receive the row's fields as text or JSON)") from None


def prompt_messages(value: object, where: str, field: str) -> tuple[tuple[str, str], ...]:
    """A conversational prompt (a list of `{role, content}` messages) as `(role, content)` pairs; it must hold
    a user message. Anything else raises `DatasetError` naming the field."""
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: field {field!r} must be a string or a non-empty list of messages, got "
                           f"{type(value).__name__} {value!r:.80}")
    turns = []
    for number, message in enumerate(value):
        ok = isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
        if not ok or message["role"] not in ROLES:
            raise DatasetError(f"{where}: field {field!r}[{number}] must be a message {{'role': one of {list(ROLES)}, "
                               f"'content': text}}, got {message!r:.80}")
        turns.append((message["role"], message["content"]))
    if not any(role == "user" for role, _ in turns):
        raise DatasetError(f"{where}: field {field!r} holds no user message (roles {[role for role, _ in turns]})")
    return tuple(turns)


def _answer_text(dataset_format: DatasetFormat, solution: object, where: str, answer_field: str) -> tuple[str, str]:
    """(solution text as the row has it, gold answer) of the row's answer field."""
    if dataset_format in (DatasetFormat.PLAIN, DatasetFormat.VERL) and isinstance(solution, (int, float)) \
            and not isinstance(solution, bool):
        solution = str(solution)
    if not isinstance(solution, str):
        raise DatasetError(f"{where}: field {answer_field!r} must be a string, got {type(solution).__name__} {solution!r}")
    try:
        answer = _gold_answer(dataset_format, solution)
    except ValueError as error:
        raise DatasetError(f"{where}: field {answer_field!r}: {error}") from None
    if not answer:
        raise DatasetError(f"{where}: empty gold answer (field {answer_field!r})")
    return solution, answer


def row_to_example(row: object, schema: RowSchema, dataset_format: DatasetFormat, where: str, default_id: str,
                   task: str) -> Example:
    """The `Example` of one row; a malformed row raises `DatasetError` starting with `where`.

    A prompt field that holds a list of messages is a conversation (`Example.messages`; its last user message
    is the prompt text). The row's further fields (not prompt, answer or `id`) go to `Example.meta` (strings as
    they are, other values as JSON), so that a reward function sees them; GSM8K and MATH rows also keep their
    worked solution there (`SOLUTION_KEY`)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt_field, answer_field = schema.fields(dataset_format)
    values = {}
    for field in (prompt_field, answer_field):
        try:
            values[field] = field_value(row, field)
        except KeyError:
            raise DatasetError(
                f"{where}: missing field {field!r} of a {dataset_format.value} row (the row has fields {sorted(row)})"
            ) from None
    prompt, messages = values[prompt_field], ()
    if not isinstance(prompt, str):
        messages = prompt_messages(prompt, where, prompt_field)
        prompt = next(content for role, content in reversed(messages) if role == "user")
    if not prompt.strip():
        raise DatasetError(f"{where}: empty prompt (field {prompt_field!r})")
    solution, answer = _answer_text(dataset_format, values[answer_field], where, answer_field)
    row_id = row.get(ID_FIELD, default_id)
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise DatasetError(f"{where}: field 'id' must be a string or integer, got {row_id!r}")
    keep_solution = dataset_format in (DatasetFormat.GSM8K, DatasetFormat.MATH)
    meta = {SOLUTION_KEY: solution} if keep_solution else {}
    json_fields = []
    for column, value in row.items():
        if column in (prompt_field, answer_field, ID_FIELD):
            continue
        if column in meta:
            raise DatasetError(f"{where}: field {column!r} clashes with the worked solution that a "
                               f"{dataset_format.value} row keeps under that name; rename the field")
        meta[column] = _field_text(value, where, column)
        if not isinstance(value, str):
            json_fields.append(column)
    return Example(id=str(row_id), prompt=prompt, answer=answer, task=task, meta=meta, source=where,
                   messages=messages, json_fields=json_fields)


def examples_from_rows(
    rows: Iterable[tuple[str, str, object]],
    source: str,
    *,
    schema: RowSchema = RowSchema(),
    task: str = "math",
    check_answer: Callable[[Example], None] | None = None,
) -> list[Example]:
    """Checked examples of `rows`, `(where, default id, row)` triples (`where` is `file:line` or `file:row n`).

    The format is `schema`'s or detected from the first row, and every row must then have that format's
    fields. `check_answer` (e.g. `rpegjax.rewards.math.check_gold_answer`) is called on each row, so an
    answer the verifier cannot read is reported by its row at load. A repeated `id` and a source without
    rows (`source` names it) are errors too."""
    dataset_format = schema.dataset_format
    examples: list[Example] = []
    first_use: dict[str, str] = {}
    for where, default_id, row in rows:
        if dataset_format is None:
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            dataset_format = schema.resolve(row, where)
        example = row_to_example(row, schema, dataset_format, where, default_id, task)
        if check_answer is not None:
            check_answer(example)
        if example.id in first_use:
            raise DatasetError(f"{where}: id {example.id!r} already used at {first_use[example.id]}")
        first_use[example.id] = where
        examples.append(example)
    if not examples:
        raise DatasetError(f"{source}: the dataset has no rows")
    return examples


def check_columns(columns: Collection[str], schema: RowSchema, source: str) -> None:
    """For files with a schema (Parquet, Arrow): the columns must hold some format's (mapped) fields (a dotted
    field's first part, the rest is checked row by row)."""
    formats = [schema.dataset_format] if schema.dataset_format is not None else list(DatasetFormat)
    if not any(all(column_of(field, columns) in columns for field in schema.fields(f)) for f in formats):
        expected = " or ".join(f"({a!r}, {b!r})" for a, b in dict.fromkeys(map(schema.fields, formats)))
        raise DatasetError(f"{source}: the columns {sorted(columns)} do not hold the prompt and answer fields "
                           f"{expected} (map yours with --prompt-field / --answer-field)")
