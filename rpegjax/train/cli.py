"""The command line of the training jobs (`scripts/train_grpo.py`, `scripts/train_ppo.py`).

Every field of `RunConfig` is settable as `--section.field=value` (e.g. `--rollout.temperature=0.8`,
`--grpo.optimizer.learning_rate=1e-4`); the common ones also have short flags (see `--help`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
import functools
import json
import pathlib
import shutil
import sys
from collections.abc import Callable

import jax
import numpy as np

from rpegjax import distributed
from rpegjax.distributed import DistributedConfig
from rpegjax.graph.ir import Algorithm
from rpegjax.train.config import Recipe, RunConfig, recipe_overrides
from rpegjax.train.config_diff import check_same_across_processes
from rpegjax.train.flag_help import FLAG_HELP
from rpegjax.train.overrides import apply_overrides
from rpegjax.train.run_directory import claim_for_run, drop_if_empty, run_files

# short flag -> dotted fields it sets (a flag may set several)
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("model.path",),
    "dataset": ("data.dataset",),
    "eval-dataset": ("data.eval_dataset",),
    "dataset-format": ("data.dataset_format",),
    "prompt-field": ("data.prompt_field",),
    "answer-field": ("data.answer_field",),
    "chat-template": ("data.chat_template",),
    "system-prompt": ("data.system_prompt",),
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
    "max-prompt-len": ("rollout.max_prompt_len",),
    "max-new-tokens": ("rollout.max_new_tokens",),
    "temperature": ("rollout.temperature",),
    "env": ("rollout.env",),
    "max-turns": ("rollout.max_turns",),
    "episode-token-budget": ("rollout.episode_token_budget",),
    "steps": ("train.steps",),
    "seed": ("train.seed",),
    "run-dir": ("train.run_dir",),
    "checkpoint-every": ("train.checkpoint_every",),
    "eval-every": ("train.eval_every",),
    "sample-every": ("train.sample_every",),
    "max-nonfinite-steps": ("train.max_nonfinite_steps",),
    "reward-memory-mb": ("train.reward_memory_mb",),
    "reward-cpu-s": ("train.reward_cpu_s",),
    "warm-start-steps": ("warm_start.steps",),
    "lora-rank": ("lora.rank",),
    "lora-alpha": ("lora.alpha",),
    "lora-targets": ("lora.targets",),
    "lora-dropout": ("lora.dropout",),
    "lora-generation": ("lora.generation",),
    "lora-lr": ("lora.learning_rate",),
}
# flags of one algorithm's script only
ALGORITHM_ONLY: dict[Algorithm, dict[str, tuple[str, ...]]] = {
    Algorithm.GRPO: {"advantage": ("grpo.advantage",), "dynamic-sampling": ("grpo.dynamic_sampling",),
                     "overlong-buffer": ("grpo.overlong_buffer",), "overlong-penalty": ("grpo.overlong_penalty",)},
    Algorithm.PPO: {"critic": ("ppo.critic",)},
}
ALGORITHM_ALIASES = {
    "lr": "optimizer.learning_rate",
    "kl-coef": "kl_coef",
    "loss": "loss",
    "clip-low": "clip_low",
    "clip-high": "clip_high",
    "aggregation": "aggregation",
    "correction": "correction",
    "epochs": "epochs",
    "minibatches": "num_minibatches",
}
_ACTION_FLAGS = ("recipe", "resume", "overwrite", "config", "print-config", "verbose", "dry-run", "memory-gb",
                 "dry-run-target", "help")
REWARD_FLAG = "reward"  # repeatable: each one a term of data.reward


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """What the command line asks for: the resolved config, the run to resume (None: a new run), whether an
    existing run directory may be replaced, and whether to only print the config."""

    config: RunConfig
    resume: str | None = None
    overwrite: bool = False
    print_config: bool = False
    verbose: bool = False
    dry_run: bool = False
    memory_gb: float | None = None
    dry_run_target: str = "cpu"


def _field(config: object, dotted: str) -> tuple[object, object]:
    """The value and type annotation of the field `dotted` of `config`."""
    import typing

    node, annotation = config, None
    for name in dotted.split("."):
        annotation = typing.get_type_hints(type(node))[name]
        node = getattr(node, name)
    return node, annotation


def _flag_help(defaults: RunConfig, flag: str, fields: tuple[str, ...]) -> str:
    """What `--flag` does (`FLAG_HELP`), then the field it sets, its default and its choices."""
    import enum
    import typing

    value, annotation = _field(defaults, fields[0])
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    choices = [m.value for option in options if isinstance(option, type) and issubclass(option, enum.Enum)
               for m in option]
    shown = value.value if isinstance(value, enum.Enum) else ("unset" if value is None else value)
    if isinstance(shown, tuple):
        shown = ",".join(map(str, shown))
    text = f"{FLAG_HELP[flag].meaning} ({', '.join(fields)}; default: {shown}"
    return text + (f"; one of {', '.join(choices)})" if choices else ")")


def _known_flags(algorithm: Algorithm) -> list[str]:
    return [*ALIASES, *ALGORITHM_ONLY[algorithm], *ALGORITHM_ALIASES, *_ACTION_FLAGS, REWARD_FLAG]


def parse_command(argv: list[str], algorithm: Algorithm) -> Command:
    """Parses the command line into a `Command`; a bad flag or value exits with a message (status 2)."""
    parser, short = _command_parser(algorithm)
    known, rest = parser.parse_known_args(argv)
    overrides = _collect_overrides(parser, known, rest, short, algorithm)
    config = _resolve_config(parser, known, overrides, RunConfig(algorithm=algorithm))
    if config.algorithm != algorithm:
        source = "--resume: that run" if known.resume else f"--config {known.config}: it"
        parser.error(f"{source} used {config.algorithm.value}, not {algorithm.value}")
    return Command(config=config, resume=known.resume, overwrite=known.overwrite, print_config=known.print_config,
                   verbose=known.verbose, dry_run=known.dry_run, memory_gb=known.memory_gb,
                   dry_run_target=known.dry_run_target)


def _command_parser(algorithm: Algorithm) -> tuple[argparse.ArgumentParser, dict[str, tuple[str, ...]]]:
    """The job's argument parser and its short flags (flag -> the dotted fields it sets)."""
    defaults = RunConfig(algorithm=algorithm)
    parser = argparse.ArgumentParser(
        prog=f"train_{algorithm.value}.py", allow_abbrev=False,
        description=f"Train a reasoning policy with {algorithm.value.upper()} through the RPEG runtime. Without "
                    "arguments: a small model learns the built-in arithmetic task on the CPU.",
        epilog="Any config field: --section.field=value (sections: model, data, rollout, warm_start, graph, train, "
               f"{algorithm.value}, distributed; e.g. --{algorithm.value}.optimizer.learning_rate=1e-4; "
               "--print-config shows them all with their values). Several "
               "processes: --distributed.coordinator_address=HOST:PORT --distributed.num_processes=N "
               "--distributed.process_id=I, or the JAX_* / SLURM_* variables.",
    )
    short = {**ALIASES, **ALGORITHM_ONLY[algorithm],
             **{flag: (f"{algorithm.value}.{field}",) for flag, field in ALGORITHM_ALIASES.items()}}
    for flag, fields in short.items():
        parser.add_argument(f"--{flag}", dest=flag, metavar=FLAG_HELP[flag].metavar,
                            help=_flag_help(defaults, flag, fields))
    parser.add_argument(f"--{REWARD_FLAG}", action="append", metavar="MODULE:FUNCTION[=WEIGHT]",
                        help="train on your reward function(completion: str, example: dict) -> float, or TRL's "
                        "function(prompts, completions, **columns) -> list[float], from a module in the current "
                        "directory or on PYTHONPATH; repeat for a weighted sum (data.reward; default: the task's own "
                        "reward)")
    parser.add_argument("--recipe", choices=[r.value for r in Recipe], help="start from a preset (dapo: clip-higher "
                        "0.2/0.28, token-mean loss, no KL, dynamic sampling, overlong shaping; Yu et al. 2025, "
                        "arXiv:2503.14476); flags given explicitly win over it")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last complete "
                        "checkpoint (its config.json is used; further flags override it)")
    parser.add_argument("--overwrite", action="store_true", help="replace what an earlier run left in --run-dir "
                        "(without it a non-empty run directory is refused)")
    parser.add_argument("--config", metavar="FILE", help="start from the config in FILE: JSON (a run's config.json, "
                        "--print-config output) or YAML (.yaml/.yml); fields it leaves out keep their defaults, "
                        "further flags override it")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    parser.add_argument("--verbose", action="store_true", help="also print developer detail: the executed graph "
                        "(stages, edges, placements and their meshes)")
    parser.add_argument("--dry-run", action="store_true", help="compile every stage program of the run's graph (its "
                        "--plan) ahead of time without allocating, print per-device memory against the capacity, "
                        "compiled FLOPs and the planned step time, and exit (non-zero when it does not fit); on "
                        "virtual CPU devices when the plan needs more devices than exist")
    parser.add_argument("--memory-gb", type=float, metavar="GB", help="--dry-run: usable memory per device "
                        "(default: what the devices report, 90%% of the GPU's for a CUDA target; required on CPU)")
    parser.add_argument("--dry-run-target", default="cpu", choices=["cpu", "cuda-h100", "cuda-gh200"],
                        help="--dry-run: cpu compiles for this machine's devices (virtual CPU devices when the plan "
                             "needs more; their bfloat16 programs hold float32 copies); cuda-h100 / cuda-gh200 for "
                             "compile-only GPUs of the plan's count with XLA's GPU compiler (needs JAX's CUDA plugin: "
                             "pip install 'rpegjax[gpu-aot]'; no GPU needed)")
    return parser, short


