"""Runs a built training job through the RPEG runtime: held-out evaluation at the start, every N steps and
at the end, progress bar, metrics, sample completions, checkpoints (every N steps, keep last K; resumable),
plots, traces and the final policy as a Hugging Face directory."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rpegjax import distributed
from rpegjax.data.iterator import DataIterator
from rpegjax.distributed.hosts import ProcessAddress
from rpegjax.envs.rollout import EpisodeConfig, EpisodeRunner
from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph.ir import Algorithm
from rpegjax.graph.trace import Trace, gantt_png
from rpegjax.models.precision import generation_cast
from rpegjax.rewards.runner import ResourceLimits, RewardRunner
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.programs import StagePrograms
from rpegjax.runtime.roles import Role, process_groups
from rpegjax.train.build import Components, run_partial_rollouts
from rpegjax.train.checkpoint import Checkpointer, CheckpointError
from rpegjax.train.config import RunConfig, TrainSection
from rpegjax.train.evaluation import evaluate_accuracy
from rpegjax.train.export import export_adapter, export_policy
from rpegjax.train.health import TrainingError, nonfinite_leaves
from rpegjax.train.hooks import (
    AdapterVersions,
    Console,
    Hook,
    NonFiniteCheck,
    Period,
    StepInfo,
    StepTimer,
    metrics_hook,
    progress_hook,
    reward_errors_hook,
    run_hooks,
)
from rpegjax.train.metrics import MetricsWriter, plot_dashboard, read_metrics, set_aside_later_metrics
from rpegjax.train.records import write_atomically
from rpegjax.train.resume import KEEP_WEIGHTS, check_steps, restore_newest, settings_changed
from rpegjax.train.samples import (
    Sample,
    SampleLog,
    console_lines,
    evaluation_samples,
    training_samples,
)

GANTT_STEPS = 3  # steps shown by gantt.png: the last ones, past compilation (trace.json has them all)


def _fingerprint(tree: Any, mesh: Mesh | None = None) -> float:
    """A cheap checksum of weights: a resumed run must start from the same initial (reference) weights.

    The sum of |w| in float64, from the shards each process holds (each shard counted once, whichever
    device holds its first replica), summed over processes: no array is gathered, and the value hardly
    depends on the mesh or the number of processes (only through float64 rounding). With `mesh` the sum runs
    over the processes of its devices alone (a collective of those: the training processes of a run over
    process groups), else over every process."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):  # a host array: every process holds it whole; process 0 counts it
            total += float(np.abs(np.asarray(leaf, np.float64)).sum()) if jax.process_index() == 0 else 0.0
            continue
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                total += float(np.abs(np.asarray(shard.data, np.float64)).sum())
    return distributed.sum_over_processes(total, mesh)


def reward_limits(train: TrainSection) -> ResourceLimits:
    return ResourceLimits(memory_mb=train.reward_memory_mb, cpu_s=train.reward_cpu_s)


def episode_sampling(sampling: SamplingConfig, tokenizer, environment) -> SamplingConfig:
    """`sampling` for an episode's model turns: they stop at the tool call's closing tag."""
    return sampling.replace(stop_sequences=(tuple(tokenizer.encode(environment.call_end)),))


def episode_runner(parts: Components, sampling: SamplingConfig,
                   sampler: Sampler | None = None) -> EpisodeRunner | None:
    """The multi-turn driver of the run's tool environment decoding with `sampling` on `sampler` (default: the
    run's; its turns stop at the tool call's closing tag, one token or several); None for a run without an
    environment."""
    if parts.environment is None:
        return None
    cfg, tokenizer, env = parts.cfg, parts.tokenizer, parts.environment
    sampling = episode_sampling(sampling, tokenizer, env)
    ends = {*tokenizer.eos_ids, tokenizer.pad_id}

    def decode_turn(ids) -> str:  # tool tags may be special tokens: keep them, drop end-of-sequence and padding
        kept = [int(i) for i in ids if int(i) not in ends]
        known = [i for i in kept if i < tokenizer.vocab_size]  # ids of a vocabulary padded past the tokenizer's
        text = tokenizer.decode(known, skip_special_tokens=False)
        return text if len(known) == len(kept) else text + "\ufffd"

    return EpisodeRunner(
        parts.sampler if sampler is None else sampler, env, sampling,
        EpisodeConfig(max_turns=cfg.rollout.max_turns,
                      token_budget=cfg.rollout.episode_token_budget or cfg.rollout.max_new_tokens),
        render=parts.render_messages, encode=tokenizer.encode, decode=decode_turn)


