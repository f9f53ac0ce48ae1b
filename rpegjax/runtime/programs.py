"""What each stage kind computes: the bridge from RPEG stages to the sampler, rewards and learners.

The runtime decides *when* and *with which weights* a stage runs; a `StagePrograms` object knows
*what* it runs. Inference stages are compiled per fused group: the stages of one group become one
jitted program (one dispatch, one pass of the batch to the device), unfused stages one program each.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax import distributed
from rpegjax.data.example import Example
from rpegjax.envs.rollout import Episode, EpisodeRunner
from rpegjax.generate.completion import Completion
from rpegjax.generate.sampler import Sampler
from rpegjax.generate.sampling import SamplingConfig
from rpegjax.graph.ir import StageKind
from rpegjax.learners.batch import TrainBatch, pack_rollouts
from rpegjax.learners.inference import map_micro_batches
from rpegjax.learners.lengths import pad_columns
from rpegjax.learners.protocol import Learner
from rpegjax.learners.update import batch_sharding, row_shards
from rpegjax.models.lora import merge_adapters
from rpegjax.models.precision import cast_floating
from rpegjax.rewards.runner import RewardFn, RewardRunner, RewardStats, TermStats
from rpegjax.runtime import transfers
from rpegjax.runtime.meshes import device_ids, same_layout
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, ShardingRules, param_shardings

# Which TrainBatch field each inference kind fills, and whose weights it reads.
INFERENCE_FIELDS = {
    StageKind.REF_LOGPROB: "ref_logprobs",
    StageKind.OLD_LOGPROB: "old_logprobs",
    StageKind.CRITIC_VALUE: "values",
}


@dataclasses.dataclass(frozen=True)
class Piece:
    """A finished part of one step's rollout: whole groups of completions, packed, with their rewards pending."""

    index: int
    examples: list[Example]  # one per row (each prompt's example repeated group_size times)
    completions: list[Completion]  # ordered by (prompt_index, sample_index)
    batch: TrainBatch  # numpy arrays of a fixed shape
    # (rewards float32 [rows of this process], RewardStats): each process scores its block of the rows
    # (`process_rows`); `StagePrograms.collect_rewards` gathers all of them
    rewards: concurrent.futures.Future


class StageLayout:
    """An inference stage's own layout on the training devices: FSDP x tensor rules on `mesh` (as training
    uses), parameters moved there per call (the constant reference weights once), rows over its data axes."""

    def __init__(self, mesh: Mesh, rules: ShardingRules | None = None):
        self.mesh = mesh
        self.rules = ShardingRules.fsdp_tp() if rules is None else rules
        self.key = tuple(mesh.shape.items())
        self.activations = ActivationSharding(mesh, self.rules)
        self.rows = batch_sharding(mesh, self.rules)
        self._constant: tuple[Any, Any] | None = None  # (source, placed) of the reference weights

    def place_params(self, params: Any, *, constant: bool = False) -> Any:
        """`params` (an NNX state, or a dict of them as a PPO state holds) moved and resharded onto the mesh;
        `constant` weights (the reference) are moved once and reused while the same tree is passed."""
        if constant:
            if self._constant is None or self._constant[0] is not params:
                self._constant = (params, self.place_params(params))
            return self._constant[1]
        if isinstance(params, nnx.State):
            return jax.device_put(params, param_shardings(params, self.mesh, self.rules), may_alias=False)
        return {name: self.place_params(value) for name, value in params.items()}


