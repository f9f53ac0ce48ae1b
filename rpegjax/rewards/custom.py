"""Bring your own reward: functions `function(completion: str, example) -> float` named by specs
`package.module:function[=weight]`, their weighted sum as one reward function, and a task trained on it.

`example` is a plain dict of the example being answered (a fresh copy for each function, so one term cannot
change what the next sees): `example["answer"]`, `example["prompt"]`, `example["id"]`, `example["task"]` and a
dataset row's further fields such as `example.get("difficulty")`. The sum runs in
the `RewardRunner`'s worker processes (timeouts, memory and CPU limits), so each function must be
importable in a fresh interpreter: defined with `def` (or a picklable object) at module level, in a module
on `PYTHONPATH` or in the current directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import os
import pickle
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rpegjax.data.example import Example
from rpegjax.rewards.runner import Isolation, checked_reward

UserRewardFn = Callable[[str, Example], float]
_SPEC = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
                   r"(?:=(?P<weight>.+))?$")
SPEC_FORMAT = "package.module:function or package.module:function=weight"


class RewardSpecError(ValueError):
    """A reward spec that does not parse, or names something that is not a usable reward function."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """`module:function=weight` as parsed; `str(spec)` is the text it came from (without `=1.0`)."""

    module: str
    function: str
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str) -> RewardSpec:
        match = _SPEC.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise RewardSpecError(f"reward {text!r}: expected {SPEC_FORMAT} (e.g. mymodule:correct=0.5)")
        weight = 1.0
        if match["weight"] is not None:
            try:
                weight = float(match["weight"])
            except ValueError:
                raise RewardSpecError(f"reward {text!r}: the weight {match['weight']!r} is not a number") from None
            if not math.isfinite(weight):
                raise RewardSpecError(f"reward {text!r}: the weight must be finite, got {weight}")
        return cls(module=match["module"], function=match["function"], weight=weight)

    @property
    def name(self) -> str:
        return f"{self.module}:{self.function}"

    def __str__(self) -> str:
        return self.name if self.weight == 1.0 else f"{self.name}={self.weight:g}"


def _import_module(spec: RewardSpec, search_path: Sequence[str]) -> Any:
    for directory in search_path:
        # appended, not prepended: installed packages keep their names; kept, because the reward worker
        # processes receive this process's sys.path and must find the module too
        if directory not in sys.path:
            sys.path.append(directory)
    try:
        return importlib.import_module(spec.module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if spec.module == missing or spec.module.startswith(missing + "."):
            places = ", ".join(search_path) or "no extra directory"
            raise RewardSpecError(f"reward {spec}: no module named {missing!r} (looked on PYTHONPATH and in "
                                  f"{places})") from None
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} failed: {error}") from None
    except Exception as error:  # the user's module raised while being imported
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} failed: "
                              f"{type(error).__name__}: {error}") from None


def check_reward_function(fn: object, name: str) -> UserRewardFn:
    """`fn` if it can be called as `fn(completion, example)` and sent to a worker process; else
    `RewardSpecError` naming `name` and what is wrong."""
    if inspect.isclass(fn):
        raise RewardSpecError(f"reward {name}: is a class; give a function (or an instance with __call__)")
    if not callable(fn):
        raise RewardSpecError(f"reward {name}: is {type(fn).__name__} {fn!r:.60}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check here
        signature = None
    if signature is not None:
        try:
            signature.bind("completion", {})
        except TypeError:
            raise RewardSpecError(f"reward {name}: cannot be called as function(completion: str, example: dict); "
                                  f"its signature is {signature}") from None
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise RewardSpecError(f"reward {name}: cannot be sent to the reward worker processes ({error}); define it "
                              "with def at module level of an importable module") from None
    return fn


def load_reward_function(spec: RewardSpec, search_path: Sequence[str] | None = None) -> UserRewardFn:
    """The function `spec` names, imported from `search_path` (default: the current directory) or
    `PYTHONPATH`; a missing module or attribute, a non-callable or a wrong signature raises `RewardSpecError`."""
    search_path = [os.getcwd()] if search_path is None else [str(path) for path in search_path]
    target: Any = _import_module(spec, search_path)
    for part in spec.function.split("."):
        if not hasattr(target, part):
            where = getattr(target, "__file__", None) or getattr(target, "__name__", repr(target))
            public = [name for name in dir(target) if not name.startswith("_") and callable(getattr(target, name))]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RewardSpecError(f"reward {spec}: {where} has no attribute {part!r}; {hint}"
                                  f"its functions: {public[:20]}")
        target = getattr(target, part)
    return check_reward_function(target, spec.name)


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    fn: UserRewardFn
    weight: float = 1.0
    name: str = ""


@dataclasses.dataclass(frozen=True)
class WeightedReward:
    """sum_i weight_i * fn_i(completion, example): a reward function (`rpegjax.rewards.runner.RewardFn`).

    A term that raises, or returns something other than a finite number, fails the whole reward with an
    error naming that term (the runner scores the completion 0 and counts the error)."""

    terms: tuple[RewardTerm, ...]

    def __post_init__(self) -> None:
        if not self.terms:
            raise RewardSpecError("WeightedReward needs at least one term")
        for term in self.terms:
            if not isinstance(term.weight, (int, float)) or isinstance(term.weight, bool) \
                    or not math.isfinite(term.weight):
                raise RewardSpecError(f"reward {term.name or term.fn!r}: the weight must be a finite number, "
                                      f"got {term.weight!r}")

    @classmethod
    def of(cls, *functions: UserRewardFn | tuple[UserRewardFn, float]) -> WeightedReward:
        """From functions, or `(function, weight)` pairs: `WeightedReward.of(correct, (concise, 0.2))`."""
        terms = []
        for item in functions:
            fn, weight = item if isinstance(item, tuple) else (item, 1.0)
            name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
            terms.append(RewardTerm(check_reward_function(fn, name), float(weight), name))
        return cls(tuple(terms))

    def __call__(self, completion: str, example: Example) -> float:
        total = 0.0
        for term in self.terms:
            try:
                value = term.fn(completion, dict(example))
            except Exception as error:
                raise RuntimeError(f"reward {term.name}: {type(error).__name__}: {error}") from error
            total += term.weight * checked_reward(value, f"reward {term.name}")
        return total


def load_rewards(specs: Sequence[str], search_path: Sequence[str] | None = None) -> WeightedReward:
    """The weighted sum of the functions `specs` name (`RewardSpec.parse`, `load_reward_function`)."""
    if isinstance(specs, str):
        raise RewardSpecError(f"load_rewards takes a list of specs, got the string {specs!r}")
    parsed = [RewardSpec.parse(text) for text in specs]
    names = [spec.name for spec in parsed]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise RewardSpecError(f"reward {repeated[0]} is given more than once; give it once with its weight")
    return WeightedReward(tuple(RewardTerm(load_reward_function(spec, search_path), spec.weight, str(spec))
                                for spec in parsed))


@dataclasses.dataclass(frozen=True)
class RewardedTask:
    """`task` trained on `reward` instead of its own: examples, held-out split, verifier (`is_correct`, what
    held-out accuracy measures) and reference solutions stay the task's. The reward runs in worker processes."""

    task: Any
    reward: UserRewardFn

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def isolation(self) -> Isolation:
        return Isolation.PROCESS

    def train_examples(self, n: int, seed: int) -> list[Example]:
        return self.task.train_examples(n, seed)

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        return self.task.eval_examples(n, seed)

    def is_correct(self, text: str, example: Example) -> bool:
        return self.task.is_correct(text, example)

    def reference_solution(self, example: Example) -> str:
        return self.task.reference_solution(example)
