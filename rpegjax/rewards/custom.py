"""Bring your own reward: functions named by specs `package.module:function[=weight]`, their weighted sum as
one reward, and a task trained on it.

A function is either per-completion, `function(completion: str, example: dict) -> float`, or TRL's batched
form, `function(prompts, completions, **columns) -> list[float | None]` (told apart by the signature: a
parameter named `completions`). `example` is a plain dict of the example being answered (a fresh copy for each
function, so one term cannot change what the next sees): `example["answer"]`, `example["prompt"]`,
`example["id"]`, `example["task"]` and a dataset row's further fields such as `example.get("difficulty")`
(text; other JSON values as JSON text). A batched function gets lists: `prompts` (a conversation as a list of
`{role, content}` messages, else the text), `completions`, and the same fields as columns (JSON values decoded).

The sum runs in the `RewardRunner`'s worker processes (timeouts, memory and CPU limits) term by term: one
term's failure adds 0 for that term only and is counted (`reward/<module:function>/errors`), each term's mean
is logged as `reward/<module:function>`. So each function must be importable in a fresh interpreter: defined
with `def` (or a picklable object) at module level, in a module on `PYTHONPATH` or in the current directory.
A module is first imported in a probe process under a time limit: one that blocks, exits or kills its
interpreter at import is an error naming the spec.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import inspect
import math
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rpegjax.data.example import Example
from rpegjax.rewards.runner import Isolation
from rpegjax.rewards.scoring import NonFiniteReward, TermScores, checked_reward, describe_error

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


IMPORT_TIMEOUT_S = 120.0
"""Seconds a reward module may take to import (in a probe process first: a module that blocks at import must
not hang the job)."""


_PROBE = ("import importlib, sys\n"
          "try:\n    importlib.import_module(sys.argv[1])\n"
          "except BaseException:\n    print('\\nraised')\n"  # reported by the import in the job's own process
          "else:\n    print('\\nimported')\n")


def _probe_import(spec: RewardSpec, timeout_s: float) -> None:
    """Imports `spec.module` in a fresh interpreter (this process's `sys.path`) under `timeout_s`, so that a
    module that blocks at import, or ends the interpreter (`os._exit`, a signal), is an error naming the spec
    rather than a hung or silently ended job. Exceptions and `sys.exit` are left to the import in this process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE, spec.module], env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} did not finish within {timeout_s:g} s (the "
                              "import time limit; does the module block or wait for something at import?)") from None
    if not result.stdout.rstrip().endswith(("imported", "raised")):
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        detail = f"exit code {result.returncode}" + (f": {lines[-1]}" if lines else "")
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} ended the interpreter ({detail}); a reward "
                              "module must not exit at import")


def _import_module(spec: RewardSpec, search_path: Sequence[str], timeout_s: float) -> Any:
    for directory in search_path:
        # appended, not prepended: installed packages keep their names; kept, because the reward worker
        # processes receive this process's sys.path and must find the module too
        if directory not in sys.path:
            sys.path.append(directory)
    if spec.module not in sys.modules:
        _probe_import(spec, timeout_s)
    try:
        return importlib.import_module(spec.module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if spec.module == missing or spec.module.startswith(missing + "."):
            places = ", ".join(search_path) or "no extra directory"
            raise RewardSpecError(f"reward {spec}: no module named {missing!r} (looked on PYTHONPATH and in "
                                  f"{places})") from None
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} failed: {error}") from None
    except SystemExit as error:  # sys.exit() at import would otherwise end the job with its code, silently
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} called sys.exit({error.code!r}); a reward "
                              "module must not exit at import") from None
    except Exception as error:  # the user's module raised while being imported
        raise RewardSpecError(f"reward {spec}: importing {spec.module!r} failed: "
                              f"{type(error).__name__}: {error}") from None


class TermKind(enum.StrEnum):
    PER_COMPLETION = "per_completion"  # fn(completion: str, example: dict) -> float
    BATCHED = "batched"  # TRL's fn(prompts, completions, **columns) -> list[float | None]


