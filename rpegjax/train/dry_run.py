"""A dry run before a big launch: compile every program a step of a plan launches, ahead of time, allocate nothing.

The learner and the sampler are built exactly as a run builds them (`rpegjax.runtime.assembly.place_models`,
so with the plan's meshes and execution options) from an abstract model (`nnx.eval_shape`); each program is
then lowered by the object that runs it, through the path that runs it, for abstract inputs
(`jax.ShapeDtypeStruct` with the runtime's shardings): `TrainingPrograms.lower_inference` / `lower_update`,
`WeightSyncPrograms.lower_sync` and `Sampler.lower_programs` (prefill and decode chunk, contiguous or paged KV
cache), at the largest shapes the run reaches. So the dry run compiles the very programs the runtime launches
(`tests/train/test_dry_run.py` checks their fingerprints against a real run's). XLA's `memory_analysis()` gives
each program's bytes per device (arguments + outputs + temporaries − donated aliases); to that the dry run adds
the state that stays on the same devices while the program runs and is not among its arguments (the training
state, the reference weights, the generation copy of the actor), measured from the same abstract arrays' shards.
`compiled_flops` counts the compiled matmul FLOPs per device, every loop iteration of known length included
(XLA's `cost_analysis()` counts a loop body once, and compile-only GPU devices have none).

On a machine without the plan's devices the caller runs on virtual CPU devices (`ensure_devices`): memory
figures are then XLA's CPU-backend ones, which keep float32 copies of bfloat16 matmul operands (so they
overstate a GPU's temporaries).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, CriticMode, Graph, StageKind
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.ppo import PPOConfig
from rpegjax.learners.protocol import Learner
from rpegjax.models.config import ModelConfig
from rpegjax.models.lora import LoRAConfig
from rpegjax.models.precision import generation_cast
from rpegjax.models.transformer import Decoder
from rpegjax.options import AttentionKind, CarryMode
from rpegjax.perf.model.hardware import HardwareSpec
from rpegjax.runtime.assembly import RolloutShape, place_models
from rpegjax.runtime.meshes import device_ids, stage_mesh
from rpegjax.runtime.training_programs import TrainingPrograms
from rpegjax.runtime.weight_sync import WeightSyncPrograms
from rpegjax.sharding.abstract import with_shardings
from rpegjax.train.compile_target import GPU_SPECS, DryRunTarget, compile_devices, compile_only, describe
from rpegjax.train.compiled_flops import CompiledFlops, compiled_flops
from rpegjax.train.plan_document import read_plan_file

GB = 1e9
USABLE_FRACTION = HardwareSpec.usable_memory_fraction  # what the planner's presets leave to the runtime
_REEXEC_FLAG = "RPEGJAX_DRY_RUN_DEVICES"


def ensure_devices(count: int) -> None:
    """Re-executes this process on `count` virtual CPU devices when fewer devices exist (XLA reads the device
    count once, at start-up, so it cannot change in a running process). Call before anything uses JAX."""
    if jax.device_count() >= count or os.environ.get(_REEXEC_FLAG) == str(count):
        return
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                 if not f.startswith("--xla_force_host_platform_device_count")]
                                + [f"--xla_force_host_platform_device_count={count}"])
    env["JAX_PLATFORMS"] = "cpu"
    env[_REEXEC_FLAG] = str(count)
    print(f"dry run: {jax.device_count()} devices here, the plan needs {count}: re-running on {count} virtual CPU "
          f"devices", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramMemory:
    """One compiled program: XLA's figures per device, the state resident beside it, and the prediction."""

    stage: str
    program: str
    mesh: dict[str, int]
    arguments: float
    outputs: float
    temporaries: float
    aliased: float
    resident: float  # other state on the same devices while the program runs (not among its arguments)
    flops: CompiledFlops | None  # compiled matmul FLOPs per device (None: a kernel hides them)
    compile_seconds: float
    predicted: float | None = None  # the performance model's peak for the stage, per device

    @property
    def program_bytes(self) -> float:
        """What the program itself holds at its peak (XLA): arguments + outputs + temporaries − donated aliases."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    @property
    def peak(self) -> float:
        return self.program_bytes + self.resident


@dataclasses.dataclass(frozen=True, kw_only=True)
class DryRunReport:
    programs: tuple[ProgramMemory, ...]
    capacity_bytes: float
    devices: str  # what compiled them
    predicted_step_seconds: float | None = None

    @property
    def over(self) -> list[ProgramMemory]:
        return [p for p in self.programs if p.peak > self.capacity_bytes]

    @property
    def fits(self) -> bool:
        return not self.over

    def refusal(self) -> str | None:
        if self.fits:
            return None
        worst = max(self.over, key=lambda p: p.peak)
        return (f"the plan does not fit: stage {worst.stage!r} ({worst.program}) needs {worst.peak / GB:.1f} GB per "
                f"device of {self.capacity_bytes / GB:.1f} GB ({worst.program_bytes / GB:.1f} GB its program, "
                f"{worst.resident / GB:.1f} GB state resident beside it)"
                + (f"; {len(self.over) - 1} more programs do not fit" if len(self.over) > 1 else ""))

    def table(self) -> str:
        lines = [f"dry run on {self.devices}; GB per device, capacity {self.capacity_bytes / GB:.1f} GB",
                 ("| stage | program | mesh | arguments | outputs | temporaries | aliased | resident | peak | predicted "
                  "| fits | matmul TFLOP/device | compile s |"),
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in self.programs:
            mesh = "x".join(f"{a[0]}{s}" for a, s in p.mesh.items() if s > 1) or "1"
            predicted = "-" if p.predicted is None else f"{p.predicted / GB:.1f}"
            tflops = "n/a" if p.flops is None else p.flops.tera()
            lines.append(f"| {p.stage} | {p.program} | {mesh} | {p.arguments / GB:.2f} | {p.outputs / GB:.2f} "
                         f"| {p.temporaries / GB:.2f} | {p.aliased / GB:.2f} | {p.resident / GB:.2f} | {p.peak / GB:.2f} "
                         f"| {predicted} | {'yes' if p.peak <= self.capacity_bytes else 'NO'} | {tflops} "
                         f"| {p.compile_seconds:.1f} |")
        if self.predicted_step_seconds is not None:
            lines.append(f"predicted step: {self.predicted_step_seconds:.2f} s")
        lines.append("fits: yes" if self.fits else f"refused: {self.refusal()}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ abstract arrays
def shard_bytes(tree: Any) -> float:
    """Bytes one device holds of `tree` (abstract or concrete leaves with NamedShardings; none: whole)."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _memory(compiled) -> dict[str, float]:
    memory = compiled.memory_analysis()
    return {"arguments": float(memory.argument_size_in_bytes), "outputs": float(memory.output_size_in_bytes),
            "temporaries": float(memory.temp_size_in_bytes), "aliased": float(memory.alias_size_in_bytes)}