def run_sampling(cfg: RunConfig) -> SamplingConfig:
    """How the run's rollouts sample (multi-turn episodes add their stop sequences to it)."""
    return SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                          top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p)


def make_programs(parts: Components, rewards: RewardRunner) -> StagePrograms:
    cfg = parts.cfg
    sampling = run_sampling(cfg)
    episodes = episode_runner(parts, sampling)
    return StagePrograms(
        learner=parts.learner,
        sampler=parts.sampler,
        sampling=sampling if episodes is None else episodes.sampling,
        episodes=episodes,
        group_size=cfg.rollout.group_size,
        rewards=rewards,
        decode=parts.decode,
        pad_id=parts.tokenizer.pad_id,
        generation_dtype=generation_cast(parts.model_cfg.param_dtype, parts.model_cfg.dtype, cfg.model.generation_dtype),
        offload_optimizer=parts.graph.execution.optimizer_offload,
    )


@dataclasses.dataclass(kw_only=True)
class _Job:
    """What `Trainer.run` sets up before its first step."""

    role: Role | None
    data: DataIterator
    checkpoints: Checkpointer | None
    rewards: RewardRunner
    programs: StagePrograms
    trace: Trace
    runtime: Runtime
    state: Any
    reference_print: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Start:
    """Where the steps start: the step, the held-out accuracy at step 0, older weights versions for generation."""

    step: int
    accuracy: float
    history: list[tuple[int, Any]]
    carry: dict[str, Any] | None = None  # partial rollouts: the groups in flight at the checkpoint