def reward_kind(fn: object, name: str) -> TermKind:
    """`BATCHED` when `fn` has a parameter named `completions` (TRL's reward functions), else `PER_COMPLETION`;
    a signature that fits neither raises `RewardSpecError`."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check here
        return TermKind.PER_COMPLETION
    if "completions" in signature.parameters:
        if signature.parameters["completions"].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise RewardSpecError(f"reward {name}: a batched reward function takes completions as a keyword "
                                  f"argument (TRL calls f(prompts=..., completions=..., **columns)); its signature "
                                  f"is {signature}")
        return TermKind.BATCHED
    try:
        signature.bind("completion", {})
    except TypeError:
        raise RewardSpecError(f"reward {name}: cannot be called as function(completion: str, example: dict) nor as "
                              f"TRL's function(prompts, completions, **columns); its signature is {signature}") from None
    return TermKind.PER_COMPLETION


def check_reward_function(fn: object, name: str) -> UserRewardFn:
    """`fn` if it can be called as `fn(completion, example)` or `fn(prompts=, completions=, **columns)`
    (`reward_kind`) and sent to a worker process; else `RewardSpecError` naming `name` and what is wrong."""
    if inspect.isclass(fn):
        raise RewardSpecError(f"reward {name}: is a class; give a function (or an instance with __call__)")
    if not callable(fn):
        raise RewardSpecError(f"reward {name}: is {type(fn).__name__} {fn!r:.60}, not a function")
    reward_kind(fn, name)
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise RewardSpecError(f"reward {name}: cannot be sent to the reward worker processes ({error}); define it "
                              "with def at module level of an importable module") from None
    return fn


def load_reward_function(spec: RewardSpec, search_path: Sequence[str] | None = None, *,
                         import_timeout_s: float = IMPORT_TIMEOUT_S) -> UserRewardFn:
    """The function `spec` names, imported from `search_path` (default: the current directory) or
    `PYTHONPATH`; a missing module or attribute, a module that exits or blocks past `import_timeout_s` at import,
    a non-callable or a wrong signature raises `RewardSpecError`."""
    search_path = [os.getcwd()] if search_path is None else [str(path) for path in search_path]
    target: Any = _import_module(spec, search_path, import_timeout_s)
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
    """One function of a weighted sum; `name` is its spec (`module:function=weight`), `kind` how it is called
    (detected from its signature when not given)."""

    fn: UserRewardFn
    weight: float = 1.0
    name: str = ""
    kind: TermKind | None = None

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", reward_kind(self.fn, self.name or repr(self.fn)))

    @property
    def metric_name(self) -> str:
        """The name without its weight: `reward/<metric_name>` is logged."""
        return self.name.rsplit("=", 1)[0] if self.name else repr(self.fn)


def _batched_arguments(fn: Callable, texts: Sequence[str], examples: Sequence[Example]) -> dict[str, list]:
    """TRL's keyword arguments for a batched function: `prompts` (a conversation's messages as a list of
    `{role, content}` dicts, else the prompt text), `completions`, and each further field of the examples as a
    list (`answer`, `id`, `task`, the dataset row's other columns); only those it accepts unless it takes
    `**kwargs`."""
    columns: dict[str, list] = {"prompts": [example.chat_prompt() for example in examples], "completions": list(texts)}
    rows = [example.columns() for example in examples]
    for key in dict.fromkeys(key for row in rows for key in row if key != "prompt"):
        columns.setdefault(key, [row.get(key) for row in rows])
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return columns
    return {key: value for key, value in columns.items() if key in parameters}


def _refuse_repeats(names: Sequence[str]) -> None:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # the sum would be the same with one term of the summed weight; the metrics would clash
        raise RewardSpecError(f"reward {repeated[0]} is given more than once; give it once with its weight")


@dataclasses.dataclass(frozen=True)
class WeightedReward:
    """sum_i weight_i * fn_i: a `rpegjax.rewards.scoring.TermedReward` that the `RewardRunner` scores term by
    term. Terms are per-completion functions `fn(completion, example) -> float` or TRL's batched functions
    `fn(prompts, completions, **columns) -> list[float | None]` (`TermKind`, told apart by the signature).

    A term that raises, or gives something other than a finite number, adds 0 to the sum of the completions it
    failed on and is counted as that term's error (`RewardStats.terms`); the other terms keep their scores. A
    batched term's `None` for a completion (TRL: "does not apply") also adds 0, and is neither an error nor
    part of the term's mean. Called directly, `reward(completion, example)` raises on the first failing term."""

    terms: tuple[RewardTerm, ...]

    def __post_init__(self) -> None:
        if not self.terms:
            raise RewardSpecError("WeightedReward needs at least one term")
        for term in self.terms:
            if not isinstance(term.weight, (int, float)) or isinstance(term.weight, bool) \
                    or not math.isfinite(term.weight):
                raise RewardSpecError(f"reward {term.name or term.fn!r}: the weight must be a finite number, "
                                      f"got {term.weight!r}")
        _refuse_repeats([term.metric_name for term in self.terms])

    @classmethod
    def of(cls, *functions: UserRewardFn | tuple[UserRewardFn, float]) -> WeightedReward:
        """From functions, or `(function, weight)` pairs: `WeightedReward.of(correct, (concise, 0.2))`."""
        terms = []
        for item in functions:
            fn, weight = item if isinstance(item, tuple) else (item, 1.0)
            name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
            terms.append(RewardTerm(check_reward_function(fn, name), float(weight), name))
        return cls(tuple(terms))

    @property
    def term_names(self) -> tuple[str, ...]:
        return tuple(term.metric_name for term in self.terms)

    @property
    def batched(self) -> bool:
        return any(term.kind is TermKind.BATCHED for term in self.terms)

    def _term_values(self, term: RewardTerm, texts: Sequence[str],
                     examples: Sequence[Example]) -> list[float | None | BaseException]:
        """One term's value for each completion: a float, None (a batched term's "does not apply"), or the error."""
        who = f"reward {term.name}"
        if term.kind is TermKind.PER_COMPLETION:
            values: list = []
            for text, example in zip(texts, examples):
                try:
                    values.append(checked_reward(term.fn(text, dict(example)), who))
                except NonFiniteReward as error:
                    values.append(error)
                except Exception as error:
                    values.append(RuntimeError(f"{who}: {describe_error(error)}"))
            return values
        try:
            returned = term.fn(**_batched_arguments(term.fn, texts, examples))
            returned = list(returned)
            if len(returned) != len(texts):
                raise ValueError(f"returned {len(returned)} scores for {len(texts)} completions")
        except Exception as error:
            return [RuntimeError(f"{who}: {describe_error(error)}")] * len(texts)
        values = []
        for value in returned:
            try:
                values.append(None if value is None else checked_reward(value, who))
            except (TypeError, NonFiniteReward) as error:
                values.append(error)
        return values

    def score_terms(self, texts: Sequence[str], examples: Sequence[Example]) -> list[TermScores]:
        """Each completion's scores, term by term (see the class docstring)."""
        per_term = [self._term_values(term, texts, examples) for term in self.terms]
        scores = []
        for item in range(len(texts)):
            row = [values[item] for values in per_term]
            failed = [isinstance(value, BaseException) for value in row]
            scores.append(TermScores(
                total=sum(term.weight * value for term, value, bad in zip(self.terms, row, failed)
                          if not bad and value is not None),
                values=tuple(None if bad else value for value, bad in zip(row, failed)),
                errors=tuple(str(value)[:500] if bad else "" for value, bad in zip(row, failed)),
                nonfinite=sum(isinstance(value, NonFiniteReward) for value in row)))
        return scores

    def __call__(self, completion: str, example: Example) -> float:
        [scores] = self.score_terms([completion], [example])
        failed = [error for error in scores.errors if error]
        if failed:
            raise RuntimeError(failed[0])
        return scores.total


def load_rewards(specs: Sequence[str], search_path: Sequence[str] | None = None, *,
                 import_timeout_s: float = IMPORT_TIMEOUT_S) -> WeightedReward:
    """The weighted sum of the functions `specs` name (`RewardSpec.parse`, `load_reward_function`)."""
    if isinstance(specs, str):
        raise RewardSpecError(f"load_rewards takes a list of specs, got the string {specs!r}")
    parsed = [RewardSpec.parse(text) for text in specs]
    _refuse_repeats([spec.name for spec in parsed])  # before importing anything
    return WeightedReward(tuple(
        RewardTerm(load_reward_function(spec, search_path, import_timeout_s=import_timeout_s), spec.weight, str(spec))
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