# -------------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """The step's shapes: `rows` sequences (`group_size` samples per prompt) of `prompt + new` tokens (padded),
    sampler slots and decode chunk."""

    rows: int
    prompt: int
    new: int
    slots: int
    group_size: int
    chunk_steps: int = 16
    multi_turn: bool = False  # episodes: a later turn's context may fill the whole capacity


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoweredProgram:
    """One program a run launches, lowered for abstract inputs by its owner: where it runs and what stays beside it."""

    stage: str  # the execution unit's stage names, joined by '+'
    program: str
    lowered: jax.stages.Lowered
    mesh: Any  # None: the default device
    resident: float  # bytes per device of other state on its devices while it runs (not among its arguments)
    predicted: bool  # whether the performance model's figure for `stage` is this program's peak


class _Residents:
    """The state that stays on devices for the whole step (training state, reference weights, the generation copy of
    the actor), per device, and which devices hold each."""

    def __init__(self):
        self.items: list[tuple[str, frozenset[int], float]] = []

    def add(self, name: str, devices: frozenset[int], size: float) -> None:
        self.items.append((name, devices, size))

    def beside(self, devices: frozenset[int], *held: str) -> float:
        """Bytes of the state on `devices` that a program not holding `held` as arguments has beside it."""
        return sum(size for name, where, size in self.items if name not in held and where & devices)


def lower_step(graph: Graph, learner: Learner, sampler: Sampler, training: TrainingPrograms,
               weights: WeightSyncPrograms, batch: Batch, sampling: SamplingConfig,
               devices: Sequence[jax.Device] | None = None) -> list[LoweredProgram]:
    """Every program one step of `graph` launches, lowered by its owner for abstract inputs at `batch`'s shapes, in
    the order the runtime runs them: each training execution unit (inference, update), weight sync, then generation
    (`Sampler.lower_programs`). Advantages (a few element-wise ops on [rows] arrays) are left out. `devices`: those
    the graph's placements index (default `jax.devices()`)."""
    state = jax.eval_shape(learner.init_state)
    if learner.state_shardings is not None:
        state = with_shardings(state, learner.state_shardings)
    frozen = learner.frozen  # with LoRA the base weights, an argument of every training program
    train_devices = device_ids(learner.placement.mesh)
    residents = _Residents()
    residents.add("train", train_devices, shard_bytes(state.replace(opt_state=())) + (0.0 if frozen is None else shard_bytes(frozen)))
    residents.add("optimizer", train_devices, shard_bytes(state.opt_state))
    copy = weights.abstract_copy()
    residents.add("generation", device_ids(sampler.mesh), shard_bytes(copy))
    if graph.execution.partial_carry == CarryMode.PAGES:  # kept sequences' pages stay through the training step
        residents.add("kept pages", device_ids(sampler.mesh), shard_bytes(sampler.abstract_state()))
    params_bytes = shard_bytes(learner.model_params(learner.params))  # the whole weights the state's programs read
    tokens = batch.prompt + batch.new
    inference_kinds = [kind for stage in graph.stages for kind in stage.kinds if kind in INFERENCE_KINDS]
    for stage in graph.stages_of_kind(StageKind.REF_LOGPROB)[:1]:
        if frozen is None:  # with LoRA the reference is the frozen base, counted in the training state
            mesh = stage_mesh(graph, stage.name, devices)
            reference = training.placed_reference(mesh)
            residents.add("reference", device_ids(mesh), shard_bytes(reference))
    lowered: list[LoweredProgram] = []
    for unit in graph.execution_units():
        stages = [graph.stage(name) for name in unit]
        kinds = tuple(dict.fromkeys(kind for stage in stages for kind in stage.kinds))
        name, first = "+".join(unit), stages[0]
        if first.host or StageKind.GENERATE in kinds:
            continue
        if set(kinds) <= INFERENCE_KINDS:
            mesh = stage_mesh(graph, first.name, devices)
            rows = batch.rows // first.microbatches  # a piece of the rollout, or a micro-batch of the step's rows
            program = training.lower_inference(kinds, state, training.abstract_rollout(rows, tokens), mesh)
            own_layout = training.has_own_layout(mesh)
            held = ("reference",) if StageKind.REF_LOGPROB in kinds else ()
            # on the training layout a unit that reads the policy (every kind but the reference's; fused with the
            # reference too) takes the training state's weights as arguments; on its own layout a fresh copy
            reads_policy = any(kind is not StageKind.REF_LOGPROB for kind in kinds)
            resident = residents.beside(device_ids(mesh), *held) - (params_bytes if not own_layout and reads_policy else 0.0)
            lowered.append(LoweredProgram(stage=name, program="inference", lowered=program, mesh=mesh,
                                          resident=resident, predicted=True))
        elif set(kinds) & UPDATE_KINDS:
            program = training.lower_update(kinds, state, training.abstract_batch(batch.rows, tokens, inference_kinds))
            lowered.append(LoweredProgram(stage=name, program="update", lowered=program, mesh=learner.placement.mesh,
                                          resident=residents.beside(train_devices, "train", "optimizer"), predicted=True))
        elif StageKind.WEIGHT_SYNC in kinds:
            program = weights.lower_sync(state)
            if program is not None:  # none when the copy is a plain transfer to other devices
                lowered.append(LoweredProgram(stage=name, program="weight sync", lowered=program,
                                              mesh=learner.placement.mesh,
                                              resident=residents.beside(train_devices, "train", "optimizer"),
                                              predicted=False))
    generate = graph.stages_of_kind(StageKind.GENERATE)[0]
    # an offloaded optimiser state is in host memory while the sampler runs (`rpegjax.runtime.offload`)
    offloaded = ("optimizer",) if graph.execution.optimizer_offload else ()
    beside = residents.beside(device_ids(sampler.mesh), "generation", "kept pages", *offloaded)
    generation_programs = dict(sampler.lower_programs(copy, sampling, group_size=batch.group_size,
                                                      long_contexts=batch.multi_turn))
    if graph.execution.partial_rollouts:  # a carried sample is a request of its own: prompt + prefix re-prefilled,
        # up to the capacity, admitted in runs of one-sample requests (its prefill and start programs)
        carried = sampler.lower_programs(copy, sampling, group_size=1, long_contexts=True)
        generation_programs.update({f"{name} (carried sequences)": program for name, program in carried.items()
                                    if name != "decode"})
        if graph.execution.partial_carry == CarryMode.PAGES:  # kept sequences: recomputed only after a resume
            generation_programs["retag (kept sequences)"] = sampler.lower_kept_retag()
    for program, generation in generation_programs.items():
        label = (f"{program} ({sampler.num_slots} slots x {sampler.capacity} tokens)" if program == "decode"
                 else program)
        lowered.append(LoweredProgram(stage=generate.name, program=label, lowered=generation, mesh=sampler.mesh,
                                      resident=beside, predicted=True))  # the stage's peak covers each
    return lowered


