"""`--section.field=value` command-line overrides onto nested frozen dataclasses, and JSON round trip."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any


def _parse_value(text: str, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if text.lower() in ("none", "null") and len(options) < len(typing.get_args(annotation)):
            return None
        errors = []
        for option in options:
            try:
                return _parse_value(text, option, where)
            except ValueError as error:
                errors.append(str(error))
        if len(errors) == 1:  # `X | None`: X's own message says what is accepted
            raise ValueError(errors[0])
        raise ValueError(f"{where}: cannot read {text!r} as {annotation}")
    if origin is tuple:
        args = typing.get_args(annotation)
        items = [item for item in text.split(",") if item.strip()] if text else []
        element = args[0] if args else str
        return tuple(_parse_value(item.strip(), element, where) for item in items)
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: expected a boolean (true/false), got {text!r}")
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        try:
            return annotation(text)
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not one of {[m.value for m in annotation]}") from None
    if annotation in (int, float, str):
        try:
            return annotation(text)
        except ValueError:
            raise ValueError(f"{where}: expected {annotation.__name__}, got {text!r}") from None
    raise ValueError(f"{where}: fields of type {annotation} cannot be set from the command line")


def apply_overrides(config: Any, overrides: Mapping[str, str]) -> Any:
    """Returns `config` with `{"rollout.group_size": "8", ...}` applied; unknown names are errors."""
    for dotted, text in overrides.items():
        config = _apply_one(config, dotted.split("."), text, dotted)
    return config


def _apply_one(node: Any, path: list[str], text: str, dotted: str) -> Any:
    if not dataclasses.is_dataclass(node):
        raise ValueError(f"--{dotted}: {type(node).__name__} has no fields")
    hints = typing.get_type_hints(type(node))
    fields = {f.name for f in dataclasses.fields(node)}
    head = path[0]
    if head not in fields:
        raise ValueError(f"--{dotted}: unknown field {head!r} of {type(node).__name__}; known: {sorted(fields)}")
    if len(path) == 1:
        value = _parse_value(text, hints[head], f"--{dotted}")
    else:
        value = _apply_one(getattr(node, head), path[1:], text, dotted)
    return dataclasses.replace(node, **{head: value})


def to_jsonable(config: Any) -> Any:
    """Nested dataclasses, enums and tuples as plain JSON values."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, enum.Enum):
        return config.value
    if isinstance(config, tuple | list):
        return [to_jsonable(item) for item in config]
    if isinstance(config, dict):
        return {str(key): to_jsonable(value) for key, value in config.items()}
    return config


def from_jsonable(cls: type, data: Mapping[str, Any]) -> Any:
    """Inverse of `to_jsonable` for a dataclass type `cls`."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        values[field.name] = _from_json_value(data[field.name], hints[field.name])
    return cls(**values)


def _from_json_value(value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if option is type(None):
                continue
            try:
                return _from_json_value(value, option)
            except (TypeError, ValueError):
                continue
        return value
    if dataclasses.is_dataclass(annotation) and isinstance(value, Mapping):
        return from_jsonable(annotation, value)
    if origin is tuple:
        args = typing.get_args(annotation)
        return tuple(_from_json_value(item, args[0]) if args else item for item in value)
    if origin in (dict, Mapping) or annotation is dict:
        return dict(value)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation(value)
    return value
