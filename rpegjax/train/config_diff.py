"""Which settings of two run configurations differ, by their dotted names (`lora.rank`): what a refused
`--resume` names (the checkpoint's saved config against this run's), and the check that every process of a run
was started with the same configuration."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rpegjax import distributed

def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config's JSON form as `{"section.field": value}` (nested sections joined by dots)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differences(first: Mapping[str, Any], second: Mapping[str, Any], *,
                ignore: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """`(name, first value, second value)` of each setting that differs between two configs' JSON forms (a
    setting one of them lacks is None there), in name order; names starting with a prefix in `ignore` skipped."""
    a, b = flatten(first), flatten(second)
    return [(name, a.get(name), b.get(name)) for name in sorted(a.keys() | b.keys())
            if a.get(name) != b.get(name) and not name.startswith(tuple(ignore))]


def describe(found: Sequence[tuple[str, Any, Any]], first: str, second: str) -> str:
    """`lora.rank 4 (saved) -> 8 (this run); ...`."""
    return "; ".join(f"{name} {json.dumps(a)} ({first}) -> {json.dumps(b)} ({second})" for name, a, b in found)


def check_same_across_processes(config_json: str) -> None:
    """Raises ValueError naming each setting in which a process's configuration differs from process 0's, with
    both values, the same message in every process. A collective: every process of the run calls it."""
    configs = [json.loads(text) for text in distributed.gather_text(config_json)]
    found = []
    for process, config in enumerate(configs[1:], 1):
        for name, ours, theirs in differences(configs[0], config):
            found.append(f"{name}: {json.dumps(ours)} in process 0, {json.dumps(theirs)} in process {process}")
    if found:
        raise ValueError("the run configuration differs across processes (" + "; ".join(found) + "); start every "
                         "process with the same flags and config file")