def lower_plan(graph: Graph, model_cfg: ModelConfig, algorithm: GRPOConfig | PPOConfig, batch: Batch, *,
               lora: LoRAConfig | None = None, sampling: SamplingConfig | None = None,
               generation_dtype: str | None = None, devices: Sequence[jax.Device] | None = None,
               log: Callable[[str], None] = lambda line: None) -> list[LoweredProgram]:
    """Every program a step of `graph` launches (`lower_step`), for a model of `model_cfg` built abstractly and
    placed as a run places it. `model_cfg` carries the model's shape and precision (the graph's execution options
    are applied to it as a run applies them). With `lora` the policy carries adapters: the training state holds
    only them, the frozen base stays beside it (and is the reference), generation reads the merged weights.
    `sampling`: the run's (default: plain sampling of `batch.new` tokens); `generation_dtype`: the run's
    `model.generation_dtype` (None: the precision policy's). `devices`: to compile for (default: this process's,
    `compile_target.compile_devices`)."""
    devices = compile_devices(DryRunTarget.CPU, graph.num_devices) if devices is None else list(devices)
    if len(devices) < graph.num_devices:
        raise ValueError(f"dry run: the plan needs {graph.num_devices} devices, {len(devices)} given")
    if graph.execution.attention is AttentionKind.CUDNN and jax.default_backend() != "gpu":
        # cuDNN's kernel compiles only on a CUDA GPU with cuDNN; the blockwise kernel has the same O(T x block) memory
        graph = dataclasses.replace(graph, execution=dataclasses.replace(graph.execution, attention=AttentionKind.BLOCKWISE))
        log(f"dry run: attention 'cudnn' compiles only on a CUDA GPU with cuDNN; compiling with 'blockwise' for "
            f"{devices[0].device_kind} (same memory class, O(tokens x block))")
    ppo = isinstance(algorithm, PPOConfig)
    shared = ppo and algorithm.critic == CriticMode.SHARED
    abstract_model = nnx.eval_shape(lambda: Decoder(model_cfg.replace(value_head=shared), rngs=nnx.Rngs(0), lora=lora))
    critic = None
    if ppo and algorithm.critic == CriticMode.SEPARATE:
        critic = nnx.eval_shape(lambda: Decoder(model_cfg.replace(value_head=True), rngs=nnx.Rngs(1)))
    rollout = RolloutShape(num_slots=batch.slots, max_prompt_len=batch.prompt, max_new_tokens=batch.new,
                           chunk_steps=batch.chunk_steps)
    learner, sampler = place_models(graph, abstract_model, algorithm, rollout, critic=critic, devices=devices)
    cast = generation_cast(model_cfg.param_dtype, model_cfg.dtype, generation_dtype)
    training = TrainingPrograms(learner, offload_optimizer=_offload_checked(graph, devices, log))
    return lower_step(graph, learner, sampler, training, WeightSyncPrograms(learner, sampler, cast),
                      batch, SamplingConfig(max_new_tokens=batch.new) if sampling is None else sampling, devices)


