"""Runs a built training job through the RPEG runtime: held-out evaluation at the start, every N steps and
at the end, progress bar, metrics, sample completions, checkpoints (every N steps, keep last K; resumable),
plots, traces and the final policy as a Hugging Face directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax import distributed
from rpegjax.data.iterator import DataIterator
from rpegjax.envs.rollout import EpisodeConfig, EpisodeRunner
from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph.ir import Algorithm
from rpegjax.graph.trace import Trace, gantt_png
from rpegjax.models.precision import generation_cast
from rpegjax.rewards.runner import ResourceLimits, RewardRunner
from rpegjax.runtime.controller import Runtime, StepResult
from rpegjax.runtime.programs import StagePrograms
from rpegjax.runtime.roles import Role, process_groups
from rpegjax.train.build import Components
from rpegjax.train.checkpoint import Checkpointer, CheckpointError
from rpegjax.train.config import RunConfig, TrainSection
from rpegjax.train.evaluation import evaluate_accuracy
from rpegjax.train.export import export_adapter, export_policy
from rpegjax.train.health import NonFiniteGuard, TrainingError, nonfinite_leaves
from rpegjax.train.metrics import MetricsWriter, plot_dashboard, read_metrics
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
    if mesh is not None:
        return _sum_over_processes(total, mesh)
    if jax.process_count() > 1:  # as bytes: without jax_enable_x64 a float64 would travel as float32
        gathered = distributed.gather_to_all(np.array([total], np.float64).view(np.uint8), tiled=False)
        total = float(np.ascontiguousarray(gathered).view(np.float64).sum())
    return total


def _sum_over_processes(value: float, mesh: Mesh) -> float:
    """The sum of each process's `value` over the processes that own devices of `mesh`, computed by one program of
    theirs (as bytes: without jax_enable_x64 a float64 would travel as float32)."""
    devices = list(mesh.devices.flat)
    first: dict[int, jax.Device] = {}
    for device in devices:
        first.setdefault(device.process_index, device)
    mine = np.frombuffer(np.float64(value).tobytes(), np.uint8)
    flat = Mesh(np.array(devices, dtype=object), ("devices",))

    def block(index) -> np.ndarray:  # row i lives on devices[i]: the value once per process, zeros elsewhere
        device = devices[index[0].start or 0]  # a one-device mesh asks for the whole array: slice(None)
        return (mine if first[device.process_index] is device else np.zeros_like(mine))[None]

    rows = jax.make_array_from_callback((len(devices), 8), NamedSharding(flat, PartitionSpec("devices")), block,
                                        dtype=np.uint8)
    gathered = jax.jit(lambda x: x, out_shardings=NamedSharding(flat, PartitionSpec()))(rows)
    return float(np.ascontiguousarray(np.asarray(gathered.addressable_shards[0].data)).view(np.float64).sum())


def reward_limits(train: TrainSection) -> ResourceLimits:
    return ResourceLimits(memory_mb=train.reward_memory_mb, cpu_s=train.reward_cpu_s)


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename: a full disk leaves the old file whole."""
    staging = path.with_name(f".{path.name}.tmp")
    try:
        staging.write_text(text)
        staging.replace(path)
    finally:
        staging.unlink(missing_ok=True)


def episode_runner(parts: Components, sampling: SamplingConfig,
                   sampler: Sampler | None = None) -> EpisodeRunner | None:
    """The multi-turn driver of the run's tool environment decoding with `sampling` on `sampler` (default: the
    run's; its turns stop at the tool call's closing tag, one token or several); None for a run without an
    environment."""
    if parts.environment is None:
        return None
    cfg, tokenizer, env = parts.cfg, parts.tokenizer, parts.environment
    sampling = sampling.replace(stop_sequences=(tuple(tokenizer.encode(env.call_end)),))
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


def make_programs(parts: Components, rewards: RewardRunner) -> StagePrograms:
    cfg = parts.cfg
    sampling = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                              top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p)
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
    )


