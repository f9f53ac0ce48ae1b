"""A dry run before a big launch: compile every stage program of a plan ahead of time, allocate nothing.

The learner and the sampler are built exactly as a run builds them (`rpegjax.runtime.assembly.place_models`,
so with the plan's meshes and execution options) from an abstract model (`nnx.eval_shape`); every program is
lowered with abstract inputs (`jax.ShapeDtypeStruct` with the runtime's shardings) and compiled. XLA's
`memory_analysis()` gives each program's bytes per device (arguments + outputs + temporaries − donated
aliases); to that the dry run adds the state that stays on the same devices while the program runs and is not
among its arguments (the training state, the reference weights, the generation copy of the actor), measured
from the same abstract arrays' shards. `cost_analysis()` gives the compiled FLOPs per device.

Programs: the update (one program: epochs x mini-batches x micro-batches); each inference stage (reference /
old log-probs, values) on its own layout; generation's decode program at the largest attention window
(the whole capacity). Not compiled: the prefill programs (smaller than the decode program's KV cache for
prompts shorter than the capacity) and the paged sampler's programs. On a machine without the plan's devices the
caller runs on virtual CPU devices (`ensure_devices`): memory figures are then XLA's CPU-backend ones, which
keep float32 copies of bfloat16 matmul operands (so they overstate a GPU's temporaries).
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
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax.generate.sampling import SamplingConfig, sampling_arrays
from rpegjax.graph.ir import INFERENCE_KINDS, UPDATE_KINDS, Graph, StageKind
from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.ppo import PPOConfig
from rpegjax.models.config import ModelConfig
from rpegjax.models.lora import LoRAConfig
from rpegjax.models.transformer import Decoder
from rpegjax.runtime.assembly import RolloutShape, place_models
from rpegjax.runtime.meshes import (
    device_ids,
    same_layout,
    stage_mesh,
)
from rpegjax.runtime.programs import StageLayout
from rpegjax.sharding.rules import param_shardings

GB = 1e9
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
    flops: float  # compiled, per device
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
                  "| fits | TFLOP/device | compile s |"),
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in self.programs:
            mesh = "x".join(f"{a[0]}{s}" for a, s in p.mesh.items() if s > 1) or "1"
            predicted = "-" if p.predicted is None else f"{p.predicted / GB:.1f}"
            lines.append(f"| {p.stage} | {p.program} | {mesh} | {p.arguments / GB:.2f} | {p.outputs / GB:.2f} "
                         f"| {p.temporaries / GB:.2f} | {p.aliased / GB:.2f} | {p.resident / GB:.2f} | {p.peak / GB:.2f} "
                         f"| {predicted} | {'yes' if p.peak <= self.capacity_bytes else 'NO'} | {p.flops / 1e12:.2f} "
                         f"| {p.compile_seconds:.1f} |")
        if self.predicted_step_seconds is not None:
            lines.append(f"predicted step: {self.predicted_step_seconds:.2f} s")
        lines.append("fits: yes" if self.fits else f"refused: {self.refusal()}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ abstract arrays
def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


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


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, Sequence):  # older JAX: one dict per computation
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _compile(lower: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    compiled = lower().compile()
    return compiled, time.perf_counter() - started


# -------------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """The step's shapes: `rows` sequences of `prompt + new` tokens (padded), sampler slots and decode chunk."""

    rows: int
    prompt: int
    new: int
    slots: int
    chunk_steps: int = 16


