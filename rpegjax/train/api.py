"""The training job from Python (a notebook, a script of one's own): what `scripts/train_grpo.py` does, with
reward functions as Python objects and a dataset as a path or a list of rows.

    import rpegjax

    def correct(completion: str, example: dict) -> float:
        return float(completion.strip().startswith(example["answer"]))

    result = rpegjax.GRPOTrainer(reward_funcs=[correct], train_dataset=[{"prompt": "1+1=", "answer": "2"}, ...],
                                 steps=20).train()
    result.run_dir, result.end_accuracy, result.metrics[-1]

Options are the command line's short flags with `_` for `-` (`group_size=8`, `max_new_tokens=64`, `lr=1e-5`),
`overrides={"rollout.temperature": 0.8}` sets any config field, and `config=` starts from a `RunConfig`.

Where rewards run: a function that a fresh interpreter can import (defined with `def` at module level of an
importable module) runs in the reward worker processes, with the timeout and the memory and CPU limits of the
command line's rewards. A function it cannot import — defined in a notebook or `__main__`, a lambda, a closure —
runs in threads of this process, as TRL runs rewards: the timeout still scores a late call 0 (its thread is
abandoned, not stopped) but no memory or CPU limit applies; the log says which functions run where.
`reward_isolation="process"` makes such a function an error instead, `"thread"` runs every function in process.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import pathlib
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rpegjax.graph.ir import Algorithm
from rpegjax.rewards.custom import (
    RewardedTask,
    RewardSpec,
    RewardSpecError,
    RewardTerm,
    WeightedReward,
    load_reward_function,
)
from rpegjax.rewards.runner import Isolation
from rpegjax.train.config import RunConfig
from rpegjax.train.overrides import apply_overrides

RewardFunc = Callable[[str, dict], float] | str | tuple[Callable[[str, dict], float] | str, float]
Rows = str | pathlib.Path | Sequence[Mapping[str, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainResult:
    """A finished run: its directory, held-out accuracy at the start and the end, every record of
    metrics.jsonl (one per step, plus the evaluations) and the job's summary line."""

    run_dir: pathlib.Path
    start_accuracy: float
    end_accuracy: float
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def final_metrics(self) -> dict[str, Any]:
        """The last training step's record (reward, accuracy, loss, KL, ...)."""
        return [record for record in self.metrics if "loss" in record][-1]


@dataclasses.dataclass(frozen=True)
class InProcessRewardedTask(RewardedTask):
    """A task trained on reward functions that run in threads of this process (see the module docstring)."""

    @property
    def isolation(self) -> Isolation:
        return Isolation.THREAD


def _option_fields(algorithm: Algorithm) -> dict[str, tuple[str, ...]]:
    """Keyword option (a short flag, `_` for `-`) -> the config fields it sets."""
    from rpegjax.train.cli import ALGORITHM_ALIASES, ALGORITHM_ONLY, ALIASES

    flags = {**ALIASES, **ALGORITHM_ONLY[algorithm],
             **{flag: (f"{algorithm.value}.{field}",) for flag, field in ALGORITHM_ALIASES.items()}}
    return {flag.replace("-", "_"): fields for flag, fields in flags.items()}


