"""A training run: build tokenizer, task, model, learner, sampler, rewards and the RPEG from a
`RunConfig`, warm-start, then execute the graph with the runtime and write the run directory
(config.json, metrics.jsonl, TensorBoard events, plots, trace, checkpoints)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from rpegjax import distributed
from rpegjax.data.example import DatasetError, Example
from rpegjax.data.files import load_examples
from rpegjax.data.prompts import PromptTemplate
from rpegjax.data.rows import RowSchema
from rpegjax.envs.catalog import EnvironmentName, make_environment
from rpegjax.generate.sampler import Sampler, usable_slots
from rpegjax.graph import builders, transforms
from rpegjax.graph.ir import Algorithm, Execution, Graph, StageKind
from rpegjax.models.config import Architecture, ModelConfig
from rpegjax.models.hf import load_pretrained, read_config
from rpegjax.models.precision import Precision
from rpegjax.models.tokenizer import builtin_tokenizer, load_tokenizer
from rpegjax.models.transformer import Decoder
from rpegjax.options import MODEL_EXECUTION_FIELDS, CarryMode
from rpegjax.perf.planner.executable import packed_rows_problems
from rpegjax.rewards.custom import RewardedTask, load_rewards
from rpegjax.rewards.dataset_task import MathDatasetTask
from rpegjax.rewards.math import check_gold_answer
from rpegjax.rewards.tasks import make_task
from rpegjax.runtime.assembly import RolloutShape, place_models, sampler_on
from rpegjax.runtime.meshes import placed_meshes
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig
from rpegjax.runtime.roles import process_groups
from rpegjax.sharding.mesh import resolve_axis_sizes
from rpegjax.train.config import GraphSection, RolloutSection, RunConfig
from rpegjax.train.plan_document import PlanWorkload, read_plan_file
from rpegjax.train.warmstart import warm_start, worked_targets


@dataclasses.dataclass
class Components:
    """Everything a run builds from its config (before any training)."""

    cfg: RunConfig
    tokenizer: Any
    task: Any
    train_examples: list[Example]
    eval_examples: list[Example]
    model_cfg: ModelConfig
    learner: Any
    sampler: Sampler
    graph: Graph
    template: PromptTemplate
    warm_start_metrics: dict[str, float]
    max_prompt_len: int  # rollout.max_prompt_len, or the longest prompt of the data when that is unset
    environment: Any = None  # rollout.env's (`rpegjax.envs`), None for single-turn rollouts
    # held-out evaluation's sampler when it is not `sampler`: over process groups, one on the training devices
    eval_sampler: Sampler | None = None

    @property
    def evaluation_sampler(self) -> Sampler:
        return self.sampler if self.eval_sampler is None else self.eval_sampler

    def prompt_ids(self, examples) -> list[list[int]]:
        return [self.encode_prompt(e) for e in examples]

    def encode_prompt(self, example: Example) -> list[int]:
        """The prompt of `example`: through the environment's opening messages when the run has one."""
        return prompt_ids(example, self.environment, self.template, self.tokenizer)

    def render_messages(self, messages) -> list[int]:
        """An episode's opening messages (one user turn) as prompt ids, through the run's prompt template."""
        return render_opening(messages, self.template, self.tokenizer)

    def decode(self, ids) -> str:
        # checkpoints often pad the vocabulary past the tokenizer's: such samples decode to U+FFFD
        size = self.tokenizer.vocab_size
        known = [int(i) for i in ids if int(i) < size]
        text = self.tokenizer.decode(known)
        return text if len(known) == len(ids) else text + "\ufffd"


def render_opening(messages, template: PromptTemplate, tokenizer) -> list[int]:
    """An environment's opening messages, which must be one user turn, rendered like a prompt of the run."""
    if [m.get("role") for m in messages] != ["user"]:
        raise ValueError(f"the environment opens with {[m.get('role') for m in messages]}; a run renders one user "
                         "turn through its prompt template")
    example = Example(id="episode", prompt=messages[0]["content"], answer="", task="episode")
    return tokenizer.encode(template.render(example, tokenizer))


def prompt_ids(example: Example, environment, template: PromptTemplate, tokenizer) -> list[int]:
    """The prompt of `example` as the policy sees it: through the environment's opening messages when the run
    has one (`rpegjax.envs`), else the prompt template."""
    if environment is None:
        return tokenizer.encode(template.render(example, tokenizer))
    return render_opening(environment.reset(example), template, tokenizer)


