"""Reading the small JSON files that checkpoints and tokenizers ship (config.json, tokenizer_config.json, ...)."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object in `path`; a missing file, invalid JSON or a non-object raises `error` naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exception:
        raise error(f"{path}: not valid JSON ({exception})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