def dry_run(graph: Graph, model_cfg: ModelConfig, algorithm: GRPOConfig | PPOConfig, batch: Batch, *,
            capacity_bytes: float, predicted: dict[str, float] | None = None,
            predicted_step_seconds: float | None = None, lora: LoRAConfig | None = None,
            log: Callable[[str], None] = lambda line: None) -> DryRunReport:
    """Compiles the plan's stage programs (see the module doc) and measures them; nothing is allocated.

    `model_cfg` carries the model's shape and precision (the graph's execution options are applied to it as a
    run applies them); `predicted` maps stage names to the performance model's per-device peak bytes. With
    `lora` the policy carries adapters: the training state holds only them, the frozen base stays beside it (and
    is the reference), generation reads the merged weights."""
    if jax.device_count() < graph.num_devices:
        raise ValueError(f"dry run: the plan needs {graph.num_devices} devices, {jax.device_count()} exist "
                         f"(call ensure_devices first)")
    if graph.execution.attention == "cudnn" and jax.default_backend() != "gpu":
        # cuDNN's kernel compiles only for CUDA; the blockwise kernel has the same O(T x block) memory class
        graph = dataclasses.replace(graph, execution=dataclasses.replace(graph.execution, attention="blockwise"))
        log(f"dry run: attention 'cudnn' compiles only on a CUDA GPU; compiling with 'blockwise' on "
            f"{jax.default_backend()} (same memory class, O(tokens x block))")
    ppo = isinstance(algorithm, PPOConfig)
    abstract_model = nnx.eval_shape(lambda: Decoder(model_cfg.replace(value_head=ppo and algorithm.critic == "shared"),
                                                    rngs=nnx.Rngs(0), lora=lora))
    critic = None
    if ppo and algorithm.critic == "separate":
        critic = nnx.eval_shape(lambda: Decoder(model_cfg.replace(value_head=True), rngs=nnx.Rngs(1)))
    rollout = RolloutShape(num_slots=batch.slots, max_prompt_len=batch.prompt, max_new_tokens=batch.new,
                           chunk_steps=batch.chunk_steps)
    learner, sampler = place_models(graph, abstract_model, algorithm, rollout, critic=critic)
    predicted = predicted or {}
    devices = f"{jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()})"

    # persistent state, per device, and which devices hold it
    update_stage = graph.stages_of_kind(StageKind.ACTOR_UPDATE)[0]
    train_devices = device_ids(stage_mesh(graph, update_stage.name))
    state = _abstract(jax.eval_shape(learner.init_state), learner.state_shardings) if learner.state_shardings else \
        jax.eval_shape(learner.init_state)
    frozen = learner.frozen  # with LoRA the base weights, an argument of every program (None otherwise)
    train_bytes = shard_bytes(state) + (0.0 if frozen is None else shard_bytes(frozen))
    params_bytes = shard_bytes(learner.params) + (0.0 if frozen is None else shard_bytes(frozen))
    generate_stage = graph.stages_of_kind(StageKind.GENERATE)[0]
    generate_mesh = stage_mesh(graph, generate_stage.name)
    generation_params = learner.params if not ppo else learner.actor_params(learner.params)
    if frozen is not None:  # the sampler decodes merged weights: the base model's layout
        generation_params = nnx.eval_shape(lambda: nnx.state(Decoder(model_cfg, rngs=nnx.Rngs(0))))
    if sampler.params_sharding is not None:
        generation_params = _abstract(generation_params, sampler.params_sharding)
    generation_bytes = shard_bytes(generation_params)
    residents: list[tuple[str, frozenset[int], float]] = [
        ("train", train_devices, train_bytes), ("generation", device_ids(generate_mesh), generation_bytes)]
    reference = graph.stages_of_kind(StageKind.REF_LOGPROB)
    reference_layout = None
    if reference:
        ref_mesh = stage_mesh(graph, reference[0].name)
        if not same_layout(learner.placement.mesh, dict(ref_mesh.shape)):
            reference_layout = StageLayout(ref_mesh)
        if frozen is None:
            ref_params = _placed_params(learner, reference_layout)
            if ppo:
                ref_params = ref_params["actor"]
            residents.append(("reference", device_ids(ref_mesh), shard_bytes(ref_params)))
        # with LoRA the reference is the frozen base, counted in the training state above (no copy)

    def resident_beside(devices: frozenset[int], *held: str) -> float:
        return sum(size for name, where, size in residents if name not in held and where & devices)

    tokens = batch.prompt + batch.new
    programs: list[ProgramMemory] = []

    def record(stage: str, program: str, mesh, compiled, seconds: float, resident: float) -> None:
        item = ProgramMemory(stage=stage, program=program, mesh={} if mesh is None else dict(mesh.shape),
                             resident=resident, flops=_flops(compiled), compile_seconds=seconds,
                             predicted=predicted.get(stage), **_memory(compiled))
        programs.append(item)
        log(f"compiled {stage} ({program}) in {seconds:.1f} s: {item.peak / GB:.2f} GB per device")

    # the update
    update_inputs = _update_batch(learner, algorithm, batch.rows, tokens)
    # the runtime's own program: state, frozen base (None without LoRA), batch
    compiled, seconds = _compile(lambda: learner._update.lower(state, frozen, update_inputs))
    update_names = [s.name for s in graph.stages if set(s.kinds) & UPDATE_KINDS]
    record("+".join(dict.fromkeys(update_names)), "update", learner.placement.mesh, compiled, seconds,
           resident_beside(train_devices, "train"))

    # inference stages, each on its own layout
    for stage in graph.stages:
        kinds = set(stage.kinds) & INFERENCE_KINDS
        if not kinds or stage.host:
            continue
        mesh = stage_mesh(graph, stage.name)
        layout = None if same_layout(learner.placement.mesh, dict(mesh.shape)) else StageLayout(mesh)
        rows = learner.placement.rows if layout is None else layout.rows
        sharding = None if layout is None else layout.activations
        piece = batch.rows // stage.microbatches
        token_in = jax.ShapeDtypeStruct((piece, tokens), jnp.int32, sharding=rows)
        mask_in = jax.ShapeDtypeStruct((piece, tokens), jnp.bool_, sharding=rows)
        fn, params = _inference_function(learner, kinds, layout, ppo=ppo)
        program = jax.jit(lambda p, t, m, fn=fn, sharding=sharding: fn(p, t, m, sharding))
        compiled, seconds = _compile(lambda program=program, params=params, token_in=token_in, mask_in=mask_in:
                                     program.lower(params, token_in, mask_in))
        held = ("reference",) if StageKind.REF_LOGPROB in kinds else ()
        # a stage on the training layout reads the training state's weights; re-sharded, it reads a fresh copy
        resident = resident_beside(device_ids(mesh), *held) - (params_bytes if layout is None and not held else 0.0)
        record(stage.name, "inference", mesh, compiled, seconds, resident)

    # generation: the decode program at the whole capacity, and the prefill of a full bucket of prompts
    if sampler.paged is None:
        programs.extend(_generation_programs(sampler, generation_params, generate_stage.name, generate_mesh,
                                             resident_beside(device_ids(generate_mesh), "generation"), predicted, log))
    else:
        log("generation: paged KV cache; its programs are not compiled by the dry run (memory from the pool size)")
    return DryRunReport(programs=tuple(programs), capacity_bytes=capacity_bytes, devices=devices,
                        predicted_step_seconds=predicted_step_seconds)


