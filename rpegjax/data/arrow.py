"""Columnar datasets through pyarrow: Parquet files, and Hugging Face `datasets` directories written by
`Dataset.save_to_disk` (Arrow IPC stream files listed in `state.json`, beside `dataset_info.json`), read
without the `datasets` package. Local files only.

Rows are read a record batch at a time, with all their columns (a reward function may read any field)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from rpegjax.data.example import DatasetError
from rpegjax.data.rows import RowSchema, check_columns

SAVED_STATE = "state.json"
SAVED_DICT = "dataset_dict.json"


def _pyarrow():
    import pyarrow
    import pyarrow.ipc
    import pyarrow.parquet

    return pyarrow


def read_parquet_rows(path: str | os.PathLike, schema: RowSchema = RowSchema()) -> Iterator[tuple[str, str, dict]]:
    """`(path:row n, <file name>:<n>, row)` for each row of a Parquet file (rows numbered from 0, as pandas
    and `datasets` index them)."""
    pa = _pyarrow()
    path = Path(path)
    try:
        file = pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise DatasetError(f"{path}: cannot read it as Parquet ({error})") from None
    check_columns(file.schema_arrow.names, schema, str(path))
    yield from _numbered(file.iter_batches(), path, path, 0)


def _numbered(batches, label: Path, file: Path, first: int) -> Iterator[tuple[str, str, dict]]:
    """Rows of `batches` (read from `file`) numbered from `first`, named `label:row n`."""
    pa = _pyarrow()
    number = first
    try:
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{label}:row {number}", f"{label.name}:{number}", row
                number += 1
    except (OSError, pa.ArrowException) as error:
        raise DatasetError(f"{file}: cannot read row {number} ({error})") from None


def is_saved_dataset(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    path = Path(path)
    return path.is_dir() and ((path / SAVED_STATE).is_file() or (path / SAVED_DICT).is_file())


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(f"{path}: cannot read it ({error})") from None


def saved_data_files(directory: str | os.PathLike) -> list[Path]:
    """The Arrow files of a `Dataset.save_to_disk` directory, in order. A `DatasetDict` directory is an
    error that names its splits (give one split's directory, e.g. `DIR/train`)."""
    directory = Path(directory)
    if not (directory / SAVED_STATE).is_file():
        splits = _read_json(directory / SAVED_DICT)
        names = splits.get("splits") if isinstance(splits, dict) else None
        if (directory / SAVED_DICT).is_file():
            shown = ", ".join(f"{directory / str(name)}" for name in names or [])
            raise DatasetError(f"{directory}: a DatasetDict with splits {names}; give one split's directory "
                               f"({shown})")
        raise DatasetError(f"{directory}: no {SAVED_STATE} (not a directory written by Dataset.save_to_disk)")
    state = _read_json(directory / SAVED_STATE)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) and isinstance(f.get("filename"), str)
                                                           for f in files):
        raise DatasetError(f"{directory / SAVED_STATE}: '_data_files' must be a non-empty list of "
                           f"{{'filename': ...}}, got {files!r:.200}")
    paths = [directory / f["filename"] for f in files]
    for path in paths:
        if path.parent != directory or not path.is_file():
            raise DatasetError(f"{directory / SAVED_STATE}: lists {path.name!r}, which is not a file in {directory}")
    return paths


def read_saved_dataset_rows(directory: str | os.PathLike,
                            schema: RowSchema = RowSchema()) -> Iterator[tuple[str, str, dict]]:
    """`(directory:row n, <directory name>:<n>, row)` for each row of a `Dataset.save_to_disk` directory,
    rows numbered from 0 across its files, as `load_from_disk(directory)[n]` numbers them."""
    pa = _pyarrow()
    directory = Path(directory)
    number = 0
    for path in saved_data_files(directory):
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except (OSError, pa.ArrowException) as error:
            raise DatasetError(f"{path}: cannot read it as an Arrow stream ({error})") from None
        check_columns(reader.schema.names, schema, str(path))
        for row in _numbered(reader, directory, path, number):
            yield row
            number += 1
