"""The training side of a step's programs: inference stages (reference / old log-probs, values), advantages and
the update, on the learner's devices.

Each program is built once per shape and can be lowered for abstract inputs (`jax.ShapeDtypeStruct` with
shardings) through the very path that runs it (`lower_inference`, `lower_update`): the dry run
(`rpegjax.train.dry_run`) compiles exactly what the runtime launches. Inference stages of one execution unit
are one jitted program (one dispatch, one pass of the batch to the device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.generate.decode import ROUTING_DTYPE, routing_shape
from rpegjax.graph.ir import StageKind
from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.inference import map_micro_batches
from rpegjax.learners.lengths import pad_columns
from rpegjax.learners.packing import PackingPlan, pack_tokens
from rpegjax.learners.protocol import Learner
from rpegjax.learners.update import batch_sharding, row_shards
from rpegjax.runtime.meshes import device_ids, same_layout
from rpegjax.runtime.offload import OptimizerOffload
from rpegjax.sharding import axes
from rpegjax.sharding.abstract import is_abstract, with_shardings
from rpegjax.sharding.rules import ActivationSharding, ShardingRules, param_shardings

# Which TrainBatch field each inference kind fills, and whose weights it reads.
INFERENCE_FIELDS = {
    StageKind.REF_LOGPROB: "ref_logprobs",
    StageKind.OLD_LOGPROB: "old_logprobs",
    StageKind.CRITIC_VALUE: "values",
}


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
        `constant` weights (the reference) are moved once and reused while the same tree is passed. Abstract
        parameters become abstract arrays with this layout's shardings."""
        if constant and not is_abstract(params):
            if self._constant is None or self._constant[0] is not params:
                self._constant = (params, self.place_params(params))
            return self._constant[1]
        if isinstance(params, nnx.State):
            shardings = param_shardings(params, self.mesh, self.rules)
            if is_abstract(params):
                return with_shardings(params, shardings)
            return jax.device_put(params, shardings, may_alias=False)
        return {name: self.place_params(value) for name, value in params.items()}


def row_placement(shape: tuple[int, ...], rows: NamedSharding) -> NamedSharding:
    """Where an array of `shape` goes under the row layout `rows`: rows over the data axes when they divide,
    replicated otherwise (e.g. a micro-batch piece)."""
    spec = rows.spec[0] if rows.spec else None
    row_axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
    shards = math.prod(rows.mesh.shape[name] for name in row_axes)
    split = len(shape) > 0 and shape[0] % shards == 0
    return rows if split else NamedSharding(rows.mesh, PartitionSpec())