def _placed_params(learner, layout: StageLayout | None) -> Any:
    """The learner's whole parameters (PPO: {"actor", "critic"}; with LoRA the adapters beside the frozen base) on
    `layout` (None: the learner's own)."""
    params = learner.model_params(learner.params)
    if layout is None:
        return params
    if isinstance(params, dict) and not isinstance(params, nnx.State):
        return {name: _abstract(value, param_shardings(value, layout.mesh, layout.rules)) for name, value in params.items()}
    return _abstract(params, param_shardings(params, layout.mesh, layout.rules))


def _inference_function(learner, kinds: set[StageKind], layout: StageLayout | None, *, ppo: bool):
    """The learner's pure function for an inference stage of `kinds` and the parameters it reads (as the
    runtime's `StagePrograms` picks them: values and joint log-probs + values read PPO's whole state)."""
    if StageKind.REF_LOGPROB in kinds and learner.frozen is not None:  # with LoRA the reference is the frozen base
        base = learner.frozen["actor"] if ppo else learner.frozen
        if layout is not None:
            base = _abstract(base, param_shardings(base, layout.mesh, layout.rules))
        return learner.logprobs_fn, base
    params = _placed_params(learner, layout)
    if not ppo:
        return learner.logprobs_fn, params
    if StageKind.CRITIC_VALUE in kinds:
        both = StageKind.OLD_LOGPROB in kinds
        return (learner.logprobs_and_values_fn if both else learner.values_fn), params
    return learner.logprobs_fn, params["actor"]


def _update_batch(learner, algorithm, rows: int, tokens: int) -> TrainBatch:
    """The update's inputs as abstract arrays on the learner's row sharding (the fields the config reads)."""
    algorithm.layout.check_batch(rows)
    sharding = learner.rows
    floats = lambda: jax.ShapeDtypeStruct((rows, tokens), jnp.float32, sharding=sharding)
    fields = set(algorithm.required_fields()) | {"old_logprobs"} if getattr(algorithm, "decoupled", False) else \
        set(algorithm.required_fields())
    fields.add("behaviour_logprobs")  # the sampler always records them; the update's mismatch metrics read them
    values = {name: (jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=_rows_1d(sharding))
                     if name == "advantages" and isinstance(algorithm, GRPOConfig) else floats())
              for name in ("behaviour_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "returns")
              if name in fields}
    return TrainBatch(tokens=jax.ShapeDtypeStruct((rows, tokens), jnp.int32, sharding=sharding),
                      token_mask=jax.ShapeDtypeStruct((rows, tokens), jnp.bool_, sharding=sharding),
                      response_mask=jax.ShapeDtypeStruct((rows, tokens), jnp.bool_, sharding=sharding), **values)


def _rows_1d(sharding):
    if sharding is None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0] if len(sharding.spec) else None))