def _task_and_examples(cfg: RunConfig):
    data = cfg.data
    if data.dataset is None:
        task = make_task(data.task, data.difficulty)
        return task, task.train_examples(data.train_size, data.seed), task.eval_examples(data.eval_size, data.seed + 1)
    schema = RowSchema(dataset_format=data.dataset_format, prompt_field=data.prompt_field,
                       answer_field=data.answer_field)
    train = load_examples(data.dataset, schema=schema, check_answer=check_gold_answer)
    held_out = load_examples(data.eval_dataset, schema=schema, check_answer=check_gold_answer) if data.eval_dataset else None
    task = MathDatasetTask(examples=train, held_out=held_out)
    for split, name in ((True, "held-out"), (False, "training")):
        if task.split_size(held_out=split) == 0:  # an empty evaluation would report accuracy 0, measured on nothing
            raise DatasetError(f"{data.dataset}: the {name} split is empty ({len(train)} rows, of which a fraction "
                               f"{task.eval_fraction} is held out by hash); give more rows or --eval-dataset")
    # a file is used whole unless train_size / eval_size ask for less
    return (task, task.train_examples(min(data.train_size, task.split_size(held_out=False)), data.seed),
            task.eval_examples(min(data.eval_size, task.split_size(held_out=True)), data.seed + 1))


def make_task_and_examples(cfg: RunConfig):
    """The run's task (trained on the user's reward functions when `data.reward` names some) and its
    training and held-out examples."""
    task, train, held_out = _task_and_examples(cfg)
    if cfg.data.reward:
        task = RewardedTask(task, load_rewards(cfg.data.reward))
    return task, train, held_out


def _numerics(model_cfg: ModelConfig) -> dict:
    """The model config without its execution fields (they change neither parameters nor results)."""
    return {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in MODEL_EXECUTION_FIELDS}


def check_prompt_lengths(examples: list[Example], prompt_ids: list[list[int]], limit: int | None) -> int:
    """The prompt length the sampler needs: `limit`, or the longest prompt when None. A prompt longer than
    `limit` raises DatasetError naming its row (file:line), so that it is found at load, not mid-run."""
    lengths = [len(ids) for ids in prompt_ids]
    longest = max(lengths, default=0)
    if limit is None:
        return max(longest, 1)
    too_long = [index for index, length in enumerate(lengths) if length > limit]
    if too_long:
        first = too_long[0]
        raise DatasetError(f"{examples[first].where()}: the prompt has {lengths[first]} tokens, more than "
                           f"rollout.max_prompt_len={limit} ({len(too_long)} of {len(lengths)} prompts are; the "
                           f"longest has {longest}): raise --max-prompt-len, or leave it unset to size it from the data")
    return limit


def run_model_config(cfg: RunConfig, tokenizer, *, value_head: bool) -> ModelConfig:
    """The config of the model a run trains, without loading a weight: the checkpoint's (`model.path`) or the
    built-in model's, with the run's precision and execution options."""
    if cfg.model.path is None:
        return _model_config(cfg, tokenizer, value_head=value_head)
    precision = run_precision(cfg)
    model_cfg = read_config(cfg.model.path).replace(param_dtype=precision.param_dtype, dtype=precision.dtype,
                                                    value_head=value_head, **cfg.model.execution())
    return model_cfg if model_cfg.eos_token_id is not None else model_cfg.replace(eos_token_id=tokenizer.eos_id)


def run_template(cfg: RunConfig) -> PromptTemplate:
    """How the run renders prompts: its template, system prompt and chat-template choice."""
    return PromptTemplate(template=cfg.data.prompt_template, system=cfg.data.system_prompt,
                          chat_template=cfg.data.chat_template)


def encode_prompts(examples: list[Example], template: PromptTemplate, tokenizer, environment) -> list[list[int]]:
    """The prompt ids the run's sampler receives: each example's `prompt_ids`. A conversational prompt (a list of
    messages) cannot open a multi-turn episode: DatasetError naming its row."""
    if environment is not None:
        conversational = next((e for e in examples if e.messages), None)
        if conversational is not None:  # the environment opens with one user turn of the prompt text
            raise DatasetError(f"{conversational.where()}: a conversational prompt (a list of messages) cannot open a "
                               f"multi-turn {environment.name} episode, which starts from one user turn; write the "
                               "prompts as text")
    return [prompt_ids(e, environment, template, tokenizer) for e in examples]


def run_environment(cfg: RunConfig):
    """The run's multi-turn environment (`rpegjax.envs`), None for single-turn rollouts."""
    return make_environment(cfg.rollout.env, tags=cfg.rollout.tool_tags, sandbox_isolation=cfg.rollout.sandbox_isolation)