def _collect_overrides(parser: argparse.ArgumentParser, known: argparse.Namespace, rest: list[str],
                       short: dict[str, tuple[str, ...]], algorithm: Algorithm) -> dict[str, str]:
    """`{"section.field": text}` from the `--section.field=value` arguments and the short flags given."""
    overrides: dict[str, str] = {}
    index = 0
    while index < len(rest):
        item = rest[index]
        if not item.startswith("--") or "." not in item.split("=")[0]:
            name = item.split("=")[0].lstrip("-")
            close = difflib.get_close_matches(name, _known_flags(algorithm), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            parser.error(f"unrecognised argument {item!r}{hint} (config fields are --section.field=value)")
        name, sep, value = item[2:].partition("=")
        if not sep:
            if index + 1 >= len(rest):
                parser.error(f"--{name} needs a value")
            index += 1
            value = rest[index]
        overrides[name] = value
        index += 1
    for flag, fields in short.items():
        value = getattr(known, flag)
        if value is not None:
            for field in fields:
                overrides.setdefault(field, value)
    if known.reward:
        if not all(spec.strip() for spec in known.reward):  # joined, an empty spec would vanish silently
            parser.error(f"--reward {known.reward!r}: an empty reward; give package.module:function[=weight]")
        overrides.setdefault("data.reward", ",".join(known.reward))
    for section in Algorithm:
        for derived, source in (("group_size", "--group-size"), ("temperature", "--temperature")):
            if f"{section.value}.{derived}" in overrides:
                parser.error(f"set {derived} with {source} (rollout.{derived}); {section.value}.{derived} follows it")
    if "data.dataset" in overrides:
        overrides.setdefault("warm_start.steps", "0")  # a dataset has no reference solutions to warm-start on
    return overrides


def _resolve_config(parser: argparse.ArgumentParser, known: argparse.Namespace, overrides: dict[str, str],
                    defaults: RunConfig) -> RunConfig:
    """The run's config: the defaults, a `--config` file or the resumed run's config.json, then the recipe's
    preset, then the overrides (explicit flags win)."""
    if known.resume and known.config:
        parser.error("--resume takes the run's own config.json; --config cannot be combined with it")
    if known.resume and known.overwrite:
        parser.error("--resume continues the run in its directory; --overwrite would delete it")
    try:
        if known.resume:
            config_path = pathlib.Path(known.resume) / "config.json"
            if not config_path.is_file():
                parser.error(f"--resume {known.resume}: no config.json there (not a run directory)")
            # the distributed section describes a launch (which process this is), not the run: start afresh
            base = RunConfig.from_file(config_path).replace(distributed=DistributedConfig())
            overrides.setdefault("train.run_dir", known.resume)
        elif known.config:
            base = RunConfig.from_file(known.config)
        else:
            base = defaults
        config = apply_overrides(base, overrides)
        if known.recipe:  # the preset under the explicit flags; its sizes follow the resolved config
            preset = recipe_overrides(known.recipe, max_new_tokens=config.rollout.max_new_tokens)
            config = apply_overrides(base, {**preset, **overrides})
    except ValueError as error:  # ConfigFileError included: it names the file and the field
        parser.error(str(error))
    return config


def parse_args(argv: list[str], algorithm: Algorithm) -> tuple[RunConfig, str | None]:
    """The resolved RunConfig and the run directory to resume (None for a new run)."""
    command = parse_command(argv, algorithm)
    return command.config, command.resume


def default_run_dir(algorithm: Algorithm) -> str:
    return str(pathlib.Path("runs") / f"{algorithm.value}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def claim_new_run_dir(algorithm: Algorithm) -> str:
    """Creates and returns a fresh default run directory: the time, then -2, -3... when runs started in the
    same second took it (the mkdir is atomic: two runs never share one)."""
    base = default_run_dir(algorithm)
    for attempt in range(1, 1000):
        candidate = base if attempt == 1 else f"{base}-{attempt}"
        try:
            pathlib.Path(candidate).mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            continue
        return candidate
    raise RuntimeError(f"cannot find a free run directory name {base}-N")


def clear_run_dir(run_dir: str) -> None:
    """Deletes what an earlier run left in `run_dir` (for `--overwrite`, once everything is validated)."""
    for child in run_files(pathlib.Path(run_dir)):  # the run's lock stays: this run holds it
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


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
        if run_dir is None:  # one name for all: the wall clock differs between hosts
            run_dir = distributed.broadcast_text(claim_new_run_dir(algorithm) if jax.process_index() == 0 else None)
        config = config.replace(train=dataclasses.replace(config.train, run_dir=run_dir))
        check_same_across_processes(config.replace(distributed=DistributedConfig()).to_json())
    elif run_dir is None:
        config = config.replace(train=dataclasses.replace(config.train, run_dir=claim_new_run_dir(algorithm)))
    return config


def main(argv: list[str], algorithm: Algorithm) -> int:
    command = parse_command(argv, algorithm)
    config = command.config
    if command.print_config:
        print(config.to_json(), flush=True)
        return 0
    say = lambda message: print(message, file=sys.stderr, flush=True)  # stdout carries only the summary line
    if command.dry_run:
        return _dry_run(config, command.memory_gb, command.dry_run_target, say)
    try:
        resolved = join_processes(config)
        watch = distributed.watch_peers(resolved)  # a killed peer ends this process within a second, named
    except ValueError as error:  # a flag or variable that does not parse
        say(f"error: {error}")
        return 2
    except (RuntimeError, OSError) as error:  # could not reach the others
        say(f"error: {error}")
        return 1
    try:
        code = _run_joined(command, algorithm, resolved, say)
    except BaseException as error:
        if watch is not None:
            watch.close(error)
        raise
    if watch is not None:
        watch.close(None if code == 0 else RuntimeError(f"it stopped with an error (exit code {code}; see its log)"))
    return code


def _run_joined(command: Command, algorithm: Algorithm, resolved: DistributedConfig, say: Callable[[str], None]
                ) -> int:
    """The job of a joined process (`main`): builds the run, trains it, prints the summary line; returns the exit
    code (2: bad input, 1: the run failed)."""
    config, resume = command.config, command.resume
    # one process speaks for all (every process computes the same); errors are reported by each, named
    main_process = distributed.is_main_process()
    where = f"process {resolved.process_id}: " if resolved.is_multi_process else ""
    log = say if main_process else (lambda _: None)

    from rpegjax.envs.python_sandbox import SandboxError
    from rpegjax.runtime.compilation_cache import enable_compilation_cache
    from rpegjax.train.build import build
    from rpegjax.train.checkpoint import CheckpointError
    from rpegjax.train.metrics import require_wandb
    from rpegjax.train.trainer import Trainer, TrainingError

    claimed = config.train.run_dir is None and resume is None

    # JAX's compilation cache goes on before the first compilation, and only once the input is checked (by
    # `build`), so that a refused call leaves the process's JAX settings as they were
    @functools.cache
    def cache_compiled() -> None:
        if config.train.compilation_cache:
            try:
                log(f"compiled programs cached in {enable_compilation_cache(config.train.compilation_cache_dir)}")
            except OSError as error:  # bad input (refused, exit code 2), not a run that failed to write
                raise ValueError(f"train.compilation_cache_dir: {error}") from None

    try:
        if resolved.is_multi_process:  # the processes' agreement on the run directory compiles collectives
            cache_compiled()
        if config.train.wandb and main_process:  # before anything is built: a missing package is found at once
            require_wandb()
        config = agree_on_run_dir(config.replace(distributed=resolved), algorithm)
    except (ValueError, OSError) as error:
        say(f"{where}error: {error}")
        return 2
    run_dir = config.train.run_dir
    fresh = claimed or not pathlib.Path(run_dir).exists()  # this launch makes the directory
    log(f"run directory: {run_dir}")
    if resolved.is_multi_process:
        log(f"{resolved.num_processes} processes joined (coordinator {resolved.coordinator_address})")
    lock = None
    try:  # the directory is claimed (locked, then checked) before anything is built or written
        lock = claim_for_run(run_dir, resume=resume is not None, overwrite=command.overwrite)
        parts = build(config, log=log, before_compiling=cache_compiled)
        from rpegjax.runtime.roles import writer_process

        # over process groups the first training process speaks and writes (it holds the state and the results)
        main_process = jax.process_index() == writer_process(parts.graph)
        log = say if main_process else (lambda _: None)
        log(describe_run(parts))
        if command.verbose:
            log(parts.graph.to_text())
        if command.overwrite and main_process:
            clear_run_dir(run_dir)
            log(f"--overwrite: removed the earlier contents of {run_dir}")
        summary = Trainer(parts, run_dir, resume=resume is not None, is_main_process=main_process, log=log).run()
    except (ValueError, CheckpointError, SandboxError) as error:  # bad input, a sandbox that cannot run: no traceback
        say(f"{where}error: {error}")
        drop_if_empty(lock, fresh=fresh)
        return 2
    except TrainingError as error:  # the run went wrong (non-finite values): its checkpoints are kept
        say(f"{where}error: {error}")
        return 1
    except OSError as error:  # the file system refused (read-only directory, full disk): one line, no traceback
        name = f"{error.filename}: " if error.filename else ""
        say(f"{where}error: cannot write the run: {name}{error.strerror or error} (completed checkpoints in "
            f"{run_dir}/checkpoints are intact)")
        drop_if_empty(lock, fresh=fresh)
        return 1
    finally:
        if lock is not None:
            lock.release()
    if main_process:
        print(json.dumps(summary), flush=True)
    return 0


def describe_run(parts) -> str:
    """A few lines that tell a newcomer what this run does and where to look (the graph is `--verbose`'s)."""
    cfg = parts.cfg
    data, rollout, train, model = cfg.data, cfg.rollout, cfg.train, parts.model_cfg
    source = data.dataset if data.dataset is not None else f"the built-in {data.task.value} task ({data.difficulty.value})"
    weights = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(parts.learner.actor_params(parts.learner.params)))
    lag = (f"generation uses weights {cfg.graph.async_bound} step(s) old while the previous step trains"
           if cfg.graph.async_bound else "on-policy: generation waits for the newest weights")
    every = lambda n, what: f"{what} every {n} steps" if n else f"no {what}"
    return "\n".join([
        f"{cfg.algorithm.value.upper()} on {source}: {len(parts.train_examples)} training, "
        f"{len(parts.eval_examples)} held-out problems",
        f"model: {describe_model(cfg)} ({model.num_layers} layers, hidden {model.hidden_size}, "
        f"{weights / 1e6:.2f} M parameters)",
        *([describe_lora(parts)] if cfg.lora.enabled else []),
        f"algorithm: {describe_algorithm(cfg)}",
        f"each step: {rollout.prompts_per_step} prompts x {rollout.group_size} samples of up to "
        f"{rollout.max_new_tokens} tokens; {lag}",
        f"devices: {describe_placement(parts.graph, cfg.graph.plan)}",
        f"{train.steps} steps; held-out accuracy at the start and end, {every(train.eval_every, 'evaluation')}, "
        f"{every(train.sample_every, 'samples')}, {every(train.checkpoint_every, 'checkpoint')}",
        f"watch: tensorboard --logdir {pathlib.Path(train.run_dir) / 'tensorboard'}  (samples.jsonl, training.png "
        "at the end; --verbose shows the executed graph)",
    ])


def describe_model(cfg: RunConfig) -> str:
    """Where the weights come from; a dataset run without --model is said to start from random weights."""
    if cfg.model.path is not None:
        return cfg.model.path
    built = "a new Qwen2-style model for the character tokenizer"
    if cfg.warm_start.steps > 0:
        return f"{built}, warm-started with {cfg.warm_start.steps} supervised steps on the task's worked solutions"
    if cfg.data.dataset is not None:
        return (f"{built} with RANDOM weights and no warm start (a dataset has no worked solutions): it will "
                "hardly learn; give --model DIR to fine-tune a pretrained checkpoint")
    return f"{built} with random weights (warm start off: --warm-start-steps 0)"


def describe_algorithm(cfg: RunConfig) -> str:
    """The recipe and the loss settings that distinguish runs (and PPO's critic)."""
    if cfg.algorithm == Algorithm.PPO:
        algo = cfg.ppo
        critic = {"shared": "shared (a value head on the actor's trunk)",
                  "separate": "separate (a second model)"}[cfg.ppo.critic.value]
        head = f"PPO, critic {critic}"
    else:
        algo = cfg.grpo
        sampling = ", dynamic sampling" if cfg.grpo.dynamic_sampling else ""
        overlong = f", overlong penalty over {cfg.grpo.overlong_buffer} tokens" if cfg.grpo.overlong_buffer else ""
        head = f"GRPO, recipe {cfg.recipe.value}, advantage {cfg.grpo.advantage.value}{sampling}{overlong}"
    return (f"{head}; loss {algo.loss.value}, clip {algo.clip_low:g}/{algo.clip_high:g}, {algo.aggregation.value}, "
            f"KL coefficient {algo.kl_coef:g}, lr {algo.optimizer.learning_rate:g}")


def describe_placement(graph, plan: str | None) -> str:
    """Which devices generate and which train, and their meshes (from the executed graph)."""
    from rpegjax.graph.ir import StageKind
    from rpegjax.runtime.meshes import stage_mesh

    def where(kind: StageKind) -> tuple[list[int], str]:
        mesh = stage_mesh(graph, graph.stages_of_kind(kind)[0].name)
        indices = sorted(jax.devices().index(device) for device in mesh.devices.flat)
        shape = ",".join(f"{axis}={size}" for axis, size in mesh.shape.items())
        return indices, shape

    generation, generation_mesh = where(StageKind.GENERATE)
    training, training_mesh = where(StageKind.ACTOR_UPDATE)
    span = lambda indices: (f"{indices[0]}" if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"
                            if indices == list(range(indices[0], indices[-1] + 1)) else ",".join(map(str, indices)))
    platform = jax.devices()[0].platform
    source = f" (plan {plan})" if plan else ""
    if generation == training:
        return (f"colocated{source}: generation (mesh {generation_mesh}) and training (mesh {training_mesh}) "
                f"time-share {platform} devices {span(training)}")
    return (f"split{source}: generation on {platform} devices {span(generation)} (mesh {generation_mesh}), training on "
            f"{span(training)} (mesh {training_mesh})")


def _state_bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def describe_lora(parts) -> str:
    """What a LoRA run trains, and the optimiser memory that saves (from the optimiser's own state shapes)."""
    learner, lora = parts.learner, parts.cfg.lora
    trainable = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(learner.params))
    whole = learner.model_params(learner.params)
    optimiser = _state_bytes(jax.eval_shape(learner.optimizer.init, learner.params))
    full = _state_bytes(jax.eval_shape(learner.optimizer.init, whole))
    algorithm = parts.cfg.algorithm_section()
    dropout = f", dropout {lora.dropout:g} in the update" if lora.dropout else ""
    return (f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.targets)}{dropout}; trainable "
            f"{trainable / 1e6:.3f} M of {sum(leaf.size for leaf in jax.tree.leaves(whole)) / 1e6:.2f} M parameters; "
            f"optimiser state {optimiser / 2**20:.2f} MiB (full fine-tuning: {full / 2**20:.2f} MiB); "
            f"lr {lora.optimizer(algorithm.optimizer).learning_rate:g}; generation: {lora.generation.value} weights")


def _dry_run(config: RunConfig, memory_gb: float | None, target: str, say) -> int:
    """`--dry-run`: the table on stdout; 0 when every program fits, 3 when one does not, 2 for bad input."""
    from rpegjax.train import dry_run
    from rpegjax.train.compile_target import DryRunTarget, prepare_host

    try:
        prepare_host(DryRunTarget(target))
        if DryRunTarget(target) is DryRunTarget.CPU:
            dry_run.ensure_devices(dry_run.plan_devices(config))  # may re-run this process on virtual devices
        report = dry_run.dry_run_config(config, capacity_bytes=None if memory_gb is None else memory_gb * 1e9, log=say,
                                        target=DryRunTarget(target))
    except ValueError as error:
        say(f"error: {error}")
        return 2
    print(report.table(), flush=True)
    if not report.fits:
        say(f"error: {report.refusal()}")
        return 3
    return 0