def _generation_programs(sampler, params, stage: str, mesh, resident: float, predicted: dict[str, float],
                         log: Callable[[str], None]) -> list[ProgramMemory]:
    state = jax.eval_shape(sampler._empty)
    if sampler.mesh is not None:
        state = _abstract(state, sampler._build_state.lower().compile().output_shardings)
    replicated = None if sampler.mesh is None else NamedSharding(sampler.mesh, PartitionSpec())
    arrays = sampling_arrays(SamplingConfig(max_new_tokens=sampler.max_new_tokens, ignore_eos=True),
                             vocab_size=sampler.cfg.vocab_size, default_eos_id=sampler.cfg.eos_token_id)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    out = []
    started = time.perf_counter()
    compiled = sampler._decode.lower(sampler.capacity, params, state, key, arrays, np.int32(sampler.chunk_steps)).compile()
    seconds = time.perf_counter() - started
    memory = _memory(compiled)
    item = ProgramMemory(stage=stage, program=f"decode ({sampler.num_slots} slots x {sampler.capacity} tokens)",
                         mesh={} if mesh is None else dict(mesh.shape), resident=resident, flops=_flops(compiled),
                         compile_seconds=seconds, predicted=predicted.get(stage), **memory)
    log(f"compiled {stage} (decode) in {seconds:.1f} s: {item.peak / GB:.2f} GB per device")
    out.append(item)
    return out




# ------------------------------------------------------------------------------------------- a run's config
def plan_devices(cfg) -> int:
    """Devices the run's graph needs: the plan's count, else the devices here (a run without a plan uses them all)."""
    if cfg.graph.plan is None:
        return jax.device_count()
    from rpegjax.train.build import load_plan

    return load_plan(cfg, num_devices=1 << 30).num_devices


def planned_prediction(cfg) -> dict[str, Any] | None:
    """The prediction stored beside the best plan in a `plan.py --json` document (None for a bare graph)."""
    import json
    import pathlib

    if cfg.graph.plan is None:
        return None
    document = json.loads(pathlib.Path(cfg.graph.plan).read_text())
    if isinstance(document, dict) and "plans" in document:
        return document["plans"][0].get("prediction")
    return None


def dry_run_config(cfg, *, capacity_bytes: float | None, log: Callable[[str], None]) -> DryRunReport:
    """The dry run of a training job's config (`train_grpo.py ... --dry-run`): the run's graph (its plan, if
    any), model shape and precision, step batch and sampler slots, as `rpegjax.train.build` would make them,
    without loading weights or allocating. `capacity_bytes`: per device; None reads the devices' own limit."""
    from rpegjax.generate.sampler import usable_slots
    from rpegjax.graph.ir import Algorithm
    from rpegjax.models.tokenizer import builtin_tokenizer, load_tokenizer
    from rpegjax.runtime.meshes import placed_meshes
    from rpegjax.train import build as job

    tokenizer = builtin_tokenizer() if cfg.model.path is None else load_tokenizer(cfg.model.path)
    template = job.PromptTemplate(template=cfg.data.prompt_template)
    _, train_examples, eval_examples = job._task_and_examples(cfg)
    examples = [*train_examples, *eval_examples]
    prompt = job.check_prompt_lengths(examples, [tokenizer.encode(template.render(e, tokenizer)) for e in examples],
                                      cfg.rollout.max_prompt_len)
    if cfg.model.path is None:
        model_cfg = job._model_config(cfg, tokenizer, value_head=False)
    else:
        import json
        import pathlib

        hf = json.loads((pathlib.Path(cfg.model.path) / "config.json").read_text())
        model_cfg = ModelConfig.from_hf_dict(hf, source=f"{cfg.model.path}/config.json").replace(
            param_dtype=cfg.model.param_dtype, dtype=cfg.model.dtype)
    graph = job.build_graph(cfg, num_devices=jax.device_count())
    rollout = cfg.rollout
    rows = rollout.prompts_per_step * rollout.group_size
    slots = min(rollout.num_slots, max(rows, len(eval_examples)))
    slots = usable_slots(slots, rollout.group_size, placed_meshes(graph)[1])
    if capacity_bytes is None:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"dry run: {jax.devices()[0].device_kind} devices report no memory limit; give the "
                             f"capacity per device (--memory-gb)")
        capacity_bytes = float(stats["bytes_limit"])
    prediction = planned_prediction(cfg)
    predicted = None if prediction is None else {
        s["name"]: s["peak_memory_bytes"] for s in prediction["stages"] if s.get("peak_memory_bytes") is not None}
    algorithm = cfg.grpo if cfg.algorithm == Algorithm.GRPO else cfg.ppo
    return dry_run(graph, model_cfg, algorithm, Batch(rows=rows, prompt=prompt, new=rollout.max_new_tokens,
                                                      slots=slots, chunk_steps=rollout.chunk_steps),
                   capacity_bytes=capacity_bytes, predicted=predicted, lora=cfg.lora.config() if cfg.lora.enabled else None,
                   predicted_step_seconds=None if prediction is None else prediction.get("step_seconds"), log=log)


__all__ = ["Batch", "DryRunReport", "ProgramMemory", "dry_run", "dry_run_config", "ensure_devices", "plan_devices",
           "shard_bytes"]
