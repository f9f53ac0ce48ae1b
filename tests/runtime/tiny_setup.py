"""The runtime tests' one small setup, built without `rpegjax.train`: a 1-layer model of the built-in character
tokenizer, the built-in arithmetic task, the GRPO (or PPO) graph of the runtime under test, and the learner and
sampler placed on it by the runtime's own set-up path (`rpegjax.runtime.assembly.place_models`).

Models and learners are built once per model shape and algorithm and shared by setups that differ only in their
graph (each build compiles); `run_runtime` runs the `Runtime` for some steps and returns what the tests check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from rpegjax.data.iterator import DataIterator
from rpegjax.data.prompts import PromptTemplate
from rpegjax.generate.sampler import usable_slots
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph import builders, transforms
from rpegjax.graph.ir import Execution, Graph, StageKind
from rpegjax.graph.trace import Trace
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.ppo import PPOConfig
from rpegjax.models.config import ModelConfig
from rpegjax.models.tokenizer import builtin_tokenizer
from rpegjax.models.transformer import Decoder
from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
from rpegjax.rewards.tasks import make_task
from rpegjax.runtime.assembly import RolloutShape, place_models
from rpegjax.runtime.controller import Runtime
from rpegjax.runtime.meshes import placed_meshes
from rpegjax.runtime.programs import StagePrograms
from rpegjax.sharding.mesh import resolve_axis_sizes

OPTIMIZER = OptimizerConfig(learning_rate=1e-4, b2=0.99, weight_decay=0.0)
TEMPERATURE = 0.7


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinySetup:
    """The small run every runtime test starts from: model shape, rollout sizes, algorithm, graph structure and
    placement. `train_mesh` / `rollout_mesh` are axis sizes (-1: what the other axes leave); `rollout_devices` > 0
    gives generation the first devices and training the rest."""

    width: int = 32  # the hidden size; heads of 64 beyond 128, an MLP of twice the width
    num_kv_heads: int = 1
    prompts_per_step: int = 4
    group_size: int = 2
    max_prompt_len: int = 12
    max_new_tokens: int = 6
    num_slots: int = 8
    chunk_steps: int = 3
    train_size: int = 64
    kl_coef: float = 0.04
    decoupled: bool = True
    num_minibatches: int = 1
    ppo_critic: str | None = None  # a PPO learner with this critic ("shared" or "separate"); None: GRPO
    async_bound: int = 0
    fuse: bool = True
    generate_microbatches: int = 1
    train_mesh: tuple[tuple[str, int], ...] = (("data", -1),)
    rollout_devices: int = 0
    rollout_mesh: tuple[tuple[str, int], ...] = (("data", -1),)

    def replace(self, **changes: Any) -> TinySetup:
        return dataclasses.replace(self, **changes)

    def algorithm(self) -> GRPOConfig | PPOConfig:
        common = dict(kl_coef=self.kl_coef, decoupled=self.decoupled, importance_cap=5.0 if self.decoupled else None,
                      num_minibatches=self.num_minibatches, temperature=TEMPERATURE, optimizer=OPTIMIZER)
        if self.ppo_critic is not None:
            return PPOConfig(**common, critic=self.ppo_critic, gamma=1.0, lam=1.0)
        return GRPOConfig(**common, group_size=self.group_size)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=TEMPERATURE)


def tiny_graph(setup: TinySetup, num_devices: int | None = None) -> Graph:
    """The setup's graph over `num_devices` (default: every device): the algorithm's graph, disaggregated, fused
    and micro-batched as the setup says."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    algorithm = setup.algorithm()
    train_sizes = resolve_axis_sizes(dict(setup.train_mesh), num_devices - setup.rollout_devices)
    common = dict(use_reference=setup.kl_coef > 0, async_bound=setup.async_bound, num_devices=num_devices,
                  parallel=train_sizes, epochs=algorithm.epochs, minibatches=algorithm.num_minibatches)
    if setup.ppo_critic is None:
        single_step = algorithm.layout.optimizer_steps == 1 and not algorithm.decoupled
        graph = builders.grpo_graph(**common, recompute_old_logprobs=not single_step)
    else:
        graph = builders.ppo_graph(**common, critic=setup.ppo_critic, kl_in_reward=False)
    if setup.rollout_devices:
        rollout_sizes = resolve_axis_sizes(dict(setup.rollout_mesh), setup.rollout_devices)
        graph = transforms.disaggregate(graph, setup.rollout_devices, rollout_sizes, train_sizes)
    if setup.fuse:
        graph = transforms.default_fusion(graph)
    if graph.has_stage("critic_update"):
        graph = transforms.fuse(graph, ["actor_update", "critic_update"])
    if setup.generate_microbatches > 1:
        pieces = setup.generate_microbatches
        graph = transforms.microbatch(graph, "generate", pieces)
        inference = {StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB, StageKind.CRITIC_VALUE}
        for name in dict.fromkeys(s.name for s in graph.stages if set(s.kinds) & inference):
            if graph.stage(name).microbatches != pieces:
                graph = transforms.microbatch(graph, name, pieces)
    return dataclasses.replace(graph, execution=Execution()).validate()


