"""A dataset path as people have it — a JSONL file, a Parquet file (or a directory of them), a Hugging Face
`datasets` directory from `save_to_disk` — into checked `Example`s. Local files only: nothing downloads."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from rpegjax.data.arrow import is_saved_dataset, read_parquet_rows, read_saved_dataset_rows
from rpegjax.data.example import DatasetError, Example
from rpegjax.data.jsonl import read_jsonl_rows
from rpegjax.data.rows import RowSchema, examples_from_rows

PARQUET_SUFFIX = ".parquet"


def dataset_rows(path: str | os.PathLike, schema: RowSchema = RowSchema()) -> Iterator[tuple[str, str, object]]:
    """`(where, default id, row)` of every row of `path`, whatever kind of dataset it is: a directory written
    by `datasets`' `save_to_disk` (one split: `DIR/train` of a `DatasetDict`), a directory of `*.parquet` files
    (read in name order), a `*.parquet` file, or else a JSONL file."""
    path = Path(path)
    if path.is_dir():
        if is_saved_dataset(path):
            yield from read_saved_dataset_rows(path, schema)
            return
        parquet = sorted(path.glob(f"*{PARQUET_SUFFIX}"))
        if not parquet:
            raise DatasetError(f"{path}: a directory that is neither a Hugging Face dataset saved with save_to_disk "
                               f"(state.json or dataset_dict.json) nor holds *{PARQUET_SUFFIX} files")
        for file in parquet:
            yield from read_parquet_rows(file, schema)
    elif not path.exists():
        raise DatasetError(f"{path}: no such dataset file or directory")
    elif path.suffix == PARQUET_SUFFIX:
        yield from read_parquet_rows(path, schema)
    else:
        yield from read_jsonl_rows(path)


def load_examples(
    path: str | os.PathLike,
    *,
    schema: RowSchema = RowSchema(),
    task: str = "math",
    check_answer: Callable[[Example], None] | None = None,
) -> list[Example]:
    """The checked examples of the dataset at `path` (`dataset_rows`; rows checked by
    `rpegjax.data.rows.examples_from_rows`): any bad row raises `DatasetError` naming its file and line or row."""
    return examples_from_rows(dataset_rows(path, schema), str(path), schema=schema, task=task, check_answer=check_answer)
