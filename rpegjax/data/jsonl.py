"""JSONL files: one JSON object per non-blank line, each a row (`rpegjax.data.rows`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from rpegjax.data.example import DatasetError, Example
from rpegjax.data.rows import DatasetFormat, RowSchema, examples_from_rows


def read_jsonl_rows(path: str | os.PathLike) -> Iterator[tuple[str, str, object]]:
    """`(path:line, <file name>:<line>, row)` for each non-blank line; invalid JSON raises naming the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read the dataset ({error})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
        yield where, f"{path.name}:{number}", row


def load_jsonl(
    path: str | os.PathLike,
    *,
    dataset_format: DatasetFormat | str | None = None,
    task: str = "math",
    check_answer: Callable[[Example], None] | None = None,
    schema: RowSchema | None = None,
) -> list[Example]:
    """The checked examples of a JSONL file (see `rpegjax.data.rows.examples_from_rows`): any bad row raises
    `DatasetError` starting with `path:line`; rows without an `id` get `<file name>:<line>`. `schema` maps
    fields (its format wins over `dataset_format`)."""
    if schema is None:
        try:
            schema = RowSchema(dataset_format=dataset_format)
        except DatasetError as error:
            raise DatasetError(f"{path}: {error}") from None
    return examples_from_rows(read_jsonl_rows(path), str(path), schema=schema, task=task, check_answer=check_answer)
