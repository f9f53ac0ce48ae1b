"""The command line of the training jobs (`scripts/train_grpo.py`, `scripts/train_ppo.py`).

Every field of `RunConfig` is settable as `--section.field=value` (e.g. `--rollout.temperature=0.8`,
`--grpo.optimizer.learning_rate=1e-4`); the common ones also have short flags (see `--help`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys

from rpegjax.cli_overrides import apply_overrides
from rpegjax.config import AlgorithmKind, RunConfig

# short flag -> dotted fields it sets (a flag may set several)
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("model.path",),
    "dataset": ("data.dataset",),
    "eval-dataset": ("data.eval_dataset",),
    "dataset-format": ("data.dataset_format",),
    "task": ("data.task",),
    "difficulty": ("data.difficulty",),
    "mesh": ("graph.mesh",),
    "async-bound": ("graph.async_bound",),
    "fuse": ("graph.fuse",),
    "microbatches": ("graph.generate_microbatches",),
    "group-size": ("rollout.group_size",),
    "prompts-per-step": ("rollout.prompts_per_step",),
    "max-new-tokens": ("rollout.max_new_tokens",),
    "temperature": ("rollout.temperature",),
    "steps": ("train.steps",),
    "seed": ("train.seed",),
    "run-dir": ("train.run_dir",),
    "checkpoint-every": ("train.checkpoint_every",),
    "warm-start-steps": ("warm_start.steps",),
    "critic": ("critic",),
}
ALGORITHM_ALIASES = {
    "lr": "optimizer.learning_rate",
    "kl-coef": "kl_coef",
    "loss": "loss",
    "clip-low": "clip_low",
    "clip-high": "clip_high",
    "aggregation": "aggregation",
    "epochs": "epochs",
    "minibatches": "num_minibatches",
}


def parse_args(argv: list[str], algorithm: AlgorithmKind) -> tuple[RunConfig, str | None]:
    """The resolved RunConfig and the run directory to resume (None for a new run)."""
    parser = argparse.ArgumentParser(
        prog=f"train_{algorithm.value}.py",
        description=f"Train a reasoning policy with {algorithm.value.upper()} through the RPEG runtime. Without "
                    "arguments: a small model learns the built-in arithmetic task on the CPU.",
        epilog="Any config field: --section.field=value (sections: model, data, rollout, warm_start, graph, train, "
               f"{algorithm.value}; e.g. --{algorithm.value}.optimizer.learning_rate=1e-4).",
    )
    for flag, fields in ALIASES.items():
        parser.add_argument(f"--{flag}", dest=flag, help=f"sets {', '.join(fields)}")
    for flag, field in ALGORITHM_ALIASES.items():
        parser.add_argument(f"--{flag}", dest=flag, help=f"sets {algorithm.value}.{field}")
    parser.add_argument("--advantage", help="grpo.advantage (grpo, dr-grpo, rloo, reinforce++, ...)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last complete "
                        "checkpoint (its config.json is used; further flags override it)")
    known, rest = parser.parse_known_args(argv)
    overrides: dict[str, str] = {}
    index = 0
    while index < len(rest):
        item = rest[index]
        if not item.startswith("--") or "." not in item.split("=")[0]:
            parser.error(f"unrecognised argument {item!r}; config fields are --section.field=value")
        name, sep, value = item[2:].partition("=")
        if not sep:
            if index + 1 >= len(rest):
                parser.error(f"--{name} needs a value")
            index += 1
            value = rest[index]
        overrides[name] = value
        index += 1
    for flag, fields in ALIASES.items():
        value = getattr(known, flag)
        if value is not None:
            for field in fields:
                overrides.setdefault(field, value)
    for flag, field in ALGORITHM_ALIASES.items():
        value = getattr(known, flag)
        if value is not None:
            overrides.setdefault(f"{algorithm.value}.{field}", value)
    if known.advantage is not None:
        overrides.setdefault("grpo.advantage", known.advantage)
    for derived, source in (("group_size", "--group-size"), ("temperature", "--temperature")):
        if f"{algorithm.value}.{derived}" in overrides:
            parser.error(f"set {derived} with {source} (rollout.{derived}); {algorithm.value}.{derived} follows it")
    if "data.dataset" in overrides:
        overrides.setdefault("warm_start.steps", "0")  # a dataset has no reference solutions to warm-start on
    if known.resume:
        config_path = pathlib.Path(known.resume) / "config.json"
        if not config_path.is_file():
            parser.error(f"--resume {known.resume}: no config.json there (not a run directory)")
        base = RunConfig.from_json(config_path.read_text())
        overrides.setdefault("train.run_dir", known.resume)
    else:
        base = RunConfig(algorithm=algorithm)
    try:
        config = apply_overrides(base, overrides)
    except ValueError as error:
        parser.error(str(error))
    if config.algorithm != algorithm:
        parser.error(f"--resume: that run used {config.algorithm.value}, not {algorithm.value}")
    return config, known.resume


def default_run_dir(algorithm: AlgorithmKind) -> str:
    return str(pathlib.Path("runs") / f"{algorithm.value}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def main(argv: list[str], algorithm: AlgorithmKind) -> int:
    from rpegjax.checkpoint import CheckpointError
    from rpegjax.trainer import Trainer
    from rpegjax.training import build

    config, resume = parse_args(argv, algorithm)
    if config.train.run_dir is None:
        config = config.replace(train=dataclasses.replace(config.train, run_dir=default_run_dir(algorithm)))
    log = lambda message: print(message, file=sys.stderr, flush=True)  # stdout carries only the summary line
    log(f"run directory: {config.train.run_dir}")
    try:
        parts = build(config, log=log)
        log(parts.graph.to_text())
        summary = Trainer(parts, config.train.run_dir, resume=resume is not None, log=log).run()
    except (ValueError, CheckpointError) as error:  # bad input: say what and where, no traceback
        log(f"error: {error}")
        return 2
    print(json.dumps(summary), flush=True)
    return 0