class Trainer:
    """One run directory: `run()` trains `cfg.train.steps` steps (continuing from the last complete
    checkpoint when `resume`), evaluating held-out accuracy at the start and the end. After each step the side
    jobs run as hooks (`rpegjax.train.hooks`), each at its period."""

    def __init__(self, parts: Components, run_dir: str | pathlib.Path, *, resume: bool = False,
                 is_main_process: bool = True, log: Callable[[str], None] = print):
        self.parts = parts
        self.cfg: RunConfig = parts.cfg
        self.run_dir = pathlib.Path(run_dir)
        self.resume = resume
        self.main = is_main_process
        self.log = log if is_main_process else (lambda _: None)
        # with LoRA, checkpoints keep the older versions generation may still read as their adapters (a copy per
        # step, small), not as generation copies of the whole model
        self.adapters = AdapterVersions(self.cfg.graph.async_bound) if self.cfg.lora.enabled else None

    def run(self) -> dict[str, Any]:
        """Over process groups (`rpegjax.runtime.roles`) a generation process only runs the rollout loop; the
        training processes do everything else, the first of them writing (`writer_process`)."""
        started = time.perf_counter()
        job = self._set_up()
        if job.role == Role.GENERATE:
            return self._generate(job, started)
        try:
            state, start = self._start(job)
            console = Console(self.log, _progress(self.cfg.train.steps - start.step, start.step, enabled=self.main))
            hooks = self._hooks(job, start, console)
            try:
                state = job.runtime.run(state, start_step=start.step, num_steps=self.cfg.train.steps - start.step,
                                        history=start.history, carry=start.carry,
                                        on_step=lambda result, s: run_hooks(hooks, result, s))
            finally:
                console.progress.close()
        finally:
            job.checkpoints.close()
            job.rewards.close()
        end_accuracy = self._finish(job, state, start.accuracy)
        return {"start_accuracy": start.accuracy, "end_accuracy": end_accuracy, "steps": self.cfg.train.steps,
                "wall_seconds": round(time.perf_counter() - started, 2), "run_dir": str(self.run_dir)}

    def _hooks(self, job: _Job, start: _Start, console: Console) -> list[Hook]:
        """The side jobs after each step, in the order they run (a hook sees what the earlier ones recorded)."""
        train = self.cfg.train
        samples = Period(every=train.sample_every, also=frozenset({start.step + 1} if train.sample_every else ()))
        return [
            *([Hook(name="adapter versions", run=self.adapters)] if self.adapters is not None else []),
            Hook(name="step timing", run=StepTimer()),
            Hook(name="samples", run=lambda info: self._sample(info, console), period=samples),
            Hook(name="evaluation", run=lambda info: self._evaluate_during(job, info, console),
                 period=Period(every=train.eval_every, skip=frozenset({train.steps}))),
            Hook(name="non-finite check", run=NonFiniteCheck(train.max_nonfinite_steps, console)),
            metrics_hook(self.metrics),
            reward_errors_hook(lambda: job.runtime.last_reward_error, console),
            progress_hook(console),
            Hook(name="checkpoint", run=lambda info: self._save(job, info, start.accuracy),
                 period=Period(every=train.checkpoint_every, also=frozenset({train.steps}))),
        ]

    # ---- set-up ----------------------------------------------------------------------------------
    def _set_up(self) -> _Job:
        parts, cfg = self.parts, self.cfg
        learner = parts.learner
        groups = process_groups(parts.graph)
        role = None if groups is None else groups.role
        data = DataIterator(parts.train_examples, batch_size=cfg.rollout.prompts_per_step, seed=cfg.data.seed)
        checkpoints = None if role == Role.GENERATE else Checkpointer(
            self.run_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
            processes=None if groups is None else groups.training)
        self._train_mesh = None if groups is None else learner.placement.mesh
        state = None if role == Role.GENERATE else learner.init_state()
        initial = learner.model_params(learner.params)  # with LoRA the frozen base too
        reference_print = _fingerprint(initial)  # a collective of every process, at set-up
        if not np.isfinite(reference_print):  # NaN weights would train to garbage without a word
            where = cfg.model.path or "the built model (warm start?)"
            raise ValueError(f"{where}: the initial weights hold NaN or inf values "
                             f"(in {', '.join(nonfinite_leaves(initial))})")
        rewards = RewardRunner.for_task(parts.task, timeout_s=cfg.train.reward_timeout_s,
                                        workers=cfg.train.reward_workers, limits=reward_limits(cfg.train))
        programs = make_programs(parts, rewards)
        # on the wall clock: the trace files of a run over process groups share one timeline (ts + otherData.origin)
        trace = Trace(parts.graph.name, clock=time.time)
        # processes sharing a mesh must launch device programs in one order: no rollout thread then. Over process
        # groups, constructing it links the groups (a collective of every process, before either runs a stage)
        grpo = cfg.grpo if cfg.algorithm == Algorithm.GRPO else None
        runtime = Runtime(parts.graph, programs, data, prompt_ids=parts.prompt_ids,
                          key=jax.random.key(cfg.train.seed), trace=trace, concurrent_rollout=jax.process_count() == 1,
                          dynamic_sampling=grpo.dynamic_sampling_config() if grpo else None,
                          reward_shaping=grpo.overlong_shaping(cfg.rollout.max_new_tokens) if grpo else None,
                          address=cfg.distributed.address() if groups is not None else ProcessAddress(),
                          partial=run_partial_rollouts(cfg, parts.graph))
        if runtime.links is not None:  # where each process's transfer server listens: the hosts of the run
            self.log("transfer servers: " + ", ".join(f"process {process} at {address}" for process, address
                                                      in enumerate(runtime.links.links.addresses)))
        return _Job(role=role, data=data, checkpoints=checkpoints, rewards=rewards, programs=programs, trace=trace,
                    runtime=runtime, state=state, reference_print=reference_print)

    def _generate(self, job: _Job, started: float) -> dict[str, Any]:
        """A generation process of a run over process groups: the rollout loop, then its own trace file (the
        run's trace.json holds the training processes' stages)."""
        try:  # where the training processes start: step 0, or a resumed run's checkpoint
            step, data_state = job.runtime.links.receive_start()
            job.data.restore(data_state)
            job.runtime.run(None, start_step=step, num_steps=self.cfg.train.steps - step)
        finally:
            job.rewards.close()
        job.trace.to_chrome_json(self.run_dir / f"trace.generation-{jax.process_index()}.json")
        return {"role": job.role.value, "steps": self.cfg.train.steps,
                "wall_seconds": round(time.perf_counter() - started, 2), "run_dir": str(self.run_dir)}

    def _start(self, job: _Job) -> tuple[Any, _Start]:
        """The state to train from (restored with `resume`), the run's files opened, the held-out accuracy at
        step 0 (measured now unless a checkpoint holds it)."""
        state, step, accuracy, history, carry = job.state, 0, None, [], None
        if self.resume:
            state, step, accuracy, history, carry = self._resume(job)
        self._write_config()
        wandb = ({"project": self.cfg.train.wandb_project, "mode": self.cfg.train.wandb_mode.value,
                  "config": json.loads(self.cfg.to_json())} if self.cfg.train.wandb else None)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.main, wandb=wandb,
                                     purge_step=(step + 1 if step else 0) if self.resume else None)
        self.samples = SampleLog(self.run_dir, enabled=self.main)
        if accuracy is None:
            accuracy = self._evaluate(self._evaluation_weights(job.programs, state), 0)
            self.metrics.log(0, {"eval/accuracy": accuracy, **self.parts.warm_start_metrics})
            self.log(f"held-out accuracy at start: {accuracy:.3f} ({len(self.parts.eval_examples)} examples)")
        if self.adapters is not None:
            self.adapters.keep(step, state.params)
        if job.runtime.links is not None:  # the generation processes start where this run does
            job.runtime.links.send_start(step, job.data.state())
        return state, _Start(step=step, accuracy=accuracy, history=history, carry=carry)

    def _write_config(self) -> None:
        """config.json and graph.json: written only once a resumed run has been checked against its
        checkpoint, so that a refused `--resume` leaves the run as it was."""
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(self.run_dir / "config.json", self.cfg.to_json())
            write_atomically(self.run_dir / "graph.json", self.parts.graph.to_json())

    # ---- resume ----------------------------------------------------------------------------------
    def _resume(self, job: _Job) -> tuple[Any, int, float | None, list[tuple[int, Any]], dict[str, Any] | None]:
        """The state, next step, start accuracy, older weights versions and the groups partial rollouts had in
        flight of the last complete checkpoint
        (`rpegjax.train.resume`); from scratch when there is none. Either way the records of the steps trained
        again are set aside."""
        checkpoints, state, step, accuracy, history, carry = job.checkpoints, job.state, 0, None, [], None
        if checkpoints.latest_step() is None:
            self.log(f"no complete checkpoint in {checkpoints.directory}: starting from scratch")
        else:
            state, history, meta = self._restore(job)
            if abs(meta["reference_fingerprint"] - job.reference_print) > 1e-6 * max(1.0, job.reference_print):
                changed = settings_changed(meta.get("config"), self.cfg.to_json(), ignore=KEEP_WEIGHTS)
                raise CheckpointError(f"{self.run_dir}: the checkpoint was trained from other initial weights "
                                      "(model path, warm start or seed changed" + (f": {changed})" if changed else ")"))
            step, accuracy = meta["next_step"], meta["start_accuracy"]
            check_steps(self.run_dir, self.cfg.train.steps, step)
            changed = settings_changed(meta.get("config"), self.cfg.to_json(), ignore=("train.run_dir",))
            if changed:  # allowed (a longer run, another asynchrony bound, ...), but never unannounced
                self.log(f"resuming with settings that differ from the checkpoint's: {changed}")
            job.data.restore(meta["data_state"])
            carry = meta.get("partial_rollouts")  # absent in checkpoints older than partial rollouts
            self.log(f"resumed from step {step} ({checkpoints.directory / str(step)})")
        if self.main:
            for kept in (set_aside_later_metrics(self.run_dir, step), SampleLog(self.run_dir).truncate(step)):
                if kept is not None:
                    self.log(f"records of steps after {step} from the earlier attempt, trained again now: moved to {kept}")
        return state, step, accuracy, history, carry

    def _restore(self, job: _Job) -> tuple[Any, list[tuple[int, Any]], dict[str, Any]]:
        """The newest checkpoint that restores (a damaged newer one is reported and set aside)."""
        state, programs = job.state, job.programs
        # the saved versions' layout: generation copies (over process groups staged on the training devices, as
        # they are kept there), or with LoRA adapters
        copy = programs.sync if job.runtime.links is None else programs.staged_sync
        template = state.params if self.adapters is not None else copy(state)
        arrays, meta = restore_newest(
            job.checkpoints, lambda versions: {"state": state, "history": {str(v): template for v in versions}},
            config_json=self.cfg.to_json(), log=self.log,
            damaged_dir=self.run_dir / "damaged_checkpoints" if self.main else None)
        history = sorted((int(v), p) for v, p in arrays["history"].items())
        if self.adapters is not None:  # back to generation copies, as the weight sync makes them; kept for the next save
            self.adapters.versions.update(dict(history))
            history = [(v, copy(state.replace(params=p))) for v, p in history]
        return arrays["state"], history, meta

    # ---- side jobs ---------------------------------------------------------------------------------
    def _evaluate(self, params: Any, step: int) -> float:
        """Held-out accuracy after `step` steps; its first answers go to the samples."""
        parts = self.parts
        max_new = self.cfg.rollout.max_new_tokens
        accuracy, answers = evaluate_accuracy(
            parts.evaluation_sampler, params, parts.eval_examples, parts.prompt_ids(parts.eval_examples),
            is_correct=parts.task.is_correct, decode=parts.decode, max_new_tokens=max_new,
            episodes=episode_runner(parts, SamplingConfig(max_new_tokens=max_new, greedy=True),
                                    sampler=parts.evaluation_sampler))
        self._record_samples(step, evaluation_samples(step, answers, self.cfg.train.samples_per_step))
        return accuracy

    def _evaluate_during(self, job: _Job, info: StepInfo, console: Console) -> None:
        info.record["eval/accuracy"] = self._evaluate(self._evaluation_weights(job.programs, info.state), info.step)
        with console.paused():
            self.log(f"step {info.step}: held-out accuracy {info.record['eval/accuracy']:.3f}")

    def _sample(self, info: StepInfo, console: Console) -> None:
        """A few completions of the step with their rewards: to the samples and the console."""
        result = info.result
        if result.rewards is None:
            return
        samples = training_samples(info.step, result.completions, result.examples, result.rewards, self.parts.decode,
                                   self.cfg.train.samples_per_step)
        with console.paused():
            self.log(f"step {info.step}: reward {info.record.get('reward', 0):.3f}, samples:")
            self._record_samples(info.step, samples)
            for line in console_lines(samples):
                self.log(line)

    def _record_samples(self, step: int, samples: list[Sample]) -> None:
        self.samples.write(samples)
        self.metrics.log_samples(step, samples)

    def _evaluation_weights(self, programs: StagePrograms, state: Any) -> Any:
        """The actor weights of `state` in the evaluation sampler's layout."""
        if self.parts.eval_sampler is None:
            return programs.sync(state)
        return programs.copy_actor(state, self.parts.eval_sampler.params_sharding)

    def _save(self, job: _Job, info: StepInfo, start_accuracy: float) -> None:
        state, step = info.state, info.step
        if not np.isfinite(_fingerprint(state.params, self._train_mesh)):  # a checkpoint of NaN weights would poison every resume
            bad = ", ".join(nonfinite_leaves(state.params)) or "another process's shards"
            raise TrainingError(f"step {step}: the weights hold NaN or inf (in {bad}); not checkpointed. "
                                f"The last checkpoint ({job.checkpoints.latest_step()}) holds finite weights")
        # the k older weights versions that the next rollouts will still read (with LoRA: their adapters)
        history = {str(v): p for v, p in job.runtime.store.items() if v < step}
        if self.adapters is not None:
            history = {v: self.adapters.versions[int(v)] for v in history}
        meta = {"next_step": step, "data_state": info.result.data_state, "start_accuracy": start_accuracy,
                "partial_rollouts": info.result.carry,
                "history_versions": sorted(int(v) for v in history), "reference_fingerprint": job.reference_print,
                "graph": json.loads(self.parts.graph.to_json()), "config": json.loads(self.cfg.to_json())}
        job.checkpoints.save(step, {"state": state, "history": history}, meta)

    # ---- the end ---------------------------------------------------------------------------------
    def _finish(self, job: _Job, state: Any, start_accuracy: float) -> float:
        """The final evaluation, the run's plots and traces, the exported policy; returns the final accuracy."""
        cfg, parts = self.cfg, self.parts
        end_accuracy = self._evaluate(self._evaluation_weights(job.programs, state), cfg.train.steps)
        self.metrics.log(cfg.train.steps, {"eval/accuracy": end_accuracy})
        self.metrics.close()
        self.log(f"held-out accuracy at end: {end_accuracy:.3f} (start {start_accuracy:.3f})")
        if self.main:
            self._write_outputs(job.trace)
        if cfg.train.export_hf:  # with several processes a collective: every process takes part
            path = export_policy(parts, parts.learner.actor_params(state.params), self.run_dir / "hf")
            self.log(f"final policy as a Hugging Face model: {path}" + (" (LoRA merged)" if cfg.lora.enabled else ""))
            if cfg.lora.enabled:
                path = export_adapter(parts, parts.learner.actor_params(state.params), self.run_dir / "adapter")
                self.log(f"its LoRA adapters as a PEFT adapter directory: {path}")
        return end_accuracy

    def _write_outputs(self, trace: Trace) -> None:
        records = read_metrics(self.run_dir / "metrics.jsonl")
        plot_dashboard(records, self.run_dir / "training.png", title=f"{self.parts.graph.name} ({self.run_dir.name})")
        trace.to_chrome_json(self.run_dir / "trace.json")
        window, first, last = steady_window(trace, GANTT_STEPS)
        if len(window):
            # numbered as metrics.jsonl numbers them: step n is the n-th step completed (trace step n - 1)
            gantt_png(window, self.run_dir / "gantt.png", first_step_number=1,
                      title=f"measured stage timeline of the last {last - first + 1} steps (steps {first + 1}-{last + 1}, "
                            "numbered as in metrics.jsonl); the whole run is in trace.json")


def steady_window(trace: Trace, steps: int) -> tuple[Trace, int, int]:
    """The events of the last `steps` steps of `trace` (the steady state: compilation happens in the first),
    with times from the window's first event; and the first and last step shown (trace numbering)."""
    numbers = sorted({event.step for event in trace.events})
    if not numbers:
        return Trace(trace.name), 0, 0
    chosen = set(numbers[-steps:])
    events = [event for event in trace.events if event.step in chosen]
    origin = min(event.start for event in events)
    shifted = [dataclasses.replace(event, start=event.start - origin, end=event.end - origin) for event in events]
    return Trace.from_events(shifted, name=trace.name or "measured"), min(chosen), max(chosen)


def _progress(total: int, initial: int, *, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total + initial, initial=initial, disable=not enabled, file=sys.stderr, unit="step",
                dynamic_ncols=True)