class StagePrograms:
    """Stage computations for one run, built from a `Learner` (`rpegjax.learners.protocol`) and a sampler.

    Inference programs are fused from the learner's pure token functions (`logprobs_fn`; with a critic,
    `values_fn` and `logprobs_and_values_fn`: one pass over a shared trunk). The reference stage reads
    `reference_params` (default: `learner.reference_params()`, the initial policy; with LoRA its frozen base).
    Generation runs on the sampler's mesh, every other device stage on the learner's (`learner.placement.mesh`;
    None: the default device); the two may be disjoint device sets. The weight-sync stage copies the actor's weights into the sampler's
    layout (`sampler.params_sharding`), cast to `generation_dtype` when given (`rpegjax.models.precision`); a
    policy with LoRA adapters and a sampler of its base model get the adapters merged into the kernels there.

    `rewards` is a `RewardRunner`, or any reward function `fn(completion: str, example) -> float`, which is
    then run by a `RewardRunner` of default settings (worker processes, timeouts, limits) that these
    programs own: `close()` stops it (None: programs that never generate, as in tests of other stages).

    `episodes` makes every rollout multi-turn (`rpegjax.envs.rollout`): each sample is an episode of model turns
    and tool outputs (masked out of the loss), rendered from the environment's opening messages (the `prompt_ids`
    passed to `generate` are then unused); the reward reads the last model turn, and an environment's own
    reward, when it gives one, replaces the task's.
    """

    def __init__(
        self,
        *,
        learner: Learner,
        sampler: Sampler,
        sampling: SamplingConfig,
        group_size: int,
        rewards: RewardRunner | RewardFn | None,
        decode: Callable[[Sequence[int]], str],
        pad_id: int,
        reference_params: Any = None,
        generation_dtype: str | None = None,
        episodes: EpisodeRunner | None = None,
    ):
        if episodes is not None and episodes.sampler is not sampler:
            raise ValueError("StagePrograms: the episode runner must drive this programs' sampler")
        self.episodes = episodes
        self.learner = learner
        self.sampler = sampler
        self.sampling = sampling
        self.group_size = group_size
        self._own_rewards = rewards is not None and not isinstance(rewards, RewardRunner)
        self.rewards = RewardRunner(rewards) if self._own_rewards else rewards
        self.decode = decode
        self.pad_id = pad_id
        self.sequence_length = sampler.max_prompt_len + sampler.max_new_tokens
        self._kind_functions = {
            StageKind.REF_LOGPROB: learner.logprobs_fn,
            StageKind.OLD_LOGPROB: learner.logprobs_fn,
            StageKind.CRITIC_VALUE: learner.values_fn,
        }
        if reference_params is None:
            reference_params = learner.reference_params()
        self._params_of = {
            StageKind.REF_LOGPROB: lambda state: reference_params,
            StageKind.OLD_LOGPROB: self.actor_params_of,
            StageKind.CRITIC_VALUE: lambda state: learner.model_params(state.params),
        }
        self._logprobs_and_values = learner.logprobs_and_values_fn
        self.batch_sharding = learner.placement.rows
        self.train_mesh = learner.placement.mesh
        generation_shardings = sampler.params_sharding
        # a copy, never the same buffers: the next update donates the training ones. Onto other devices
        # (disaggregated generation) a jitted program cannot output: `device_put` moves and reshards there.
        # Weights are cast to `generation_dtype` (None: kept as trained) on the training devices, in the copy.
        cast = (lambda params: jax.tree.map(jnp.copy, params)) if generation_dtype is None else (
            lambda params: cast_floating(params, generation_dtype))
        lora = learner.placement.lora
        merge = lora is not None and sampler.lora is None  # a base-model sampler: adapters merged into the copy
        if merge:
            cast_only = cast
            cast = lambda params: cast_only(merge_adapters(params, lora.scale))  # noqa: E731
        self._cast = cast
        self._staging: Any = None  # `staging_shardings()`, built on first use (training processes over process groups)
        self._copies: dict[int, tuple[Any, Callable]] = {}  # `copy_actor`'s programs by layout
        self.reward_processes: Sequence[int] | None = None  # who scores a piece's rows (None: every process)
        if device_ids(sampler.mesh) == device_ids(self.train_mesh):
            self._sync = jax.jit(cast, out_shardings=generation_shardings)
        else:
            target = generation_shardings if generation_shardings is not None else jax.devices()[0]
            cast_here = None if generation_dtype is None and not merge else jax.jit(cast)
            self._sync = lambda params: jax.device_put(params if cast_here is None else cast_here(params), target,
                                                       may_alias=False)
        self._inference_programs: dict[tuple, Callable] = {}
        self._layouts: dict[tuple, StageLayout] = {}  # inference layouts other than the learner's, by mesh shape
        self.dispatches = 0  # device programs launched by inference, advantage, update and sync stages

    def close(self) -> None:
        """Stops the reward runner these programs made from a reward function (a runner passed in is the
        caller's to close)."""
        if self._own_rewards:
            self.rewards.close()

    def mesh_of(self, kind: StageKind) -> Mesh | None:
        """The mesh the program of a device stage of `kind` runs on (None: the default device)."""
        return self.sampler.mesh if kind == StageKind.GENERATE else self.train_mesh

    # ---- rollout side ---------------------------------------------------------------------------
    def generate(
        self,
        params: Any,
        examples: Sequence[Example],
        prompt_ids: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        version: int,
        pieces: int,
    ) -> Iterator[Piece]:
        """Streams the step's rollout in `pieces` parts of whole prompt groups, each yielded (with its reward
        scoring already submitted to the host pool) as soon as all its sequences have finished."""
        prompts_per_piece = len(examples) // pieces
        waiting: dict[int, list[tuple[Completion, Episode | None]]] = {index: [] for index in range(pieces)}
        needed = prompts_per_piece * self.group_size
        if self.episodes is None:
            stream = ((c, None) for c in self.sampler.stream(params, prompt_ids, self.sampling,
                                                             group_size=self.group_size, key=key, version=version))
        else:
            stream = ((e.completion, e) for e in self.episodes.run(params, examples, group_size=self.group_size,
                                                                   key=key, version=version))
        for completion, episode in stream:
            index = completion.prompt_index // prompts_per_piece
            waiting[index].append((completion, episode))
            if len(waiting[index]) == needed:
                yield self._finish_piece(index, sorted(waiting.pop(index), key=lambda item: item[0].order), examples)

    def _finish_piece(self, index: int, items: list[tuple[Completion, Episode | None]],
                      examples: Sequence[Example]) -> Piece:
        completions = [c for c, _ in items]
        rows = [examples[c.prompt_index] for c in completions]
        if self.reward_processes is None:
            mine = process_rows(len(rows))
        else:  # only the generation processes score (a disaggregated run over process groups)
            mine = process_rows(len(rows), self.reward_processes.index(jax.process_index()), len(self.reward_processes))
        texts = [self.decode(c.response_ids) if e is None else e.final_text for c, e in items[mine]]
        batch = pack_rollouts(
            [c.prompt_ids for c in completions], [c.response_ids for c in completions],
            [c.behaviour_logprobs for c in completions], pad_id=self.pad_id, length=self.sequence_length,
            loss_masks=[c.model_mask for c in completions],
        )
        rewards = self.rewards.submit(texts, rows[mine])
        environment = [None if e is None else e.reward for _, e in items[mine]]
        if any(r is not None for r in environment):
            rewards = _with_environment_rewards(rewards, environment)
        return Piece(index=index, examples=rows, completions=completions, batch=batch, rewards=rewards)

    def collect_rewards(self, piece: Piece) -> tuple[np.ndarray, RewardStats]:
        """Rewards float32 [rows] of every row of `piece`, and their stats (errors and timeouts summed over
        processes, seconds the slowest process's, `first_error` this process's). With several processes this
        is a collective: every process calls it for the same pieces in the same order."""
        local, stats = piece.rewards.result()
        count = jax.process_count()
        if count == 1:
            return local, stats
        rows = len(piece.examples)
        width = -(-rows // count)
        padded = np.zeros(width, np.float32)
        padded[: len(local)] = local
        # every process's reward has the same terms (the same function): their sums travel as numbers too
        numbers = np.array([stats.errors, stats.timeouts, stats.seconds, stats.nonfinite,
                            *(x for t in stats.terms for x in (t.total, t.scored, t.errors))], np.float32)
        gathered = distributed.gather_to_all({"rewards": padded, "numbers": numbers}, tiled=False)
        blocks = [process_rows(rows, process, count) for process in range(count)]
        rewards = np.concatenate([gathered["rewards"][p][: b.stop - b.start] for p, b in enumerate(blocks)])
        numbers = np.asarray(gathered["numbers"]).sum(0)  # [4 + 3 x terms] summed over processes
        seconds = np.asarray(gathered["numbers"])[:, 2].max()
        terms = tuple(TermStats(name=t.name, total=float(numbers[4 + 3 * i]), scored=int(numbers[5 + 3 * i]),
                                errors=int(numbers[6 + 3 * i])) for i, t in enumerate(stats.terms))
        return rewards, RewardStats(count=rows, errors=int(numbers[0]), timeouts=int(numbers[1]),
                                    nonfinite=int(numbers[3]), mean_reward=float(rewards.mean()), seconds=float(seconds),
                                    first_error=stats.first_error, terms=terms)

    # ---- train side ----------------------------------------------------------------------------
    def _inference_program(self, kinds: tuple[StageKind, ...], layout: StageLayout | None, micro_batches: int,
                           length: int) -> Callable:
        """The jitted program of inference `kinds`: rows in `micro_batches` micro-batches
        (`rpegjax.learners.inference`), outputs padded with zeros to `length` columns (inputs may come trimmed)."""
        key = (kinds, None if layout is None else layout.key, micro_batches, length)
        if key not in self._inference_programs:
            functions = [self._kind_functions[kind] for kind in kinds]
            for kind, function in zip(kinds, functions):
                if function is None:
                    raise ValueError(f"stage kind {kind.value} needs a critic, and this learner has none")
            sharding = None if layout is None else layout.activations
            rows = self.batch_sharding if layout is None else layout.rows
            # log-probs and values of one stage from one pass when the learner can (a shared trunk)
            joint = self._logprobs_and_values if {StageKind.OLD_LOGPROB, StageKind.CRITIC_VALUE} <= set(kinds) else None

            def program(params_by_kind, tokens, token_mask):
                def rows_program(tokens, token_mask):
                    outputs = {}
                    if joint is not None:
                        critic = kinds.index(StageKind.CRITIC_VALUE)
                        outputs[StageKind.OLD_LOGPROB], outputs[StageKind.CRITIC_VALUE] = joint(
                            params_by_kind[critic], tokens, token_mask, sharding)
                    for kind, f, p in zip(kinds, functions, params_by_kind):
                        if kind not in outputs:
                            outputs[kind] = f(p, tokens, token_mask, sharding)
                    return tuple(outputs[kind] for kind in kinds)

                outputs = map_micro_batches(rows_program, micro_batches, tokens, token_mask, sharding=rows)
                return tuple(pad_columns(output, length) for output in outputs)

            self._inference_programs[key] = jax.jit(program)
        return self._inference_programs[key]

    def infer(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch, mesh: Mesh | None = None) -> dict[str, jax.Array]:
        """Runs the inference kinds of one execution unit as one program, with the weights each kind reads
        (reference, or the actor/critic of the current training state); returns TrainBatch fields.

        The rows run trimmed to the learner's length bucket and in its row micro-batches
        (`Learner.trimmed_length`, `Learner.inference_micro_batches`); the outputs have the batch's length.
        `mesh`: the stage's own layout on the training devices when it differs from the learner's (a plan that
        re-shards inference, e.g. pure FSDP for a forward pass that needs no optimiser state): the weights are
        moved there first (the reference's once), the batch's rows split over its data axes."""
        kinds = tuple(kinds)
        layout = None
        if mesh is not None and not same_layout(self.train_mesh, dict(mesh.shape)):
            if device_ids(mesh) != device_ids(self.train_mesh):
                raise ValueError(f"stages {[k.value for k in kinds]}: mesh on devices {sorted(device_ids(mesh))} is not "
                                 f"on the training devices {sorted(device_ids(self.train_mesh))}")
            key = tuple(mesh.shape.items())
            layout = self._layouts.setdefault(key, StageLayout(mesh))
        rows_sharding = self.batch_sharding if layout is None else layout.rows
        stage_mesh = None if rows_sharding is None else rows_sharding.mesh
        shards = row_shards(rows_sharding)
        shards = shards if batch.batch_size % shards == 0 else 1  # rows that do not divide are replicated
        tensor = 1 if stage_mesh is None else stage_mesh.shape.get(axes.TENSOR_AXIS, 1)
        length = self.learner.trimmed_length(batch.token_mask)
        micro_batches = self.learner.inference_micro_batches(batch.batch_size, length, shards=shards, tensor=tensor)
        program = self._inference_program(kinds, layout, micro_batches, batch.length)
        self.dispatches += 1
        params = tuple(self._params_of[kind](state) for kind in kinds)
        if any(p is None for p in params):
            raise ValueError(f"stages {[k.value for k in kinds]}: a reference stage needs reference_params")
        tokens, token_mask = batch.tokens[:, :length], batch.token_mask[:, :length]
        if layout is None:
            outputs = program(params, self._place(tokens), self._place(token_mask))
        else:
            params = tuple(layout.place_params(p, constant=kind == StageKind.REF_LOGPROB) for kind, p in zip(kinds, params))
            outputs = program(params, self._place(tokens, layout.rows), self._place(token_mask, layout.rows))
        return {INFERENCE_FIELDS[kind]: output for kind, output in zip(kinds, outputs)}

    def _place(self, tree: Any, rows: NamedSharding | None = None) -> Any:
        """Arrays of `tree` with the learner's batch layout, or `rows` (rows over the data axes; replicated when
        the rows do not divide, e.g. a micro-batch piece); unchanged without a mesh.

        Pieces computed separately are concatenated without a layout, and host arrays have none. Every process
        holds the whole of each host array, so each builds its own shards from it: no communication (a
        `device_put` onto a mesh spanning processes would first check, across processes, that they agree)."""
        rows = self.batch_sharding if rows is None else rows
        if rows is None:
            return tree
        mesh, rows_spec = rows.mesh, rows.spec[0] if rows.spec else None
        row_axes = (rows_spec,) if isinstance(rows_spec, str) else tuple(rows_spec or ())
        row_shards = math.prod(mesh.shape[name] for name in row_axes)

        def place(value):
            split = np.ndim(value) > 0 and np.shape(value)[0] % row_shards == 0
            sharding = rows if split else NamedSharding(mesh, PartitionSpec())
            if isinstance(value, jax.Array):
                return jax.device_put(value, sharding)
            host = np.asarray(value, jax.dtypes.canonicalize_dtype(np.asarray(value).dtype))
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, tree)

    def advantages(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, Any]]:
        self.dispatches += 1
        return self.learner.compute_advantages(self._place(batch))

    def update(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch) -> tuple[Any, dict[str, Any]]:
        """One learner update. A learner with a critic updates actor and critic in one program, so the
        graph must give both update kinds in one execution unit (fused, or merged by share_actor_critic)."""
        expected = {StageKind.ACTOR_UPDATE} | ({StageKind.CRITIC_UPDATE} if self._kind_functions[
            StageKind.CRITIC_VALUE] is not None else set())
        given = set(kinds) & {StageKind.ACTOR_UPDATE, StageKind.CRITIC_UPDATE}
        if given != expected:
            raise ValueError(f"update stages {sorted(k.value for k in kinds)}: this learner runs "
                             f"{sorted(k.value for k in expected)} as one program; fuse them into one unit")
        self.dispatches += 1
        return self.learner.update(state, self._place(batch))

    def sync(self, state: Any) -> Any:
        """Generation-layout copy of the actor weights of `state`."""
        self.dispatches += 1
        return self._sync(self.actor_params_of(state))

    def staging_shardings(self) -> Any:
        """The generation layout laid over the training devices (`rpegjax.runtime.transfers.layout_on`): what
        `staged_sync` outputs, so that a transfer moves whole generation shards to the generation processes."""
        return transfers.layout_on(self.sampler.params_sharding, list(self.train_mesh.devices.flat))

    def generation_shapes(self) -> Any:
        """Shapes and dtypes of the generation copy of the actor weights (computed abstractly: no program runs)."""
        return jax.eval_shape(self._cast, self.learner.actor_params(self.learner.params))

    def copy_actor(self, state: Any, shardings: Any) -> Any:
        """The generation copy of the actor weights of `state` (as `sync` computes it) laid out as `shardings`
        on the training devices (e.g. a sampler of held-out evaluation there); one program per layout."""
        key = id(shardings)
        if key not in self._copies:
            self._copies[key] = (shardings, jax.jit(self._cast, out_shardings=shardings))  # holds `shardings` alive
        return self._copies[key][1](self.actor_params_of(state))

    def staged_sync(self, state: Any) -> Any:
        """The generation copy of the actor weights of `state` in `staging_shardings` (on the training devices),
        computed as `sync` computes it: a disaggregated run over process groups sends it to the generation
        processes."""
        if self._staging is None:  # one object: `copy_actor` keeps one program per layout object
            self._staging = self.staging_shardings()
        self.dispatches += 1
        return self.copy_actor(state, self._staging)

    def actor_params_of(self, state: Any) -> Any:
        """The policy's parameters in a learner's train state."""
        return self.learner.actor_params(state.params)