def _offload_checked(graph: Graph, devices: Sequence[jax.Device], log: Callable[[str], None]) -> bool:
    """Whether the dry run builds the optimiser offload (`rpegjax.runtime.offload`, which checks that the devices
    have pinned host memory). Compile-only CUDA devices have no memory kinds: JAX drops a sharding's
    `memory_kind` on them and XLA's GPU compiler places in-program host transfers in device memory, so no host
    placement compiles for them. None needs to: the offload's moves are `device_put`s between programs, and every
    compiled program takes the optimiser state on the devices; what the plan's offload changes is the state
    resident beside generation, which `lower_step` leaves out either way. The report says what was not checked."""
    if not graph.execution.optimizer_offload or not compile_only(devices):
        return graph.execution.optimizer_offload
    log(f"dry run: optimiser offload: {describe(devices)} expose no memory kinds, so the moves of the optimiser "
        f"state to and from pinned host memory (device_puts between programs, not compiled) are not checked "
        f"here; every program below takes it on the devices, and generation is measured without it (a CUDA "
        f"GPU's runtime has 'pinned_host' memory; the CPU target checks the moves' memory kind)")
    return False


def compile_programs(programs: Sequence[LoweredProgram], *, capacity_bytes: float,
                     predicted: dict[str, float] | None = None, predicted_step_seconds: float | None = None,
                     log: Callable[[str], None] = lambda line: None) -> DryRunReport:
    """Compiles `programs` and measures them against `capacity_bytes` per device; `predicted` maps stage names
    to the performance model's per-device peak bytes (shown beside each stage's peak program)."""
    predicted = predicted or {}
    measured = []
    for item in programs:
        started = time.perf_counter()
        compiled = item.lowered.compile()
        seconds = time.perf_counter() - started
        memory = ProgramMemory(stage=item.stage, program=item.program, mesh={} if item.mesh is None else dict(item.mesh.shape),
                               resident=item.resident, flops=compiled_flops(compiled), compile_seconds=seconds,
                               predicted=_unit_prediction(predicted, item.stage) if item.predicted else None,
                               **_memory(compiled))
        measured.append(memory)
        log(f"compiled {item.stage} ({item.program}) in {seconds:.1f} s: {memory.peak / GB:.2f} GB per device")
    used = {device.id: device for item in programs if item.mesh is not None for device in item.mesh.devices.flat}
    devices = describe([used[i] for i in sorted(used)] or jax.devices()[:1])
    return DryRunReport(programs=tuple(measured), capacity_bytes=capacity_bytes, devices=devices,
                        predicted_step_seconds=predicted_step_seconds)