def check_plan_shapes(cfg: RunConfig, model_cfg: ModelConfig, max_prompt_len: int) -> None:
    """With a plan document (`graph.plan`), refuses a run whose model or step shapes are not the plan's."""
    if cfg.graph.plan is None:
        return
    rollout = cfg.rollout
    read_plan_file(cfg.graph.plan).check_run(model_cfg, PlanWorkload(
        prompts=rollout.prompts_per_step, group_size=rollout.group_size, prompt_tokens=max_prompt_len,
        response_max=rollout.max_new_tokens))


def _model_config(cfg: RunConfig, tokenizer, *, value_head: bool) -> ModelConfig:
    m = cfg.model
    precision = run_precision(cfg)
    # the vocabulary padded to a multiple of 8, as checkpoints pad theirs: tensor parallelism up to 8 splits
    # the embedding and output layer evenly (the sharding rules refuse an axis that does not divide)
    vocab = -(-tokenizer.vocab_size // 8) * 8
    experts = {} if not m.num_experts else dict(
        architecture=Architecture.QWEN3_MOE, attention_bias=False, qk_norm=True, num_experts=m.num_experts,
        num_experts_per_token=m.num_experts_per_token, moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=True)
    return ModelConfig(**{**dict(
        vocab_size=vocab, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, intermediate_size=m.intermediate_size, attention_bias=True,
        param_dtype=precision.param_dtype, dtype=precision.dtype, value_head=value_head, eos_token_id=tokenizer.eos_id,
        max_position_embeddings=4096, moe_capacity_factor=m.moe_capacity_factor, **m.execution()), **experts})


def run_precision(cfg: RunConfig) -> Precision:
    """The run's dtypes: the model section's; those it leaves unset are the plan's when the run executes one
    (`graph.plan`: the job takes the plan's precision, whatever machine it is checked on), else the precision
    policy's for this backend and the checkpoint's stored dtype (`rpegjax.models.precision`)."""
    model = cfg.model
    if cfg.graph.plan is not None and (model.param_dtype is None or model.dtype is None):
        planned = read_plan_file(cfg.graph.plan).graph.execution
        model = dataclasses.replace(model, param_dtype=model.param_dtype or planned.param_dtype,
                                    dtype=model.dtype or planned.dtype)
    checkpoint_dtype = read_config(cfg.model.path).param_dtype if cfg.model.path is not None else None
    return model.precision(backend=jax.default_backend(), checkpoint_dtype=checkpoint_dtype)


def run_execution(cfg: RunConfig) -> Execution:
    """The execution options of a run without a plan: the model section's kernel, remat, experts' capacity mode
    and precision (as the policy resolves it), the algorithm's update micro-batches, the rollout section's KV cache."""
    m = cfg.model
    algo = cfg.algorithm_section()
    precision = run_precision(cfg)
    return Execution(param_dtype=precision.param_dtype, dtype=precision.dtype, update_microbatches=algo.num_microbatches,
                     inference_rows=algo.inference_rows, packing=algo.packing,
                     max_tokens_per_micro_batch=algo.max_tokens_per_micro_batch, **m.execution(),
                     sequence_parallel=cfg.graph.sequence_parallel, moe_capacity_factor=m.moe_capacity_factor,
                     **_kv_cache_fields(cfg),
                     **_optimizer_fields(cfg), **_partial_fields(cfg))


def _partial_fields(cfg: RunConfig) -> dict[str, Any]:
    """The rollout section's partial rollouts as `Execution` fields (none when off: their defaults)."""
    rollout = cfg.rollout
    if not rollout.partial:
        return {}
    return {"partial_rollouts": True, "inflight_batches": rollout.inflight_batches,
            "max_token_lag": rollout.max_token_lag, "partial_carry": rollout.partial_carry}


def run_partial_rollouts(cfg: RunConfig, graph: Graph) -> PartialRolloutConfig | None:
    """The partial rollouts the run executes (None: off): its graph's (a plan's, or the rollout section's through
    `run_execution`), a token lagging at most `max_token_lag` versions (None: the graph's asynchrony bound + 2),
    with the rollout section's stale policy and in-flight weights (unset: on under an asynchrony bound >= 1 without a
    plan; the plan models the wait policy, not weights in flight)."""
    execution = graph.execution
    if not execution.partial_rollouts:
        return None
    lag = graph.async_bound + 2 if execution.max_token_lag is None else execution.max_token_lag
    inflight = cfg.rollout.inflight_weights
    if inflight and graph.async_bound == 0:
        raise ValueError("rollout.inflight_weights takes newer weights while a step generates; under asynchrony "
                         "bound 0 every step already generates with the newest: set graph.async_bound >= 1 (or "
                         "plan with it), or leave rollout.inflight_weights unset")
    if inflight is None:  # a plan's partial rollouts are costed without weights in flight
        inflight = graph.async_bound >= 1 and cfg.graph.plan is None
    return PartialRolloutConfig(max_token_lag=lag, stale_policy=cfg.rollout.stale_policy,
                                inflight_batches=execution.inflight_batches, inflight_weights=inflight,
                                inflight_after=cfg.rollout.inflight_after, carry=execution.partial_carry)


def _check_plan_partial(cfg: RunConfig, graph: Graph, where: str) -> None:
    """A run that sets partial rollouts other than its plan's is refused (one that leaves them unset runs the
    plan's); a plan with partial rollouts must suit the run (no dynamic sampling, no multi-turn episodes)."""
    defaults, rollout = RolloutSection(), cfg.rollout
    shown = lambda value: value.value if isinstance(value, CarryMode) else value  # noqa: E731
    asked = {name: shown(getattr(rollout, name)) for name in ("partial", "inflight_batches", "max_token_lag",
                                                              "partial_carry")
             if getattr(rollout, name) != getattr(defaults, name)}
    plan = graph.execution
    planned = {"partial": plan.partial_rollouts, "inflight_batches": plan.inflight_batches,
               "max_token_lag": plan.max_token_lag, "partial_carry": plan.partial_carry.value}
    if asked != {name: planned[name] for name in asked}:
        raise ValueError(f"{where}: the plan's partial rollouts are {planned}, this run asks for {asked} "
                         f"(rollout.partial, inflight_batches, max_token_lag, partial_carry; plan again, or leave them unset to run "
                         f"the plan's)")
    if plan.partial_rollouts and not rollout.partial:  # the run's own checks of partial rollouts, on the plan's
        try:
            dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, partial=True, max_token_lag=None,
                                                                 partial_carry=plan.partial_carry),
                                graph=dataclasses.replace(cfg.graph, async_bound=graph.async_bound))
        except ValueError as error:
            raise ValueError(f"{where}: the plan runs partial rollouts: {error}") from None


