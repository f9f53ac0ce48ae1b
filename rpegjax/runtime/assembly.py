"""One set-up path from a graph and a model to what the runtime executes: the learner on the mesh of the graph's
update stage, the sampler on the mesh of its generate stage, both executing as the graph's `Execution` says
(attention kernel, remat, layer scan, KV-cache layout, update and inference micro-batches, optimiser
sharding). The job (`rpegjax.train.build`, and so the runtime
tests), the step benchmarks (`bench_grpo_step`, `bench_perfmodel`) build through here; unit tests of a
learner or the sampler alone build those directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from flax import nnx

from rpegjax.generate.paged_cache import CacheConfig
from rpegjax.generate.sampler import Sampler
from rpegjax.graph.ir import Execution, Graph
from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.ppo import PPOConfig, PPOLearner
from rpegjax.learners.protocol import Learner
from rpegjax.models.lora import LoRAGeneration
from rpegjax.models.transformer import Decoder
from rpegjax.runtime.meshes import placed_meshes
from rpegjax.sharding.rules import ShardingRules


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutShape:
    """The sampler's static sizes: concurrent sequences, prompt and response budgets, decode steps per chunk."""

    num_slots: int
    max_prompt_len: int
    max_new_tokens: int
    chunk_steps: int


def _with_packing(algorithm: GRPOConfig | PPOConfig, execution: Execution) -> GRPOConfig | PPOConfig:
    """The algorithm packing as the plan says (`Execution.packing`); an algorithm that asks for other packing is
    refused, not overridden."""
    planned = (execution.packing, execution.max_tokens_per_micro_batch)
    asked = (algorithm.packing, algorithm.max_tokens_per_micro_batch)
    if asked != (False, None) and asked != planned:
        raise ValueError(f"the plan runs packing={planned[0]} with max_tokens_per_micro_batch={planned[1]}, the "
                         f"algorithm asks for packing={asked[0]}, max_tokens_per_micro_batch={asked[1]}: plan again, "
                         "or leave them unset to run the plan's")
    return dataclasses.replace(algorithm, packing=planned[0], max_tokens_per_micro_batch=planned[1])


def place_models(graph: Graph, model: Decoder, algorithm: GRPOConfig | PPOConfig, rollout: RolloutShape, *,
                 critic: Decoder | None = None,
                 lora_generation: LoRAGeneration = LoRAGeneration.MERGED, seed: int = 0,
                 devices: Sequence[jax.Device] | None = None) -> tuple[Learner, Sampler]:
    """The learner of `algorithm` (PPO: with `critic`, or the actor's value head when shared) and the sampler of
    `model`'s architecture, each on the mesh the graph places its stage on, executing as `graph.execution` says.
    The models' precision must be the plan's: it changes the parameters, so it is refused, never converted.
    A model with LoRA adapters trains only them; its sampler decodes the base model with the adapters merged into
    the weight-sync copy, or the adapted model (`lora_generation`). `seed`: the learner's update draws its LoRA
    dropout masks from it. `devices`: those the graph's placements index (default `jax.devices()`; the dry run's
    compile-only devices of another platform)."""
    execution = graph.execution
    model, critic = apply_execution(model, execution), None if critic is None else apply_execution(critic, execution)
    algorithm = dataclasses.replace(algorithm, num_microbatches=execution.update_microbatches)
    if execution.inference_rows is not None:
        if algorithm.inference_rows not in (None, execution.inference_rows):
            raise ValueError(f"the plan runs inference stages in micro-batches of {execution.inference_rows} rows, the "
                             f"algorithm asks for {algorithm.inference_rows} (inference_rows): plan again, or leave "
                             f"it unset to run the plan's")
        algorithm = dataclasses.replace(algorithm, inference_rows=execution.inference_rows)
    algorithm = _with_packing(algorithm, execution)
    train_mesh, rollout_mesh = placed_meshes(graph, devices)
    rules = None if train_mesh is None else ShardingRules.fsdp_tp(sequence_parallel=execution.sequence_parallel)
    if isinstance(algorithm, GRPOConfig):
        if critic is not None:
            raise ValueError("place_models: GRPO trains no critic; do not pass one")
        learner: Learner = GRPOLearner(algorithm, model, mesh=train_mesh, rules=rules, seed=seed,
                                       optimizer_sharding=execution.optimizer_sharding)
    elif isinstance(algorithm, PPOConfig):
        learner = PPOLearner(algorithm, model, critic, mesh=train_mesh, rules=rules, seed=seed,
                             optimizer_sharding=execution.optimizer_sharding)
    else:
        raise TypeError(f"place_models: algorithm must be a GRPOConfig or PPOConfig, got {type(algorithm).__name__}")
    merged = model.lora is not None and LoRAGeneration(lora_generation) == LoRAGeneration.MERGED
    generated = model.without_lora() if merged else model
    sampler = Sampler(model.cfg, nnx.graphdef(generated), lora=generated.lora, num_slots=rollout.num_slots,
                      max_prompt_len=rollout.max_prompt_len,
                      max_new_tokens=rollout.max_new_tokens, chunk_steps=rollout.chunk_steps, mesh=rollout_mesh,
                      cache=cache_config(execution), record_routing=algorithm.router_replay)
    return learner, sampler


def cache_config(execution: Execution) -> CacheConfig:
    """The sampler's KV cache of `execution`: its layout, page size, pool (tokens per slot replica, whole
    pages; None: every slot at capacity) and decode attention (the Pallas kernel: refused off GPU)."""
    pool = execution.kv_pool_tokens
    pages = None if pool is None else -(-pool // execution.page_size)
    return CacheConfig(layout=execution.kv_cache, page_size=execution.page_size, pages_per_replica=pages,
                       decode_attention=execution.decode_attention)


def sampler_on(sampler: Sampler, mesh, num_slots: int) -> Sampler:
    """A sampler like `sampler` (model, budgets, cache layout) on `mesh` with `num_slots` slots: e.g. held-out
    evaluation in the training processes of a run over process groups, which cannot launch programs on the
    generation devices."""
    return Sampler(sampler.cfg, sampler.graphdef, lora=sampler.lora, num_slots=num_slots,
                   max_prompt_len=sampler.max_prompt_len, max_new_tokens=sampler.max_new_tokens,
                   chunk_steps=sampler.chunk_steps, window_step=sampler.window_step, mesh=mesh, cache=sampler.cache)


def apply_execution(model: Decoder, execution: Execution) -> Decoder:
    """`model` under the execution's kernel, remat and scan choices; its precision must already match."""
    cfg = model.cfg
    if (cfg.param_dtype, cfg.dtype) != (execution.param_dtype, execution.dtype):
        raise ValueError(f"the plan executes with {execution.param_dtype} weights and {execution.dtype} compute, the "
                         f"model has {cfg.param_dtype} / {cfg.dtype}: set model.param_dtype / model.dtype to the "
                         f"plan's, or plan again with the model's")
    wanted = execution.model_fields()
    if all(getattr(cfg, name) == value for name, value in wanted.items()):
        return model
    return model.with_execution(**wanted)