def _unit_prediction(predicted: dict[str, float], unit: str) -> float | None:
    """The performance model's peak for an execution unit: its stage's, or the largest of its fused stages' (one
    program runs them all); None when a stage has no prediction."""
    stages = [predicted.get(stage) for stage in unit.split("+")]
    return None if any(value is None for value in stages) else max(stages)


def dry_run(graph: Graph, model_cfg: ModelConfig, algorithm: GRPOConfig | PPOConfig, batch: Batch, *,
            capacity_bytes: float, predicted: dict[str, float] | None = None,
            predicted_step_seconds: float | None = None, lora: LoRAConfig | None = None,
            sampling: SamplingConfig | None = None, generation_dtype: str | None = None,
            devices: Sequence[jax.Device] | None = None, log: Callable[[str], None] = lambda line: None) -> DryRunReport:
    """Lowers (`lower_plan`) and compiles (`compile_programs`) every program a step of the plan launches, for
    `devices` (`compile_target.compile_devices`; default this process's); nothing is allocated."""
    programs = lower_plan(graph, model_cfg, algorithm, batch, lora=lora, sampling=sampling,
                          generation_dtype=generation_dtype, devices=devices, log=log)
    return compile_programs(programs, capacity_bytes=capacity_bytes, predicted=predicted,
                            predicted_step_seconds=predicted_step_seconds, log=log)


# ------------------------------------------------------------------------------------------- a run's config
def plan_devices(cfg) -> int:
    """Devices the run's graph needs: the plan's count, else the devices here (a run without a plan uses them all)."""
    if cfg.graph.plan is None:
        return jax.device_count()
    return read_plan_file(cfg.graph.plan).graph.num_devices


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What a training job's config runs, as the dry run needs it: its graph, model, algorithm and step shapes,
    and the prediction stored beside a plan document's best plan."""

    graph: Graph
    model_cfg: ModelConfig
    algorithm: GRPOConfig | PPOConfig
    batch: Batch
    sampling: SamplingConfig
    lora: LoRAConfig | None
    generation_dtype: str | None
    prediction: dict[str, Any] | None
    devices: tuple[jax.Device, ...]  # to compile for

    def lower(self, log: Callable[[str], None] = lambda line: None) -> list[LoweredProgram]:
        return lower_plan(self.graph, self.model_cfg, self.algorithm, self.batch, lora=self.lora,
                          sampling=self.sampling, generation_dtype=self.generation_dtype, devices=self.devices, log=log)