def _as_text(value: Any) -> str:
    """A Python value as the command line would spell it (the overrides parser reads text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def importable_elsewhere(fn: Any) -> bool:
    """Whether a fresh interpreter (a reward worker process) can import `fn` by its pickled reference."""
    if getattr(fn, "__module__", None) == "__main__":
        return False
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


def reward_terms(funcs: Iterable[RewardFunc], isolation: Isolation | str | None) -> tuple[list[RewardTerm], Isolation]:
    """The terms of `funcs` (functions, `module:function[=weight]` specs, or `(function, weight)` pairs) and
    where they run: in worker processes when every function can be imported there (or `isolation` says
    process, and then one that cannot is an error naming it), else in threads of this process."""
    isolation = None if isolation is None else Isolation(isolation)
    terms = []
    for index, item in enumerate(funcs):
        fn, weight = item if isinstance(item, tuple) else (item, None)
        if isinstance(fn, str):
            spec = RewardSpec.parse(fn)
            fn, name = load_reward_function(spec), spec.name
            weight = spec.weight if weight is None else weight
        else:
            name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
        if not callable(fn) or inspect.isclass(fn):
            raise RewardSpecError(f"reward_funcs[{index}]: {fn!r:.60} is not a function")
        try:
            inspect.signature(fn).bind("completion", {})
        except TypeError:
            raise RewardSpecError(f"reward_funcs[{index}] {name}: cannot be called as function(completion: str, "
                                  f"example: dict); its signature is {inspect.signature(fn)}") from None
        except ValueError:  # a builtin without a signature: nothing to check
            pass
        terms.append(RewardTerm(fn, float(1.0 if weight is None else weight), name))
    if not terms:
        return [], Isolation.PROCESS
    stuck = [term.name for term in terms if not importable_elsewhere(term.fn)]
    if isolation is Isolation.PROCESS and stuck:
        raise RewardSpecError(f"reward {stuck[0]}: a reward worker process cannot import it (defined in a notebook "
                              "or __main__, a lambda or a closure); define it with def in a module on PYTHONPATH, or "
                              "pass reward_isolation='thread' to run it in this process")
    chosen = isolation or (Isolation.THREAD if stuck else Isolation.PROCESS)
    return terms, chosen


class GRPOTrainer:
    """GRPO (and, as `PPOTrainer`, PPO) from Python: builds the run the command line would, with `reward_funcs`
    replacing the task's reward and `train_dataset` (a dataset path, or a list of row dicts: `prompt` and `answer`,
    or GSM8K's / MATH's fields) replacing the built-in task; `train()` runs it and returns a `TrainResult`.

    `model`: a local Hugging Face checkpoint directory (without it a small random model is built; with a dataset
    it has no warm start and hardly learns). `run_dir`: where to write (default `runs/<algorithm>-<time>`); a
    non-empty one is refused unless `overwrite`. List datasets are written to RUN_DIR/data/*.jsonl (row i is line
    i + 1 in error messages), which config.json names. Reward functions given as objects are not in config.json:
    the command line's `--resume` of such a run trains on the task's reward."""

    algorithm = Algorithm.GRPO

    def __init__(self, *, model: str | None = None, reward_funcs: Sequence[RewardFunc] = (),
                 train_dataset: Rows | None = None, eval_dataset: Rows | None = None, config: RunConfig | None = None,
                 run_dir: str | pathlib.Path | None = None, overwrite: bool = False,
                 reward_isolation: Isolation | str | None = None, overrides: Mapping[str, Any] | None = None,
                 log: Callable[[str], None] = print, **options: Any) -> None:
        self.log = log
        base = config if config is not None else RunConfig(algorithm=self.algorithm)
        if base.algorithm != self.algorithm:
            raise ValueError(f"config: a {base.algorithm.value} config given to {type(self).__name__}")
        if isinstance(reward_funcs, (str, bytes)) or callable(reward_funcs):
            reward_funcs = [reward_funcs]
        self.terms, self.isolation = reward_terms(reward_funcs, reward_isolation)
        fields = _option_fields(self.algorithm)
        changes: dict[str, str] = {}
        for option, value in options.items():
            if option not in fields:
                close = difflib.get_close_matches(option, fields, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{type(self).__name__}: unknown option {option!r}{hint} (options: {sorted(fields)}; "
                                "any config field: overrides={'section.field': value})")
            changes.update({field: _as_text(value) for field in fields[option]})
        changes.update({name: _as_text(value) for name, value in (overrides or {}).items()})
        if model is not None:
            changes["model.path"] = str(model)
        if train_dataset is not None or "data.dataset" in changes:
            changes.setdefault("warm_start.steps", "0")  # a dataset has no worked solutions to warm-start on
        self._changes, self._datasets = changes, {"dataset": train_dataset, "eval_dataset": eval_dataset}
        apply_overrides(base, changes)  # a bad option is an error here, before anything is written
        self._base, self._run_dir, self._overwrite = base, run_dir, overwrite

    def train(self) -> TrainResult:
        """Runs the job in a run directory locked for the run's life (as the command line does)."""
        from rpegjax.train.cli import claim_new_run_dir, clear_run_dir
        from rpegjax.train.run_directory import claim_run_directory, drop_if_empty

        fresh = self._run_dir is None or not pathlib.Path(self._run_dir).exists()
        run_dir = pathlib.Path(claim_new_run_dir(self.algorithm) if self._run_dir is None else self._run_dir)
        lock = claim_run_directory(run_dir, resume=False, overwrite=self._overwrite)
        try:
            if self._overwrite:
                clear_run_dir(str(run_dir))
            return self._train_in(run_dir)
        finally:
            drop_if_empty(lock, fresh=fresh)

    def _train_in(self, run_dir: pathlib.Path) -> TrainResult:
        from rpegjax.runtime.compilation_cache import enable_compilation_cache
        from rpegjax.train.build import build
        from rpegjax.train.cli import describe_run
        from rpegjax.train.metrics import read_metrics
        from rpegjax.train.trainer import Trainer

        changes = {**self._changes, "train.run_dir": str(run_dir)}
        for field, rows in self._datasets.items():
            if rows is not None:
                changes[f"data.{field}"] = str(_dataset_path(rows, run_dir / "data" / f"{field}.jsonl"))
        cfg = apply_overrides(self._base, changes)
        self.log(f"run directory: {run_dir}")

        def cache_compiled() -> None:  # once `build` has checked the input: a refused run changes no JAX setting
            if cfg.train.compilation_cache:
                enable_compilation_cache(cfg.train.compilation_cache_dir)

        parts = build(cfg, log=self.log, before_compiling=cache_compiled)
        if self.terms:
            kind = InProcessRewardedTask if self.isolation is Isolation.THREAD else RewardedTask
            parts = dataclasses.replace(parts, task=kind(parts.task, WeightedReward(tuple(self.terms))))
            where = ("in threads of this process (no memory or CPU limit; a late call scores 0)"
                     if self.isolation is Isolation.THREAD else "in reward worker processes")
            self.log(f"reward: {' + '.join(_term_text(t) for t in self.terms)}, {where}; replaces the "
                     f"{parts.task.name} task's reward, held-out accuracy is still its verifier's")
        self.log(describe_run(parts))
        summary = Trainer(parts, run_dir, log=self.log).run()
        return TrainResult(run_dir=run_dir, start_accuracy=summary["start_accuracy"],
                           end_accuracy=summary["end_accuracy"], metrics=read_metrics(run_dir / "metrics.jsonl"),
                           summary=summary)


class PPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with PPO and a critic (`critic="shared"` or `"separate"`)."""

    algorithm = Algorithm.PPO


def _term_text(term: RewardTerm) -> str:
    return term.name if term.weight == 1.0 else f"{term.weight:g} * {term.name}"


def _dataset_path(rows: Rows, path: pathlib.Path) -> pathlib.Path:
    """`rows` itself when it is a path, else the rows written to `path` as JSONL (one row per line)."""
    if isinstance(rows, (str, pathlib.Path)):
        return pathlib.Path(rows)
    if isinstance(rows, Mapping) or not isinstance(rows, Sequence):
        raise ValueError(f"a dataset is a path or a list of row dicts, got {type(rows).__name__}")
    lines = []
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"dataset row {index}: expected a dict, got {type(row).__name__} {row!r:.60}")
        try:
            lines.append(json.dumps(dict(row)))
        except (TypeError, ValueError) as error:
            raise ValueError(f"dataset row {index}: not JSON-serialisable ({error})") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