def _with_environment_rewards(task: concurrent.futures.Future, environment: list[float | None]
                              ) -> concurrent.futures.Future:
    """A future of the task's `(rewards, stats)` in which the rows an environment rewarded hold its reward."""
    combined: concurrent.futures.Future = concurrent.futures.Future()

    def done(future: concurrent.futures.Future) -> None:
        try:
            rewards, stats = future.result()
        except BaseException as error:
            combined.set_exception(error)
            return
        rewards = np.array(rewards, np.float32)
        for row, value in enumerate(environment):
            if value is not None:
                rewards[row] = value
        combined.set_result((rewards, dataclasses.replace(stats, mean_reward=float(rewards.mean()))))

    task.add_done_callback(done)
    return combined


def process_rows(rows: int, process: int | None = None, count: int | None = None) -> slice:
    """The block of `rows` host rows that `process` (default: this one) of `count` works on: contiguous
    blocks in process order, sizes differing by at most one (`rows` need not divide evenly)."""
    process = jax.process_index() if process is None else process
    count = jax.process_count() if count is None else count
    return slice(process * rows // count, (process + 1) * rows // count)


def concatenate_pieces(pieces: Sequence[Piece]) -> TrainBatch:
    """The step's whole batch, rows in prompt order."""
    fields = {}
    for field in dataclasses.fields(TrainBatch):
        values = [getattr(piece.batch, field.name) for piece in pieces]
        if values[0] is None:
            continue
        fields[field.name] = np.concatenate([np.asarray(v) for v in values]) if len(values) > 1 else values[0]
    return TrainBatch(**fields)