def run_plan(cfg, target: DryRunTarget = DryRunTarget.CPU) -> RunPlan:
    """The graph (its plan, if any), model shape and precision, step batch, prompt width (rendered as the run
    renders prompts) and sampler slots of a job's config, as `rpegjax.train.build` makes them, without loading
    weights or allocating, on the devices of `target` (`compile_target`; a CUDA target needs a plan: it gives the
    device count). A plan document made for another model or step shapes is refused
    (`rpegjax.train.plan_document`)."""
    from rpegjax.models.tokenizer import builtin_tokenizer, load_tokenizer
    from rpegjax.train import build as job
    from rpegjax.train.trainer import episode_sampling, run_sampling

    tokenizer = builtin_tokenizer() if cfg.model.path is None else load_tokenizer(cfg.model.path)
    _, train_examples, eval_examples = job.make_task_and_examples(cfg)
    examples = [*train_examples, *eval_examples]
    environment = job.run_environment(cfg)
    prompt_ids = job.encode_prompts(examples, job.run_template(cfg), tokenizer, environment)
    prompt = job.check_prompt_lengths(examples, prompt_ids, cfg.rollout.max_prompt_len)
    if target is not DryRunTarget.CPU and cfg.graph.plan is None:
        raise ValueError(f"dry run target {target.value!r}: give the run's plan (--plan plan.json), which says on how "
                         f"many GPUs it runs")
    devices = tuple(compile_devices(target, plan_devices(cfg) if cfg.graph.plan else jax.device_count()))
    graph = job.build_graph(cfg, num_devices=len(devices))
    model_cfg = job.run_model_config(cfg, tokenizer, value_head=False).replace(**graph.execution.model_fields())
    job.check_plan_shapes(cfg, model_cfg, prompt)
    rollout = cfg.rollout
    rows = rollout.prompts_per_step * rollout.group_size
    slots = job.run_slots(cfg, graph, len(eval_examples), devices)
    algorithm, lora = job.run_algorithm(cfg), cfg.lora.config()
    prediction = None if cfg.graph.plan is None else read_plan_file(cfg.graph.plan).prediction
    sampling = run_sampling(cfg) if environment is None else episode_sampling(run_sampling(cfg), tokenizer, environment)
    return RunPlan(graph=graph, model_cfg=model_cfg, algorithm=algorithm, lora=lora, sampling=sampling,
                   batch=Batch(rows=rows, prompt=prompt, new=rollout.max_new_tokens, slots=slots,
                               group_size=rollout.group_size, chunk_steps=rollout.chunk_steps,
                               multi_turn=environment is not None),
                   generation_dtype=cfg.model.generation_dtype, prediction=prediction, devices=devices)


def dry_run_config(cfg, *, capacity_bytes: float | None, log: Callable[[str], None],
                   target: DryRunTarget = DryRunTarget.CPU) -> DryRunReport:
    """The dry run of a training job's config (`train_grpo.py ... --dry-run`, `run_plan`) on `target`'s devices.
    `capacity_bytes`: per device; None reads the devices' own limit (a CUDA target: 90% of its GPU's memory, as
    the planner's hardware presets leave 10% to the runtime)."""
    plan = run_plan(cfg, target)
    if capacity_bytes is None and target is not DryRunTarget.CPU:
        capacity_bytes = USABLE_FRACTION * GPU_SPECS[target].memory_bytes
    if capacity_bytes is None:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"dry run: {jax.devices()[0].device_kind} devices report no memory limit; give the "
                             f"capacity per device (--memory-gb)")
        capacity_bytes = float(stats["bytes_limit"])
    prediction = plan.prediction
    predicted = None if prediction is None else {
        s["name"]: s["peak_memory_bytes"] for s in prediction["stages"] if s.get("peak_memory_bytes") is not None}
    return compile_programs(plan.lower(log), capacity_bytes=capacity_bytes, predicted=predicted, log=log,
                            predicted_step_seconds=None if prediction is None else prediction.get("step_seconds"))


__all__ = ["Batch", "DryRunReport", "LoweredProgram", "ProgramMemory", "RunPlan", "compile_programs", "dry_run",
           "dry_run_config", "ensure_devices", "lower_plan", "lower_step", "plan_devices", "run_plan", "shard_bytes"]