class Trainer:
    """One run directory: `run()` trains `cfg.train.steps` steps (continuing from the last complete
    checkpoint when `resume`), evaluating held-out accuracy at the start and the end."""

    def __init__(self, parts: Components, run_dir: str | pathlib.Path, *, resume: bool = False,
                 is_main_process: bool = True, log: Callable[[str], None] = print):
        self.parts = parts
        self.cfg: RunConfig = parts.cfg
        self.run_dir = pathlib.Path(run_dir)
        self.resume = resume
        self.main = is_main_process
        self.log = log if is_main_process else (lambda _: None)

    def _write_config(self) -> None:
        """config.json and graph.json: written only once a resumed run has been checked against its
        checkpoint, so that a refused `--resume` leaves the run as it was."""
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _write_atomically(self.run_dir / "config.json", self.cfg.to_json())
            _write_atomically(self.run_dir / "graph.json", self.parts.graph.to_json())

    def _evaluate(self, params: Any, step: int) -> float:
        """Held-out accuracy after `step` steps; its first answers go to the samples."""
        parts = self.parts
        max_new = self.cfg.rollout.max_new_tokens
        accuracy, answers = evaluate_accuracy(
            parts.evaluation_sampler, params, parts.eval_examples, parts.prompt_ids(parts.eval_examples),
            is_correct=parts.task.is_correct, decode=parts.decode, max_new_tokens=max_new,
            episodes=episode_runner(parts, SamplingConfig(max_new_tokens=max_new, greedy=True),
                                    sampler=parts.evaluation_sampler))
        self._record_samples(step, evaluation_samples(step, answers, self.cfg.train.samples_per_step), console=False)
        return accuracy

    def _record_samples(self, step: int, samples: list[Sample], *, console: bool) -> None:
        self.samples.write(samples)
        self.metrics.log_samples(step, samples)
        if console:
            for line in console_lines(samples):
                self.log(line)

    def _evaluation_weights(self, programs: StagePrograms, state: Any) -> Any:
        """The actor weights of `state` in the evaluation sampler's layout."""
        if self.parts.eval_sampler is None:
            return programs.sync(state)
        return programs.copy_actor(state, self.parts.eval_sampler.params_sharding)

    def run(self) -> dict[str, Any]:
        """Over process groups (`rpegjax.runtime.roles`) a generation process only runs the rollout loop; the
        training processes do everything else, the first of them writing (`writer_process`)."""
        started = time.perf_counter()
        parts, cfg = self.parts, self.cfg
        learner = parts.learner
        groups = process_groups(parts.graph)
        role = None if groups is None else groups.role
        if groups is not None:  # refused in every process alike, before anything runs
            if cfg.train.export_hf:
                raise ValueError("train.export_hf: a run over separate generation and training processes does not "
                                 "write its Hugging Face directory yet; run with --train.export_hf=false and export "
                                 "a checkpoint with scripts/export_hf.py RUN_DIR")
            if self.resume:
                raise ValueError("--resume: a run over separate generation and training processes cannot resume yet "
                                 "(its checkpoints restore in a colocated run: --rollout-devices=0)")
        data = DataIterator(parts.train_examples, batch_size=cfg.rollout.prompts_per_step, seed=cfg.data.seed)
        checkpoints = None if role == Role.GENERATE else Checkpointer(
            self.run_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
            processes=None if groups is None else groups.training)
        train_mesh = None if groups is None else learner.placement.mesh
        self._train_mesh = train_mesh
        state = None if role == Role.GENERATE else learner.init_state()
        # with LoRA, checkpoints keep the older versions generation may still read as their adapters (a copy per
        # step, small), not as generation copies of the whole model
        self._adapter_versions: dict[int, Any] | None = {} if cfg.lora.enabled else None
        initial = learner.model_params(learner.params)  # with LoRA the frozen base too
        reference_print = _fingerprint(initial)  # a collective of every process, at set-up
        if not np.isfinite(reference_print):  # NaN weights would train to garbage without a word
            where = cfg.model.path or "the built model (warm start?)"
            raise ValueError(f"{where}: the initial weights hold NaN or inf values "
                             f"(in {', '.join(nonfinite_leaves(initial))})")
        guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
        start_step, history, start_accuracy = 0, [], None
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
                          reward_shaping=grpo.overlong_shaping(cfg.rollout.max_new_tokens) if grpo else None)
        if role == Role.GENERATE:
            try:
                runtime.run(None, start_step=0, num_steps=cfg.train.steps)
            finally:
                rewards.close()
            # the run's trace.json holds the training processes' stages; each generation process adds its own
            trace.to_chrome_json(self.run_dir / f"trace.generation-{jax.process_index()}.json")
            return {"role": role.value, "steps": cfg.train.steps,
                    "wall_seconds": round(time.perf_counter() - started, 2), "run_dir": str(self.run_dir)}
        if self.resume and checkpoints.latest_step() is not None:
            state, history, meta = self._restore(checkpoints, state, programs)
            if abs(meta["reference_fingerprint"] - reference_print) > 1e-6 * max(1.0, reference_print):
                raise CheckpointError(f"{self.run_dir}: the checkpoint was trained from other initial weights "
                                      "(model path, warm start or seed changed)")
            start_step, start_accuracy = meta["next_step"], meta["start_accuracy"]
            data.restore(meta["data_state"])
            self._truncate_metrics(start_step)
            self.log(f"resumed from step {start_step} ({checkpoints.directory / str(start_step)})")
        elif self.resume:
            self.log(f"no complete checkpoint in {checkpoints.directory}: starting from scratch")
        self._write_config()
        wandb = ({"project": cfg.train.wandb_project, "mode": cfg.train.wandb_mode.value,
                  "config": json.loads(cfg.to_json())} if cfg.train.wandb else None)
        metrics = self.metrics = MetricsWriter(self.run_dir, enabled=self.main, wandb=wandb)
        self.samples = SampleLog(self.run_dir, enabled=self.main)
        if start_step:
            self.samples.truncate(start_step)
        if start_accuracy is None:
            start_accuracy = self._evaluate(self._evaluation_weights(programs, state), 0)
            metrics.log(0, {"eval/accuracy": start_accuracy, **parts.warm_start_metrics})
            self.log(f"held-out accuracy at start: {start_accuracy:.3f} ({len(parts.eval_examples)} examples)")
        remaining = cfg.train.steps - start_step
        progress = _progress(remaining, start_step, enabled=self.main)
        step_started = time.perf_counter()

        if self._adapter_versions is not None:
            self._adapter_versions[start_step] = jax.tree.map(jnp.copy, state.params)

        def on_step(result: StepResult, state: Any) -> None:
            nonlocal step_started
            if self._adapter_versions is not None:
                self._adapter_versions[result.step + 1] = jax.tree.map(jnp.copy, state.params)
                for old in [v for v in self._adapter_versions if v < result.step + 1 - cfg.graph.async_bound]:
                    del self._adapter_versions[old]
            now = time.perf_counter()
            record = dict(result.metrics)
            record["seconds"] = now - step_started
            record["tokens_per_second"] = result.metrics["tokens"] / max(now - step_started, 1e-9)
            step_started = now
            step = result.step + 1  # steps completed
            if cfg.train.sample_every and (step % cfg.train.sample_every == 0 or step == start_step + 1) \
                    and result.rewards is not None:
                with _progress_paused(progress):
                    self.log(f"step {step}: reward {record.get('reward', 0):.3f}, samples:")
                    self._record_samples(step, training_samples(step, result.completions, result.examples,
                                                                result.rewards, parts.decode,
                                                                cfg.train.samples_per_step), console=True)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                record["eval/accuracy"] = self._evaluate(self._evaluation_weights(programs, state), step)
                with _progress_paused(progress):
                    self.log(f"step {step}: held-out accuracy {record['eval/accuracy']:.3f}")
            bad = guard.observe(step, record)
            if bad:
                self.log(f"step {step}: non-finite {', '.join(bad)} ({guard.count} such steps; "
                         f"train.max_nonfinite_steps={cfg.train.max_nonfinite_steps})")
            record["nonfinite_steps"] = guard.count
            metrics.log(step, record)
            if runtime.last_reward_error and record.get("reward/errors", 0) > 0:
                self.log(f"step {step}: reward function failed on {int(record['reward/errors'])} completions "
                         f"(scored 0): {runtime.last_reward_error}")
            progress.update(1)
            progress.set_postfix(reward=f"{record.get('reward', 0):.3f}", acc=f"{record.get('accuracy', 0):.3f}",
                                 tok_s=f"{record['tokens_per_second']:.0f}", stale=int(record["staleness"]))
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                self._save(checkpoints, step, state, runtime, result, start_accuracy, reference_print)

        try:
            state = runtime.run(state, start_step=start_step, num_steps=remaining, history=history, on_step=on_step)
        finally:
            progress.close()
            checkpoints.close()
            rewards.close()
        end_accuracy = self._evaluate(self._evaluation_weights(programs, state), cfg.train.steps)
        metrics.log(cfg.train.steps, {"eval/accuracy": end_accuracy})
        metrics.close()
        self.log(f"held-out accuracy at end: {end_accuracy:.3f} (start {start_accuracy:.3f})")
        if self.main:
            self._write_outputs(trace)
        if cfg.train.export_hf:  # with several processes a collective: every process takes part
            path = export_policy(parts, learner.actor_params(state.params), self.run_dir / "hf")
            self.log(f"final policy as a Hugging Face model: {path}" + (" (LoRA merged)" if cfg.lora.enabled else ""))
            if cfg.lora.enabled:
                path = export_adapter(parts, learner.actor_params(state.params), self.run_dir / "adapter")
                self.log(f"its LoRA adapters as a PEFT adapter directory: {path}")
        return {"start_accuracy": start_accuracy, "end_accuracy": end_accuracy, "steps": cfg.train.steps,
                "wall_seconds": round(time.perf_counter() - started, 2), "run_dir": str(self.run_dir)}

    # ---- checkpoints -----------------------------------------------------------------------------
    def _save(self, checkpoints: Checkpointer, step: int, state, runtime: Runtime, result: StepResult,
              start_accuracy: float, reference_print: float) -> None:
        if not np.isfinite(_fingerprint(state.params, self._train_mesh)):  # a checkpoint of NaN weights would poison every resume
            bad = ", ".join(nonfinite_leaves(state.params)) or "another process's shards"
            raise TrainingError(f"step {step}: the weights hold NaN or inf (in {bad}); not checkpointed. "
                                f"The last checkpoint ({checkpoints.latest_step()}) holds finite weights")
        # the k older weights versions that the next rollouts will still read (with LoRA: their adapters)
        history = {str(v): p for v, p in runtime.store.items() if v < step}
        if self._adapter_versions is not None:
            history = {v: self._adapter_versions[int(v)] for v in history}
        meta = {"next_step": step, "data_state": result.data_state, "start_accuracy": start_accuracy,
                "history_versions": sorted(int(v) for v in history), "reference_fingerprint": reference_print,
                "graph": json.loads(self.parts.graph.to_json()), "config": json.loads(self.cfg.to_json())}
        checkpoints.save(step, {"state": state, "history": history}, meta)

    def _restore(self, checkpoints: Checkpointer, state, programs: StagePrograms):
        """The newest checkpoint that restores; a damaged newer one is reported and passed over (it is
        overwritten when training reaches its step again)."""
        lora = self._adapter_versions is not None
        template = state.params if lora else programs.sync(state)  # LoRA: the versions are saved as adapters
        failures = []
        for step in reversed(checkpoints.all_steps()):
            try:
                versions = checkpoints.metadata(step)["history_versions"]
                like = {"state": state, "history": {str(v): template for v in versions}}
                arrays, meta = checkpoints.restore(like, step)
            except (CheckpointError, KeyError, TypeError) as error:
                failures.append(step)
                self.log(f"checkpoint {checkpoints.directory / str(step)} is damaged and cannot be restored "
                         f"({str(error)[:300]}); trying the previous one")
                continue
            if failures:
                self.log(f"falling back to checkpoint {step}: damaged newer checkpoint(s) {failures} are skipped")
                if self.main:  # out of the way of the new saves of those steps, kept for inspection
                    for bad in failures:
                        moved = checkpoints.set_aside(bad, self.run_dir / "damaged_checkpoints" / f"{bad}-{time.time():.0f}")
                        self.log(f"moved damaged checkpoint {bad} to {moved}")
            history = sorted((int(v), p) for v, p in arrays["history"].items())
            if lora:  # back to generation copies, as the weight sync makes them; the adapters kept for the next save
                self._adapter_versions.update(dict(history))
                history = [(v, programs.sync(state.replace(params=p))) for v, p in history]
            return arrays["state"], history, meta
        raise CheckpointError(f"{checkpoints.directory}: no checkpoint can be restored (damaged: {failures})")

    def _truncate_metrics(self, next_step: int) -> None:
        """Drops records of steps after the checkpoint: they are trained again. Records are numbered by steps
        completed, so the checkpoint's own step keeps its training record (it has `staleness`), not the
        final evaluation of a run that ended there."""
        path = self.run_dir / "metrics.jsonl"
        if not self.main or not path.exists():
            return
        kept = [r for r in read_metrics(path) if r["step"] < next_step or (r["step"] == 0 and next_step == 0)
                or (r["step"] == 0 and "eval/accuracy" in r) or (r["step"] == next_step and "staleness" in r)]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    # ---- outputs ---------------------------------------------------------------------------------
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


@contextlib.contextmanager
def _progress_paused(progress):
    """Clears the progress bar while lines are printed, then draws it again below them."""
    progress.clear()
    try:
        yield
    finally:
        progress.refresh()


def _progress(total: int, initial: int, *, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total + initial, initial=initial, disable=not enabled, file=sys.stderr, unit="step",
                dynamic_ncols=True)
