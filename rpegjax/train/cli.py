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

import jax
import numpy as np

from rpegjax import distributed
from rpegjax.distributed import DistributedConfig
from rpegjax.graph.ir import Algorithm
from rpegjax.train.config import RunConfig
from rpegjax.train.overrides import apply_overrides

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
    "rollout-devices": ("graph.rollout_devices",),
    "rollout-mesh": ("graph.rollout_mesh",),
    "plan": ("graph.plan",),
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
    "critic": ("ppo.critic",),
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


def parse_args(argv: list[str], algorithm: Algorithm) -> tuple[RunConfig, str | None]:
    """The resolved RunConfig and the run directory to resume (None for a new run)."""
    parser = argparse.ArgumentParser(
        prog=f"train_{algorithm.value}.py",
        description=f"Train a reasoning policy with {algorithm.value.upper()} through the RPEG runtime. Without "
                    "arguments: a small model learns the built-in arithmetic task on the CPU.",
        epilog="Any config field: --section.field=value (sections: model, data, rollout, warm_start, graph, train, "
               f"{algorithm.value}, distributed; e.g. --{algorithm.value}.optimizer.learning_rate=1e-4). Several "
               "processes: --distributed.coordinator_address=HOST:PORT --distributed.num_processes=N "
               "--distributed.process_id=I, or the JAX_* / SLURM_* variables.",
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
    for section in Algorithm:
        for derived, source in (("group_size", "--group-size"), ("temperature", "--temperature")):
            if f"{section.value}.{derived}" in overrides:
                parser.error(f"set {derived} with {source} (rollout.{derived}); {section.value}.{derived} follows it")
    if "data.dataset" in overrides:
        overrides.setdefault("warm_start.steps", "0")  # a dataset has no reference solutions to warm-start on
    if known.resume:
        config_path = pathlib.Path(known.resume) / "config.json"
        if not config_path.is_file():
            parser.error(f"--resume {known.resume}: no config.json there (not a run directory)")
        # the distributed section describes a launch (which process this is), not the run: start afresh
        base = RunConfig.from_json(config_path.read_text()).replace(distributed=DistributedConfig())
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


def default_run_dir(algorithm: Algorithm) -> str:
    return str(pathlib.Path("runs") / f"{algorithm.value}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def join_processes(config: RunConfig) -> DistributedConfig:
    """Joins the other processes of this launch (`rpegjax.distributed.initialize`; a no-op for one
    process): the `distributed` section's values first, then the JAX_* / SLURM_* variables. Returns the
    resolved section. Must run before any JAX computation."""
    section = config.distributed
    resolved = DistributedConfig.from_env(**{f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
    distributed.initialize(resolved)
    return resolved


def agree_on_run_dir(config: RunConfig, algorithm: Algorithm) -> RunConfig:
    """Fills in the default run directory, named by process 0's clock in every process, and checks that every
    process runs the same configuration (the `distributed` section aside: it names the process)."""
    run_dir = config.train.run_dir
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if run_dir is None:  # one name for all: the wall clock differs between hosts
            encoded = np.zeros(512, np.uint8)
            name = default_run_dir(algorithm).encode()
            encoded[: len(name)] = np.frombuffer(name, np.uint8)
            run_dir = bytes(multihost_utils.broadcast_one_to_all(encoded)).rstrip(b"\0").decode()
        config = config.replace(train=dataclasses.replace(config.train, run_dir=run_dir))
        distributed.assert_same_across_processes(
            config.replace(distributed=DistributedConfig()).to_json(), "the run configuration")
    elif run_dir is None:
        config = config.replace(train=dataclasses.replace(config.train, run_dir=default_run_dir(algorithm)))
    return config


def main(argv: list[str], algorithm: Algorithm) -> int:
    config, resume = parse_args(argv, algorithm)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # stdout carries only the summary line
    try:
        resolved = join_processes(config)
    except ValueError as error:  # a flag or variable that does not parse
        say(f"error: {error}")
        return 2
    except RuntimeError as error:  # could not reach the others
        say(f"error: {error}")
        return 1
    # one process speaks for all (every process computes the same); errors are reported by each, named
    main_process = distributed.is_main_process()
    where = f"process {resolved.process_id}: " if resolved.is_multi_process else ""
    log = say if main_process else (lambda _: None)

    from rpegjax.train.build import build
    from rpegjax.train.checkpoint import CheckpointError
    from rpegjax.train.trainer import Trainer

    config = agree_on_run_dir(config.replace(distributed=resolved), algorithm)
    log(f"run directory: {config.train.run_dir}")
    if resolved.is_multi_process:
        log(f"{resolved.num_processes} processes joined (coordinator {resolved.coordinator_address})")
    try:
        parts = build(config, log=log)
        log(parts.graph.to_text())
        summary = Trainer(parts, config.train.run_dir, resume=resume is not None, is_main_process=main_process,
                          log=log).run()
    except (ValueError, CheckpointError) as error:  # bad input: say what and where, no traceback
        say(f"{where}error: {error}")
        return 2
    if main_process:
        print(json.dumps(summary), flush=True)
    return 0