def _optimizer_fields(cfg: RunConfig) -> dict[str, Any]:
    """The graph section's optimiser-state fields, as `Execution` fields of the same names."""
    return {"optimizer_sharding": cfg.graph.optimizer_sharding.value, "optimizer_offload": cfg.graph.optimizer_offload}


def _kv_cache_fields(cfg: RunConfig) -> dict[str, Any]:
    """The rollout section's sampler fields as `Execution` fields (the sampler's slots are `decode_slots`)."""
    rollout = cfg.rollout
    return {"kv_cache": rollout.kv_cache.value, "page_size": rollout.page_size, "kv_pool_tokens": rollout.kv_pool_tokens,
            "decode_slots": rollout.num_slots, "decode_attention": rollout.decode_attention.value}


_ROLLOUT_FIELD = {"decode_slots": "num_slots"}  # Execution field -> its rollout section field, where they differ


def build_graph(cfg: RunConfig, num_devices: int) -> Graph:
    """The RPEG of this run over `num_devices` devices: the plan file's graph (`graph.plan`, with the plan's
    execution options), or the algorithm's graph with the structure and execution transforms the graph section
    asks for and the run's execution options (`run_execution`)."""
    graph = load_plan(cfg, num_devices) if cfg.graph.plan is not None else _algorithm_graph(cfg, num_devices)
    _check_packed_widths(cfg, graph)
    return graph


def _check_packed_widths(cfg: RunConfig, graph: Graph) -> None:
    """Packed rows narrowed to multiples of the algorithm's `length_bucket` must cut into the chunks every
    context-parallel layout of the graph needs, as the budget's rows do (refused here, not at the first narrow step)."""
    algo = cfg.algorithm_section()
    if not algo.packing or algo.length_bucket is None:
        return
    widths = range(algo.length_bucket, algo.max_tokens_per_micro_batch, algo.length_bucket)
    problems = packed_rows_problems(graph, widths)
    if problems:
        where, problem = problems[0]
        raise ValueError(f"{cfg.algorithm.value}.length_bucket={algo.length_bucket}: narrower {problem}, over "
                         f"{where}; rows narrow to multiples of length_bucket, so it must be such a multiple too")