class TrainingPrograms:
    """Inference, advantage and update programs of one run, built from a `Learner`
    (`rpegjax.learners.protocol`): inference is fused from the learner's pure token functions (`logprobs_fn`;
    with a critic `values_fn` and `logprobs_and_values_fn`, one pass over a shared trunk). The reference stage
    reads `reference_params` (default: `learner.reference_params()`, the initial policy; with LoRA its frozen
    base). Everything runs on the learner's mesh (`learner.placement.mesh`; None: the default device), an
    inference stage with a layout of its own on the same devices when the plan gives one. `offload_optimizer`: the
    optimiser state waits in host memory between updates (`rpegjax.runtime.offload`; `at_rest` puts a state there)."""

    def __init__(self, learner: Learner, reference_params: Any = None, *, offload_optimizer: bool = False):
        self.learner = learner
        # what a rollout records per token under router replay (None: the learner does not replay routing)
        self._routing = routing_shape(learner.model_cfg) if learner.router_replay else None
        self.offload = OptimizerOffload(learner.state_shardings) if offload_optimizer else None
        self._kind_functions = {
            StageKind.REF_LOGPROB: learner.logprobs_fn,
            StageKind.OLD_LOGPROB: learner.logprobs_fn,
            StageKind.CRITIC_VALUE: learner.values_fn,
        }
        if reference_params is None:
            reference_params = learner.reference_params()
        self._params_of = {
            StageKind.REF_LOGPROB: lambda state: reference_params,
            StageKind.OLD_LOGPROB: lambda state: learner.actor_params(state.params),
            StageKind.CRITIC_VALUE: lambda state: learner.model_params(state.params),
        }
        self._logprobs_and_values = learner.logprobs_and_values_fn
        self.batch_sharding = learner.placement.rows
        self.mesh = learner.placement.mesh
        self._inference_programs: dict[tuple, Callable] = {}
        self._layouts: dict[tuple, StageLayout] = {}  # inference layouts other than the learner's, by mesh shape
        self.dispatches = 0  # programs launched: inference, advantages, update

    @property
    def has_critic(self) -> bool:
        return self._kind_functions[StageKind.CRITIC_VALUE] is not None

    def compiled_inference_programs(self) -> int:
        """Inference programs built so far (one per kinds, layout, micro-batches and length)."""
        return len(self._inference_programs)

    # ---- inference -----------------------------------------------------------------------------
    def _inference_program(self, kinds: tuple[StageKind, ...], layout: StageLayout | None, micro_batches: int,
                           length: int, packed: bool = False, replay: bool = False) -> Callable:
        """The jitted program of inference `kinds`: rows in `micro_batches` micro-batches
        (`rpegjax.learners.inference`), outputs padded with zeros to `length` columns (inputs may come trimmed).
        `packed`: the rows are packed (`rpegjax.learners.packing`): the program takes their segment ids and each
        output's unpacking gather (rows, columns, real) [b, length], and returns the outputs unpacked. `replay`: the
        program takes the rollout's routing [b t s k] too, which the policy's passes replay (old log-probs and a
        shared critic's values; the reference routes freely, as its own model would)."""
        key = (kinds, None if layout is None else layout.key, micro_batches, length, packed, replay)
        if key not in self._inference_programs:
            functions = [self._kind_functions[kind] for kind in kinds]
            for kind, function in zip(kinds, functions):
                if function is None:
                    raise ValueError(f"stage kind {kind.value} needs a critic, and this learner has none")
            sharding = None if layout is None else layout.activations
            rows = self.batch_sharding if layout is None else layout.rows
            # log-probs and values of one stage from one pass when the learner can (a shared trunk)
            joint = self._logprobs_and_values if {StageKind.OLD_LOGPROB, StageKind.CRITIC_VALUE} <= set(kinds) else None

            def program(params_by_kind, tokens, token_mask, segment_ids=None, unpacking=None, expert_ids=None):
                def rows_program(tokens, token_mask, *optional):
                    segment_ids = optional[0] if packed else None
                    expert_ids = optional[-1] if replay else None
                    outputs = {}
                    if joint is not None:
                        critic = kinds.index(StageKind.CRITIC_VALUE)
                        outputs[StageKind.OLD_LOGPROB], outputs[StageKind.CRITIC_VALUE] = joint(
                            params_by_kind[critic], tokens, token_mask, sharding, segment_ids=segment_ids,
                            expert_ids=expert_ids)
                    for kind, f, p in zip(kinds, functions, params_by_kind):
                        if kind not in outputs:
                            routed = {} if kind == StageKind.REF_LOGPROB else {"expert_ids": expert_ids}
                            outputs[kind] = f(p, tokens, token_mask, sharding, segment_ids=segment_ids, **routed)
                    return tuple(outputs[kind] for kind in kinds)

                arrays = (tokens, token_mask, *(() if segment_ids is None else (segment_ids,)),
                          *(() if expert_ids is None else (expert_ids,)))
                outputs = map_micro_batches(rows_program, micro_batches, *arrays, sharding=rows)
                if unpacking is not None:
                    return tuple(jnp.where(unpacking[2], output[unpacking[0], unpacking[1]], 0.0) for output in outputs)
                return tuple(pad_columns(output, length) for output in outputs)

            self._inference_programs[key] = jax.jit(program)
        return self._inference_programs[key]

    def has_own_layout(self, mesh: Mesh | None) -> bool:
        """Whether an inference stage on `mesh` runs on a layout of its own (weights moved there per call)."""
        return mesh is not None and not same_layout(self.mesh, dict(mesh.shape))

    def placed_reference(self, mesh: Mesh | None = None) -> Any:
        """The reference weights as a reference stage on `mesh` reads them (abstract when the learner's are)."""
        params = self._params_of[StageKind.REF_LOGPROB](None)
        layout = self._stage_layout((StageKind.REF_LOGPROB,), mesh)
        return params if layout is None else layout.place_params(params, constant=True)

    def _stage_layout(self, kinds: tuple[StageKind, ...], mesh: Mesh | None) -> StageLayout | None:
        """The stage's own layout when `mesh` differs from the learner's (None: the learner's)."""
        if not self.has_own_layout(mesh):
            return None
        if device_ids(mesh) != device_ids(self.mesh):
            raise ValueError(f"stages {[k.value for k in kinds]}: mesh on devices {sorted(device_ids(mesh))} is not "
                             f"on the training devices {sorted(device_ids(self.mesh))}")
        if tuple(mesh.shape.items()) not in self._layouts:  # the learner's sequence parallelism on the stage's mesh
            learner_activations = self.learner.placement.activations
            sequence_parallel = learner_activations is not None and learner_activations.rules.sequence_parallel
            self._layouts[tuple(mesh.shape.items())] = StageLayout(
                mesh, ShardingRules.fsdp_tp(sequence_parallel=sequence_parallel))
        return self._layouts[tuple(mesh.shape.items())]

    def _inference_call(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch, mesh: Mesh | None
                        ) -> tuple[tuple[StageKind, ...], Callable, tuple]:
        """The program `infer` runs for this batch and its arguments (placed, or abstract for a lowering)."""
        kinds = tuple(kinds)
        layout = self._stage_layout(kinds, mesh)
        rows_sharding = self.batch_sharding if layout is None else layout.rows
        stage_mesh = None if rows_sharding is None else rows_sharding.mesh
        shards = row_shards(rows_sharding)
        shards = shards if batch.batch_size % shards == 0 else 1  # rows that do not divide are replicated
        tensor = 1 if stage_mesh is None else stage_mesh.shape.get(axes.TENSOR_AXIS, 1)
        params = tuple(self._params_of[kind](state) for kind in kinds)
        if any(p is None for p in params):
            raise ValueError(f"stages {[k.value for k in kinds]}: a reference stage needs reference_params")
        if layout is not None:
            params = tuple(layout.place_params(p, constant=kind == StageKind.REF_LOGPROB) for kind, p in zip(kinds, params))
        replay = self._replays(kinds, batch)
        plan = self.learner.inference_packing(batch.token_mask, shards=shards)
        if plan is not None:
            return kinds, *self._packed_call(kinds, layout, plan, params, batch, rows_sharding, shards, replay)
        length = self.learner.trimmed_length(batch.token_mask)
        micro_batches = self.learner.inference_micro_batches(batch.batch_size, length, shards=shards, tensor=tensor)
        program = self._inference_program(kinds, layout, micro_batches, batch.length, replay=replay)
        tokens, token_mask = _columns(batch.tokens, length), _columns(batch.token_mask, length)
        arguments = (params, self.place(tokens, rows_sharding), self.place(token_mask, rows_sharding))
        if replay:
            arguments += (None, None, self.place(_columns(batch.expert_ids, length), rows_sharding))
        return kinds, program, arguments

    def _replays(self, kinds: tuple[StageKind, ...], batch: TrainBatch) -> bool:
        """Whether these inference kinds replay the rollout's routing: under the learner's `router_replay`, when a
        policy pass is among them; the batch must then carry it."""
        if self._routing is None or set(kinds) <= {StageKind.REF_LOGPROB}:
            return False
        if batch.expert_ids is None:
            raise ValueError(f"stages {[k.value for k in kinds]}: router_replay needs the rollout's routing "
                             "(TrainBatch.expert_ids), and this batch carries none")
        return True

    def _packed_call(self, kinds: tuple[StageKind, ...], layout: StageLayout | None, plan: PackingPlan, params: tuple,
                     batch: TrainBatch, rows_sharding: NamedSharding | None, shards: int,
                     replay: bool = False) -> tuple[Callable, tuple]:
        """`_inference_call` of packed rows: one packed row per row shard per micro-batch, unpacked in the program
        (`replay`: each segment carries its sequence's routing)."""
        program = self._inference_program(kinds, layout, plan.num_rows // shards, batch.length, packed=True,
                                          replay=replay)
        unpacking = plan.destinations(batch.length)
        if isinstance(batch.tokens, jax.ShapeDtypeStruct):
            shape = (plan.num_rows, plan.row_tokens)
            packed = (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.bool_),
                      jax.ShapeDtypeStruct(shape, jnp.int32))
            routing = None if not replay else jax.ShapeDtypeStruct((*shape, *batch.expert_ids.shape[2:]),
                                                                   batch.expert_ids.dtype)
            unpacking = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in unpacking)
        else:
            sequence, column, real = plan.sources()
            packed = (pack_tokens(batch.tokens, sequence, column, real), pack_tokens(batch.token_mask, sequence, column, real),
                      plan.segment_ids())
            routing = None if not replay else pack_tokens(batch.expert_ids, sequence, column, real, fill=-1)
        placed = tuple(self.place(x, rows_sharding) for x in packed)
        arguments = (params, *placed, tuple(self.place(x, rows_sharding) for x in unpacking))
        return program, arguments + (() if routing is None else (self.place(routing, rows_sharding),))

    def infer(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch, mesh: Mesh | None = None
              ) -> dict[str, jax.Array]:
        """Runs the inference kinds of one execution unit as one program, with the weights each kind reads
        (reference, or the actor/critic of the current training state); returns TrainBatch fields.

        The rows run trimmed to the learner's length bucket and in its row micro-batches
        (`Learner.trimmed_length`, `Learner.inference_micro_batches`); the outputs have the batch's length.
        `mesh`: the stage's own layout on the training devices when it differs from the learner's (a plan that
        re-shards inference, e.g. pure FSDP for a forward pass that needs no optimiser state): the weights are
        moved there first (the reference's once), the batch's rows split over its data axes."""
        kinds, program, arguments = self._inference_call(kinds, state, batch, mesh)
        self.dispatches += 1
        outputs = program(*arguments)
        return {INFERENCE_FIELDS[kind]: output for kind, output in zip(kinds, outputs)}

    def lower_inference(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch, mesh: Mesh | None = None
                        ) -> jax.stages.Lowered:
        """The program `infer(kinds, state, batch, mesh)` runs, lowered: `state` and `batch` may be abstract
        (`abstract_batch`), and the program is then lowered at the batch's whole length."""
        _, program, arguments = self._inference_call(kinds, state, batch, mesh)
        return program.lower(*arguments)

    # ---- advantages and the update -----------------------------------------------------------
    def advantages(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, Any]]:
        self.dispatches += 1
        return self.learner.compute_advantages(self.place(batch))

    def _check_update_kinds(self, kinds: Sequence[StageKind]) -> None:
        """A learner with a critic updates actor and critic in one program, so the graph must give both update
        kinds in one execution unit (fused, or merged by share_actor_critic)."""
        expected = {StageKind.ACTOR_UPDATE} | ({StageKind.CRITIC_UPDATE} if self.has_critic else set())
        given = set(kinds) & {StageKind.ACTOR_UPDATE, StageKind.CRITIC_UPDATE}
        if given != expected:
            raise ValueError(f"update stages {sorted(k.value for k in kinds)}: this learner runs "
                             f"{sorted(k.value for k in expected)} as one program; fuse them into one unit")

    def update(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch) -> tuple[Any, dict[str, Any]]:
        """One learner update of the batch, placed with the learner's row layout."""
        self._check_update_kinds(kinds)
        self.dispatches += 1
        if self.offload is None:
            return self.learner.update(state, self.place(batch))
        state, metrics = self.learner.update(self.offload.to_device(state), self.place(batch))
        return self.offload.to_host(state), metrics

    def at_rest(self, state: Any) -> Any:
        """`state` as it waits between updates: its optimiser state in host memory when offloaded, else unchanged."""
        return state if self.offload is None else self.offload.to_host(state)

    def lower_update(self, kinds: Sequence[StageKind], state: Any, batch: TrainBatch) -> jax.stages.Lowered:
        """The program `update(kinds, state, batch)` runs, lowered (`state`, `batch` may be abstract)."""
        self._check_update_kinds(kinds)
        return self.learner.lower_update(state, self.place(batch))

    def abstract_rollout(self, rows: int, length: int) -> TrainBatch:
        """What the rollout packs (`rpegjax.learners.batch.pack_rollouts`), abstract: tokens, masks, behaviour
        log-probs and rewards of `rows` rows of `length` tokens, and under router replay the recorded routing
        (int16 [rows, length, sparse layers, k]); what inference stages receive."""
        per_token = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype)  # noqa: E731
        routing = (None if self._routing is None
                   else jax.ShapeDtypeStruct((rows, length, *self._routing), ROUTING_DTYPE))
        return TrainBatch(tokens=per_token(jnp.int32), token_mask=per_token(jnp.bool_), response_mask=per_token(jnp.bool_),
                          behaviour_logprobs=per_token(jnp.float32), rewards=jax.ShapeDtypeStruct((rows,), jnp.float32),
                          expert_ids=routing)

    def abstract_batch(self, rows: int, length: int, kinds: Sequence[StageKind]) -> TrainBatch:
        """The step's batch as the update receives it, abstract: the rollout's (`abstract_rollout`), the fields
        the inference `kinds` fill and what the learner's advantage stage adds."""
        filled = {INFERENCE_FIELDS[kind]: jax.ShapeDtypeStruct((rows, length), jnp.float32) for kind in kinds
                  if kind in INFERENCE_FIELDS}
        batch = self.abstract_rollout(rows, length).replace(**filled)
        with_advantages = jax.eval_shape(lambda b: self.learner.compute_advantages(b)[0], batch)
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), with_advantages)

    # ---- placement -----------------------------------------------------------------------------
    def place(self, tree: Any, rows: NamedSharding | None = None) -> Any:
        """Arrays of `tree` with the learner's batch layout, or `rows` (`row_placement`); unchanged without a
        mesh. Abstract arrays get the sharding they would be placed with.

        Pieces computed separately are concatenated without a layout, and host arrays have none. Every process
        holds the whole of each host array, so each builds its own shards from it: no communication (a
        `device_put` onto a mesh spanning processes would first check, across processes, that they agree)."""
        rows = self.batch_sharding if rows is None else rows
        if rows is None:
            return tree

        def place(value):
            sharding = row_placement(np.shape(value), rows)
            if isinstance(value, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
            if isinstance(value, jax.Array):
                return jax.device_put(value, sharding)
            host = np.asarray(value, jax.dtypes.canonicalize_dtype(np.asarray(value).dtype))
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, tree)


def _columns(value: Any, length: int) -> Any:
    """The first `length` columns of a [b, t, ...] array (an abstract one gets the abstract shape)."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((value.shape[0], length, *value.shape[2:]), value.dtype)
    return value[:, :length]
