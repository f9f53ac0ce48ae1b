"""Load GSM8K-, MATH- and plain-style JSONL files into `Example`s, rejecting malformed rows by file:line."""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from pathlib import Path

from rpegjax.data.answers import extract_boxed, extract_gsm8k_answer
from rpegjax.data.example import SOLUTION_KEY, DatasetError, Example


class DatasetFormat(enum.StrEnum):
    GSM8K = "gsm8k"  # {"question": ..., "answer": "...reasoning... #### 72"}
    MATH = "math"  # {"problem": ..., "solution": "...\\boxed{\\frac{1}{2}}..."}
    PLAIN = "plain"  # {"prompt": ..., "answer": "1/2"}


FIELDS: dict[DatasetFormat, tuple[str, str]] = {
    DatasetFormat.GSM8K: ("question", "answer"),
    DatasetFormat.MATH: ("problem", "solution"),
    DatasetFormat.PLAIN: ("prompt", "answer"),
}


def detect_format(row: dict, where: str) -> DatasetFormat:
    """The first format (GSM8K, MATH, plain) whose two fields the row has; error naming `where` if none."""
    for dataset_format, fields in FIELDS.items():
        if all(field in row for field in fields):
            return dataset_format
    expected = " or ".join(f"({a!r}, {b!r})" for a, b in FIELDS.values())
    raise DatasetError(f"{where}: cannot tell the dataset format: the row has keys {sorted(row)}, expected {expected}")


def _gold_answer(dataset_format: DatasetFormat, solution: str) -> str:
    if dataset_format is DatasetFormat.GSM8K:
        return extract_gsm8k_answer(solution)
    if dataset_format is DatasetFormat.MATH:
        return extract_boxed(solution)
    return solution.strip()


def _example(row: object, dataset_format: DatasetFormat, where: str, default_id: str, task: str) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt_field, answer_field = FIELDS[dataset_format]
    for field in (prompt_field, answer_field):
        if field not in row:
            raise DatasetError(
                f"{where}: missing field {field!r} of a {dataset_format.value} row (the row has keys {sorted(row)})"
            )
    prompt, solution = row[prompt_field], row[answer_field]
    if dataset_format is DatasetFormat.PLAIN and isinstance(solution, (int, float)) and not isinstance(solution, bool):
        solution = str(solution)
    for field, value in ((prompt_field, prompt), (answer_field, solution)):
        if not isinstance(value, str):
            raise DatasetError(f"{where}: field {field!r} must be a string, got {type(value).__name__} {value!r}")
    if not prompt.strip():
        raise DatasetError(f"{where}: empty prompt (field {prompt_field!r})")
    try:
        answer = _gold_answer(dataset_format, solution)
    except ValueError as error:
        raise DatasetError(f"{where}: field {answer_field!r}: {error}") from None
    if not answer:
        raise DatasetError(f"{where}: empty gold answer (field {answer_field!r})")
    row_id = row.get("id", default_id)
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise DatasetError(f"{where}: field 'id' must be a string or integer, got {row_id!r}")
    meta = {} if dataset_format is DatasetFormat.PLAIN else {SOLUTION_KEY: solution}
    return Example(id=str(row_id), prompt=prompt, answer=answer, task=task, meta=meta, source=where)


def load_jsonl(
    path: str | os.PathLike,
    *,
    dataset_format: DatasetFormat | str | None = None,
    task: str = "math",
    check_answer: Callable[[Example], None] | None = None,
) -> list[Example]:
    """Read one example per non-blank line of `path`.

    `dataset_format` None detects it from the first row (`detect_format`); every row must then have that
    format's fields. Gold answers: GSM8K, the text after `####`; MATH, the last `\\boxed{}`; plain, the
    `answer` field. `check_answer` (e.g. `rpegjax.rewards.math.check_gold_answer`) is called on each row, so
    an answer the verifier cannot read is reported by file:line at load. Any bad row — invalid JSON, not an
    object, a missing or non-string field, an empty prompt, no gold answer, one `check_answer` refuses, a repeated
    `id` — raises `DatasetError` starting with `path:line`. Rows without an `id` get `<file name>:<line>`.
    """
    path = Path(path)
    if dataset_format is not None:
        try:
            dataset_format = DatasetFormat(dataset_format)
        except ValueError:
            known = [f.value for f in DatasetFormat]
            raise DatasetError(f"{path}: unknown dataset format {dataset_format!r}; known: {known}") from None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read the dataset ({error})") from None
    examples: list[Example] = []
    first_line_of_id: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
        if dataset_format is None:
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            dataset_format = detect_format(row, where)
        example = _example(row, dataset_format, where, f"{path.name}:{number}", task)
        if check_answer is not None:
            check_answer(example)
        if example.id in first_line_of_id:
            raise DatasetError(f"{where}: id {example.id!r} already used on line {first_line_of_id[example.id]}")
        first_line_of_id[example.id] = number
        examples.append(example)
    if not examples:
        raise DatasetError(f"{path}: the dataset has no rows")
    return examples