def _algorithm_graph(cfg: RunConfig, num_devices: int) -> Graph:
    """The algorithm's graph with the graph section's transforms and the run's execution options."""
    section = cfg.graph
    algo = cfg.algorithm_section()
    if section.rollout_devices >= num_devices:
        raise ValueError(f"graph.rollout_devices={section.rollout_devices} leaves no device for training "
                         f"({num_devices} devices)")
    train_sizes = resolve_axis_sizes(section.mesh_axes, num_devices - section.rollout_devices)
    common = dict(use_reference=algo.kl_coef > 0, async_bound=section.async_bound, num_devices=num_devices,
                  parallel=train_sizes, epochs=algo.epochs, minibatches=algo.num_minibatches)
    if cfg.algorithm == Algorithm.GRPO:
        # one optimiser step without the decoupled correction: the old policy is the one being updated (ratio
        # 1 at its only step, whatever the asynchrony bound), so the old-log-prob pass would recompute what the
        # update's own forward gives; it is skipped (as TRL does on-policy)
        single_step = algo.layout.optimizer_steps == 1 and not algo.decoupled
        graph = builders.grpo_graph(**common, recompute_old_logprobs=not single_step)
    else:
        graph = builders.ppo_graph(**common, critic=cfg.ppo.critic.value, kl_in_reward=cfg.ppo.kl_in_reward_coef > 0)
    if section.rollout_devices:
        rollout_sizes = resolve_axis_sizes(section.rollout_mesh_axes, section.rollout_devices)
        graph = transforms.disaggregate(graph, section.rollout_devices, rollout_sizes, train_sizes)
    if section.fuse:
        graph = transforms.default_fusion(graph)
    if graph.has_stage("critic_update"):
        # PPOLearner steps actor and separate critic in one jitted program: one execution unit
        graph = transforms.fuse(graph, ["actor_update", "critic_update"])
    pieces = section.generate_microbatches
    if pieces > 1:
        graph = transforms.microbatch(graph, "generate", pieces)
        inference = [s.name for s in graph.stages if set(s.kinds) & {StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB,
                                                                     StageKind.CRITIC_VALUE}]
        for name in dict.fromkeys(inference):
            if graph.stage(name).microbatches != pieces:
                graph = transforms.microbatch(graph, name, pieces)
    return dataclasses.replace(graph, execution=run_execution(cfg)).validate()


def load_plan(cfg: RunConfig, num_devices: int) -> Graph:
    """The graph of `graph.plan`: a graph JSON, or a `scripts/plan.py --json` document (its best plan);
    checked against the run's algorithm, reference model, critic and device count."""
    plan = read_plan_file(cfg.graph.plan)
    graph, where = plan.graph, plan.where
    expected = {"algorithm": cfg.algorithm.value, "reference model": cfg.algorithm_section().kl_coef > 0}
    found = {"algorithm": graph.algorithm.value if graph.algorithm else None,
             "reference model": bool(graph.stages_of_kind(StageKind.REF_LOGPROB))}
    if cfg.algorithm is Algorithm.PPO:
        expected["shared critic"], found["shared critic"] = cfg.shares_actor_critic, graph.shares_actor_critic()
    for what, value in expected.items():
        if found[what] != value:
            raise ValueError(f"{where}: the plan has {what} = {found[what]}, this run {value} "
                             f"(plan again, or change the run's options)")
    if graph.num_devices > num_devices:
        raise ValueError(f"{where}: planned for {graph.num_devices} devices, {num_devices} are available")
    asked = {name: value for name, value in _kv_cache_fields(cfg).items()
             if value != getattr(RolloutSection(), _ROLLOUT_FIELD.get(name, name))}
    planned = {name: graph.execution.to_dict()[name] for name in asked}
    # a sampler set on the command line that the plan does not have: refused, not overridden (a plan without
    # slots takes the run's)
    if planned.get("decode_slots", 0) is None:
        del asked["decode_slots"], planned["decode_slots"]
    if asked != planned:
        raise ValueError(f"{where}: the plan's sampler is {planned}, this run asks for {asked} (rollout.kv_cache, "
                         f"page_size, kv_pool_tokens, num_slots, decode_attention; plan again, or leave them unset to run the plan's)")
    asked = {name: value for name, value in _optimizer_fields(cfg).items()
             if value != getattr(GraphSection(), name)}  # a run that leaves them at the defaults takes the plan's
    planned = {name: graph.execution.to_dict()[name] for name in asked}
    if asked != planned:
        raise ValueError(f"{where}: the plan's optimiser state is {planned}, this run asks for {asked} "
                         f"(graph.optimizer_sharding, graph.optimizer_offload; plan again, or leave them unset)")
    _check_plan_partial(cfg, graph, where)
    if cfg.graph.sequence_parallel and not graph.execution.sequence_parallel:
        raise ValueError(f"{where}: the plan runs without sequence parallelism, this run asks for it "
                         f"(graph.sequence_parallel; plan again, or leave it unset to run the plan's)")
    rows = cfg.algorithm_section().inference_rows
    if rows is not None and graph.execution.inference_rows not in (None, rows):
        raise ValueError(f"{where}: the plan runs inference in micro-batches of {graph.execution.inference_rows} rows, "
                         f"this run asks for {rows} (inference_rows; plan again, or leave it unset)")
    algo = cfg.algorithm_section()
    planned = (graph.execution.packing, graph.execution.max_tokens_per_micro_batch)
    if algo.packing and (algo.packing, algo.max_tokens_per_micro_batch) != planned:
        raise ValueError(f"{where}: the plan runs packing={planned[0]} with max_tokens_per_micro_batch={planned[1]}, "
                         f"this run asks for {algo.max_tokens_per_micro_batch} (packing, max_tokens_per_micro_batch; "
                         "plan again, or leave them unset)")
    precision = (graph.execution.param_dtype, graph.execution.dtype)
    run = run_precision(cfg)  # the model section's dtypes as the precision policy resolves them here
    if precision != (run.param_dtype, run.dtype):
        raise ValueError(f"{where}: the plan executes with {precision[0]} weights and {precision[1]} compute, this run "
                         f"with {run.param_dtype} weights and {run.dtype} compute (model.param_dtype, model.dtype; "
                         f"plan again with the run's, or set the run's to the plan's)")
    return graph