@dataclasses.dataclass
class TinyRun:
    """What the runtime needs of a setup, built: tokenizer, task, examples, learner, sampler and graph."""

    setup: TinySetup
    tokenizer: Any
    task: Any
    train_examples: list
    template: PromptTemplate
    model_cfg: ModelConfig
    learner: Any
    sampler: Any
    graph: Graph

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    def prompt_ids(self, examples) -> list[list[int]]:
        return [self.tokenizer.encode(self.template.render(e, self.tokenizer)) for e in examples]

    def decode(self, ids) -> str:
        # the vocabulary is padded past the tokenizer's: such samples decode to U+FFFD
        known = [int(i) for i in ids if int(i) < self.tokenizer.vocab_size]
        text = self.tokenizer.decode(known)
        return text if len(known) == len(ids) else text + "\ufffd"

    def programs(self, rewards, *, generation_dtype: str | None = None) -> StagePrograms:
        """The stage programs of this run with `rewards` (a RewardRunner, a reward function, or None)."""
        return StagePrograms(learner=self.learner, sampler=self.sampler, sampling=self.setup.sampling(),
                             group_size=self.setup.group_size, rewards=rewards, decode=self.decode, pad_id=self.pad_id,
                             generation_dtype=generation_dtype, offload_optimizer=self.graph.execution.optimizer_offload)


_BUILT: dict[TinySetup, TinyRun] = {}


def _placement_key(setup: TinySetup) -> TinySetup:
    """Setups with the same model, algorithm and placement share learner and sampler."""
    return setup.replace(async_bound=0, fuse=True, generate_microbatches=1)


def built_on(setup: TinySetup, graph: Graph) -> TinyRun:
    """The setup built on the placements of `graph` (e.g. a planner's plan), which it then runs (not cached)."""
    return _build(setup, graph)


def built(setup: TinySetup) -> TinyRun:
    """The setup built (learner and sampler shared with setups that differ only in the graph's structure; the
    graph itself is the setup's)."""
    key = _placement_key(setup)
    if key not in _BUILT:
        _BUILT[key] = _build(key)
    return dataclasses.replace(_BUILT[key], setup=setup, graph=tiny_graph(setup))


def _build(setup: TinySetup, graph: Graph | None = None) -> TinyRun:
    """The setup built on `graph`'s placements (default: the setup's own graph)."""
    tokenizer = builtin_tokenizer()
    template = PromptTemplate(template="{question}")
    task = make_task("arithmetic", "easy")
    examples = task.train_examples(setup.train_size, 0)
    graph = tiny_graph(setup) if graph is None else graph
    shared_critic = setup.ppo_critic == "shared"
    heads = max(2, setup.width // 64)
    # the vocabulary padded to a multiple of 8, so tensor parallelism splits the embedding evenly
    model_cfg = ModelConfig(vocab_size=-(-tokenizer.vocab_size // 8) * 8, hidden_size=setup.width, num_layers=1,
                            num_heads=heads, num_kv_heads=setup.num_kv_heads, head_dim=setup.width // heads,
                            intermediate_size=2 * setup.width, attention_bias=True, value_head=shared_critic,
                            eos_token_id=tokenizer.eos_id, max_position_embeddings=4096)
    model = Decoder(model_cfg, rngs=nnx.Rngs(0))
    critic = None
    if setup.ppo_critic is not None and not shared_critic:
        critic = Decoder(model_cfg.replace(value_head=True), rngs=nnx.Rngs(1))
    slots = usable_slots(min(setup.num_slots, setup.prompts_per_step * setup.group_size), setup.group_size,
                         placed_meshes(graph)[1])
    learner, sampler = place_models(graph, model, setup.algorithm(), RolloutShape(
        num_slots=slots, max_prompt_len=setup.max_prompt_len, max_new_tokens=setup.max_new_tokens,
        chunk_steps=setup.chunk_steps), critic=critic)
    return TinyRun(setup=setup, tokenizer=tokenizer, task=task, train_examples=examples, template=template,
                   model_cfg=model_cfg, learner=learner, sampler=sampler, graph=graph)


@dataclasses.dataclass
class RuntimeRun:
    """What `run_runtime` returns: the built setup, the runtime after the run, the final training state, every
    step's result and the trace."""

    run: TinyRun
    runtime: Runtime
    state: Any
    results: list
    trace: Trace


def run_runtime(setup: TinySetup, steps: int, *, reward: Callable | None = None, graph: Graph | None = None,
                key: int = 7, prepare: Callable[[StagePrograms], None] | None = None,
                **runtime_options: Any) -> RuntimeRun:
    """Runs `steps` steps of `setup` (with `graph` instead of the setup's when given) from the initial weights,
    scoring with `reward(text, example)` (default: the task's) in one worker thread. `prepare(programs)` is called
    before the runtime is built; `runtime_options` go to `Runtime`."""
    run = built(setup)
    if graph is not None:
        run = dataclasses.replace(run, graph=graph)
    rewards = RewardRunner(run.task.reward if reward is None else reward,
                           RewardRunnerConfig(timeout_s=5.0, workers=1, isolation=run.task.isolation))
    programs = run.programs(rewards)
    if prepare is not None:
        prepare(programs)
    data = DataIterator(run.train_examples, batch_size=setup.prompts_per_step, seed=0)
    trace = Trace()
    runtime = Runtime(run.graph, programs, data, prompt_ids=run.prompt_ids, key=jax.random.key(key), trace=trace,
                      **runtime_options)
    results = []
    try:
        state = runtime.run(run.learner.init_state(), start_step=0, num_steps=steps,
                            on_step=lambda result, _: results.append(result))
    finally:
        rewards.close()
    return RuntimeRun(run=run, runtime=runtime, state=state, results=results, trace=trace)
