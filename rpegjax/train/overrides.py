"""`--section.field=value` command-line overrides onto nested frozen dataclasses, config files (JSON or YAML)
and the JSON round trip."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import pathlib
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
    """Returns `config` with `{"rollout.group_size": "8", ...}` applied; unknown names are errors. The fields of one
    section are replaced together, so its checks see the final combination whatever the flags' order (a check that
    ties two fields never rejects a half-applied pair)."""
    return _apply(config, [(dotted.split("."), text, dotted) for dotted, text in overrides.items()])


def _apply(node: Any, overrides: list[tuple[list[str], str, str]]) -> Any:
    if not overrides:
        return node
    dotted = overrides[0][2]
    if not dataclasses.is_dataclass(node):
        raise ValueError(f"--{dotted}: {type(node).__name__} has no fields")
    hints = typing.get_type_hints(type(node))
    fields = {f.name for f in dataclasses.fields(node)}
    values, nested = {}, {}
    for path, text, dotted in overrides:
        head = path[0]
        if head not in fields:
            close = difflib.get_close_matches(head, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"--{dotted}: unknown field {head!r} of {type(node).__name__}; {hint}"
                             f"known: {sorted(fields)}")
        if len(path) == 1:
            values[head] = _parse_value(text, hints[head], f"--{dotted}")
        else:
            nested.setdefault(head, []).append((path[1:], text, dotted))
    for head, inner in nested.items():
        values[head] = _apply(getattr(node, head), inner)
    return dataclasses.replace(node, **values)


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


class ConfigFileError(ValueError):
    """A config file's value has the wrong type or names no field; the message gives the dotted field."""


def from_jsonable(cls: type, data: Any, where: str = "", *, base: Any = None) -> Any:
    """Inverse of `to_jsonable` for a dataclass type `cls`, strict about what a JSON file holds: an unknown
    key, or a value of the wrong JSON type (a string "no" for a bool, a string for a number), raises
    `ConfigFileError` naming the dotted field (`where` is the prefix of the fields of `cls`).

    With `base` (an instance of `cls`), fields that `data` leaves out keep `base`'s values, section by
    section: a file that sets only `train.steps` changes nothing else."""
    if not isinstance(data, Mapping):
        raise ConfigFileError(f"{where or 'the config'} must be a JSON object, got {type(data).__name__} {_short(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        prefix = f"{where}." if where else ""
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else ""
        raise ConfigFileError(f"unknown field {prefix}{unknown[0]}{hint} ({cls.__name__} has {names})")
    values = {}
    for name in names:
        if name in data:
            inner = getattr(base, name) if base is not None else None
            values[name] = _from_json_value(data[name], hints[name], f"{where}.{name}" if where else name, base=inner)
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except (TypeError, ValueError) as error:
        if isinstance(error, ConfigFileError):
            raise
        raise ConfigFileError(f"{where or cls.__name__}: {error}") from None


YAML_SUFFIXES = (".yaml", ".yml")


def _yaml_loader():
    """PyYAML's safe loader, reading numbers as YAML 1.2 does: `1e-4` is a float (YAML 1.1 wants `1.0e-4`
    and would hand the learning rate over as a string)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
                   r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|[-+]\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))
    return Loader


def read_config_file(path: pathlib.Path) -> Any:
    """The plain data of a config file: YAML when its name ends in .yaml/.yml, JSON otherwise. A file that
    cannot be read or parsed raises `ConfigFileError` naming the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigFileError(f"{path}: cannot read it ({error})") from None
    if path.suffix.lower() in YAML_SUFFIXES:
        import yaml

        try:
            return yaml.load(text, Loader=_yaml_loader())
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error)
            raise ConfigFileError(f"{path}: not valid YAML ({problem}{where})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigFileError(f"{path}: not valid JSON ({error.msg} at line {error.lineno} column "
                              f"{error.colno}; truncated?)") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _from_json_value(value: Any, annotation: Any, where: str, *, base: Any = None) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                kind = typing.get_origin(option) or option  # isinstance takes tuple, not tuple[int, ...]
                return _from_json_value(value, option, where,
                                        base=base if isinstance(kind, type) and isinstance(base, kind) else None)
            except ConfigFileError as error:
                errors.append(str(error))
        if len(errors) == 1:
            raise ConfigFileError(errors[0])
        raise ConfigFileError(f"{where}: {_short(value)} is not a {annotation}")
    if dataclasses.is_dataclass(annotation):
        return from_jsonable(annotation, value, where, base=base if isinstance(base, annotation) else None)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigFileError(f"{where}: expected a JSON list, got {type(value).__name__} {_short(value)}")
        args = typing.get_args(annotation)
        element = args[0] if args else Any
        return tuple(_from_json_value(item, element, f"{where}[{i}]") for i, item in enumerate(value))
    if origin in (dict, Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigFileError(f"{where}: expected a JSON object, got {type(value).__name__} {_short(value)}")
        return dict(value)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        try:
            return annotation(value)
        except ValueError:
            raise ConfigFileError(f"{where}: {_short(value)} is not one of {[m.value for m in annotation]}") from None
    # JSON has no tuples or enums, but it does have exact types: "no" is not a bool, "3" not an int
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {type(value).__name__} {_short(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigFileError(f"{where}: expected an integer, got {type(value).__name__} {_short(value)}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigFileError(f"{where}: expected a number, got {type(value).__name__} {_short(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigFileError(f"{where}: expected a string, got {type(value).__name__} {_short(value)}")
        return value
    if value is None:
        raise ConfigFileError(f"{where}: null is not a {annotation}")
    return value