def critic_from_actor(actor: Decoder, cfg: ModelConfig) -> Decoder:
    """A critic that starts from the actor's trunk (as verl and TRL do) with a zero value head, built without
    initialising or copying any weight: its trunk arrays are the actor's, already placed (the learner's
    `init_state` gives the train state fresh buffers)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg.replace(value_head=True), rngs=nnx.Rngs(0))))
    trunk = dict(nnx.to_flat_state(nnx.state(actor)))
    filled = []
    for path, variable in nnx.to_flat_state(abstract):
        spec = variable.get_value()
        filled.append((path, variable.replace(trunk[path].get_value() if path in trunk
                                              else jax.numpy.zeros(spec.shape, spec.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def run_slots(cfg: RunConfig, graph: Graph, eval_count: int, devices: Sequence[jax.Device] | None = None) -> int:
    """The sampler's concurrent sequences: a plan's `decode_slots`, else `rollout.num_slots`, no more than a step
    or an evaluation needs, rounded to whole groups that split evenly over the generation mesh's slot replicas.
    `devices`: those the graph's placements index (default `jax.devices()`; a dry run's compile-only ones)."""
    rollout = cfg.rollout
    requested = graph.execution.decode_slots or rollout.num_slots
    # partial rollouts keep inflight_batches batches of groups in flight
    in_flight = graph.execution.inflight_batches if graph.execution.partial_rollouts else 1
    slots = min(requested, max(rollout.prompts_per_step * rollout.group_size * in_flight, eval_count))
    return usable_slots(slots, rollout.group_size, placed_meshes(graph, devices)[1])


def _warm_started(cfg: RunConfig, model: Decoder, model_cfg: ModelConfig, task, train_examples: list[Example],
                  environment, template: PromptTemplate, tokenizer, log: Callable[[str], None]
                  ) -> tuple[Decoder, dict[str, float]]:
    """The built-in model after its supervised warm start (`warmstart`, cached) on the task's worked solutions."""
    if not hasattr(task, "reference_solution"):
        raise ValueError("warm_start.steps > 0 needs a task with reference solutions (the built-in tasks); "
                         "set --warm_start.steps=0 for a dataset")
    started = time.perf_counter()
    # the prompts the policy will see (with an environment, its opening messages) and what to answer
    encode_target, taught = worked_targets(task, environment, tokenizer.encode, tokenizer.eos_id)
    model, metrics = warm_start(
        model, model_cfg, train_examples,
        encode_prompt=lambda e: prompt_ids(e, environment, template, tokenizer),
        encode_target=encode_target,
        steps=cfg.warm_start.steps, batch_size=cfg.warm_start.batch_size,
        learning_rate=cfg.warm_start.learning_rate,
        pad_id=tokenizer.pad_id,
        seed=cfg.model.seed, cache_dir=cfg.warm_start.cache_dir,
        cache_key={"model": _numerics(model_cfg), "task": task.name,
                   # the reward does not change supervised targets
                   "data": dataclasses.asdict(dataclasses.replace(cfg.data, reward=())),
                   "warm_start": dataclasses.asdict(dataclasses.replace(cfg.warm_start, cache_dir="")),
                   "seed": cfg.model.seed, "template": cfg.data.prompt_template, "format": 1,
                   # an environment changes prompts and targets (its key is absent without one: the
                   # plain warm starts cached before keep their entries)
                   **({"env": [cfg.rollout.env.value, *cfg.rollout.tool_tags]} if environment else {})},
        agree=None if jax.process_count() == 1 else distributed.holds_in_every_process,
    )
    metrics["warm_start/seconds"] = time.perf_counter() - started
    log(f"warm start: {cfg.warm_start.steps} supervised steps {taught} "
        f"({'cached' if metrics['warm_start/cached'] else 'trained'}, {metrics['warm_start/seconds']:.1f} s)")
    return model, metrics


def _pretrained(cfg: RunConfig, tokenizer, train_mesh) -> tuple[Decoder, ModelConfig]:
    """The checkpoint of `model.path`, read straight into the training layout (each process reads only the windows
    its devices hold), with the run's precision and execution options."""
    precision = run_precision(cfg)
    model, model_cfg = load_pretrained(cfg.model.path, param_dtype=precision.param_dtype, dtype=precision.dtype,
                                       value_head=cfg.shares_actor_critic, mesh=train_mesh)
    capacity = {} if cfg.model.moe_capacity_factor is None else dict(moe_capacity_factor=cfg.model.moe_capacity_factor)
    model = model.with_execution(**cfg.model.execution(), **capacity)
    model_cfg = model.cfg
    if model_cfg.eos_token_id is None:
        model_cfg = model_cfg.replace(eos_token_id=tokenizer.eos_id)
        model.cfg = model_cfg
    return model, model_cfg


def run_algorithm(cfg: RunConfig):
    """The run's algorithm section; with LoRA, its optimiser is the adapters' (a separate critic trains fully, at
    the algorithm's rate)."""
    algorithm = cfg.algorithm_section()
    if cfg.lora.config() is None:
        return algorithm
    changes = dict(optimizer=cfg.lora.optimizer(algorithm.optimizer))
    if cfg.algorithm is Algorithm.PPO and not cfg.shares_actor_critic:
        changes["critic_optimizer"] = algorithm.critic_optimizer or algorithm.optimizer
    return dataclasses.replace(algorithm, **changes)


def check_router_options(cfg: RunConfig, model_cfg: ModelConfig, graph: Graph | None = None) -> None:
    """Refuses router options the run cannot honour: router terms or replay on a dense model, and replay where the
    rollout's routing does not reach the learner (multi-turn episodes, partial rollouts, process groups)."""
    section, algorithm = cfg.algorithm.value, cfg.algorithm_section()
    if algorithm.router_replay:
        _check_replay(cfg, model_cfg, graph, section)
    if not model_cfg.num_experts:
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(algorithm, name):
                raise ValueError(f"{section}.{name}={getattr(algorithm, name)}: the model has no experts (a dense "
                                 f"{model_cfg.architecture.value} model); set it to 0")


def _check_replay(cfg: RunConfig, model_cfg: ModelConfig, graph: Graph | None, section: str) -> None:
    """Router replay needs the sampler's recorded routing of every row in the learner's batch."""
    where = f"{section}.router_replay"
    if not model_cfg.num_experts:
        raise ValueError(f"{where}: the model has no experts (a dense {model_cfg.architecture.value} model); "
                         "leave it false")
    if cfg.rollout.env != EnvironmentName.NONE:
        raise ValueError(f"{where}: multi-turn episodes do not carry the sampler's routing into the batch yet "
                         "(each turn is a separate generation); leave it false or run single-turn")
    if cfg.rollout.partial or (graph is not None and graph.execution.partial_rollouts):
        raise ValueError(f"{where}: partial rollouts continue sequences over several generations and do not carry "
                         "their routing yet; leave it false or plan without partial rollouts")
    if graph is not None and process_groups(graph) is not None:
        raise ValueError(f"{where}: a run over process groups sends rollout pieces without their routing "
                         "(runtime/roles.py); leave it false or colocate generation and training")


def _with_lora(cfg: RunConfig, model: Decoder, model_cfg: ModelConfig) -> Decoder:
    """The actor with LoRA adapters when `lora.rank` > 0 (their rank checked against a checkpoint's widths)."""
    lora = cfg.lora.config()
    if lora is None:
        return model
    if cfg.model.path is not None:
        cfg.lora.check_rank(hidden_size=model_cfg.hidden_size, num_heads=model_cfg.num_heads,
                            num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
                            intermediate_size=model_cfg.intermediate_size, where=f"the model {cfg.model.path}")
    return model.with_lora(lora, seed=cfg.model.seed + 1)


def build(cfg: RunConfig, *, log: Callable[[str], None] = print,
          before_compiling: Callable[[], None] = lambda: None) -> Components:
    """The run's parts. What can refuse the input (data, prompts, the graph or plan file, the model's shapes against
    the plan, router options, process roles) is checked first; then `before_compiling` is called, before the first
    program compiles (the job turns on JAX's compilation cache there: a refused run changes no process setting)."""
    tokenizer = builtin_tokenizer() if cfg.model.path is None else load_tokenizer(cfg.model.path)
    template = run_template(cfg)
    task, train_examples, eval_examples = make_task_and_examples(cfg)
    if cfg.data.reward:
        log(f"reward: {' + '.join(term.name for term in task.reward.terms)} (weighted sum; replaces the "
            f"{task.name} task's reward, held-out accuracy is still its verifier's)")
    if template.uses_chat_template(tokenizer):
        log("prompts: rendered with the model tokenizer's chat template (--chat-template none to turn it off)")
    examples = [*train_examples, *eval_examples]
    environment = run_environment(cfg)
    prompts = encode_prompts(examples, template, tokenizer, environment)
    if environment is not None:
        log(f"rollouts: multi-turn with the {environment.name} tool ({cfg.rollout.max_turns} turns, "
            f"{cfg.rollout.episode_token_budget or cfg.rollout.max_new_tokens} tokens per episode)")
    max_prompt_len = check_prompt_lengths(examples, prompts, cfg.rollout.max_prompt_len)
    warm_metrics: dict[str, float] = {}
    graph = build_graph(cfg, num_devices=len(jax.devices()))
    planned_cfg = run_model_config(cfg, tokenizer, value_head=cfg.shares_actor_critic).replace(
        **graph.execution.model_fields())  # the model's shapes, no weight built yet
    check_plan_shapes(cfg, planned_cfg, max_prompt_len)
    check_router_options(cfg, planned_cfg, graph)
    # with several processes, generation and training run on the same processes or on disjoint groups of whole
    # processes (`rpegjax.runtime.roles`); a placement that splits a process between the two is refused here
    groups = process_groups(graph)
    before_compiling()
    train_mesh = placed_meshes(graph)[0]
    if cfg.model.path is None:
        model_cfg = _model_config(cfg, tokenizer, value_head=cfg.shares_actor_critic)
        model = Decoder(model_cfg, rngs=nnx.Rngs(cfg.model.seed))
        if cfg.warm_start.steps > 0:
            model, warm_metrics = _warm_started(cfg, model, model_cfg, task, train_examples, environment, template,
                                                tokenizer, log)
    else:
        model, model_cfg = _pretrained(cfg, tokenizer, train_mesh)
    model_cfg = model_cfg.replace(**graph.execution.model_fields())  # what place_models runs the model with
    critic = None
    if cfg.algorithm is Algorithm.PPO and not cfg.shares_actor_critic:
        critic = critic_from_actor(model, model_cfg)
    model, algorithm = _with_lora(cfg, model, model_cfg), run_algorithm(cfg)
    rollout = cfg.rollout
    slots = run_slots(cfg, graph, len(eval_examples))
    learner, sampler = place_models(
        graph, model, algorithm,
        RolloutShape(num_slots=slots, max_prompt_len=max_prompt_len, max_new_tokens=rollout.max_new_tokens,
                     chunk_steps=rollout.chunk_steps),
        critic=critic, lora_generation=cfg.lora.generation, seed=cfg.train.seed)
    eval_sampler = None
    if groups is not None:  # the training processes evaluate (they hold the weights), on their own devices
        eval_sampler = sampler_on(sampler, train_mesh, usable_slots(slots, rollout.group_size, train_mesh))
    return Components(cfg=cfg, tokenizer=tokenizer, task=task, train_examples=train_examples,
                      eval_examples=eval_examples, model_cfg=model_cfg, learner=learner, sampler=sampler, graph=graph,
                      template=template, warm_start_metrics=warm_metrics, max_prompt_len=max_prompt_len,
                      environment=environment, eval_sampler=eval_sampler)
