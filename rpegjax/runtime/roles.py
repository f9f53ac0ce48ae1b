"""Process roles of a disaggregated plan: which processes generate and which train, and everything that crosses
between the two groups during a run.

When the devices of the generate stage and those of every other device stage belong to disjoint sets of processes,
each process takes the role of the devices it owns (`process_groups`): generation processes run the rollout loop
(data, prompts, generation, rewards), training processes every other stage. Each group launches programs only on
its own meshes, so the two never have to agree on a launch order. After set-up no collective may span the two
groups (a process waiting in one while a peer's transfer pull from it is pending deadlocks both), so everything
that crosses goes through `rpegjax.runtime.transfers` (`RoleLinks`):

- *weights*, training -> generation: version v, laid out as the generation layout over the training devices
  (`StagePrograms.staged_sync`), is offered under version v and pulled by the generation processes;
- *rollouts*, generation -> training: each piece's packed rows (tokens, masks, behaviour log-probs; with partial
  rollouts the weights version that sampled each token) and its host
  data (per-row indices and lengths, finish reasons, the example of each row, the data position, each generation
  process's block of rewards and reward statistics, with dynamic sampling on the last piece the step's reward
  metrics, or the failure of the rollout stage) encoded as JSON bytes in a small array, one per generation process
  (each scored its own block of the rows); each piece is offered as it finishes, and pulled by the training
  processes as soon as they start the step (`request_piece`), so it arrives while later pieces still decode;
- *the carry* (partial rollouts), generation -> training after each step's last piece: the groups still in flight
  (`PartialRollouts.snapshot`, as arrays: `rpegjax.runtime.carry_arrays`), which the training processes write into
  their checkpoints; and training -> generation at the start of the run: a resumed run's carry, from its
  checkpoint;
- *the start of the run*, training -> generation: the step and data position the run starts from (a resumed
  run's, from its checkpoint, which only the training processes read);
- *the end of the run*, training -> generation: a small control message saying whether training finished or
  failed. A generation process does not exit before it has it, so every rollout it offered has been pulled.

Host data travel as arrays on one device per process (`heads`): every process of a group holds the same host
arrays, so each builds its shard alone and the transfer pulls one copy per process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.data.example import Example
from rpegjax.distributed.hosts import ProcessAddress
from rpegjax.generate.completion import Completion, FinishReason
from rpegjax.graph.ir import Graph, GraphError, StageKind
from rpegjax.learners.batch import TrainBatch
from rpegjax.rewards.runner import RewardStats, TermStats, merge_terms
from rpegjax.runtime import transfers
from rpegjax.runtime.carry_arrays import carry_arrays, carry_like, carry_snapshot
from rpegjax.runtime.meshes import placement_devices
from rpegjax.runtime.programs import Piece

_FINISH = list(FinishReason)
_CONTROL_BYTES = 4096
# transfer ids: (serial << 2) | channel, so weights, rollout pieces, control messages and carries never share one
_WEIGHTS, _PIECE, _CONTROL, _CARRY = 0, 1, 2, 3
_START = (1 << 2) | _CONTROL  # the start-of-run message; the end-of-run one is serial 0
_START_CARRY = _CARRY  # a resumed run's carry (serial 0); step t's is serial t + 1


class Role(enum.StrEnum):
    GENERATE = "generate"
    TRAIN = "train"


@dataclasses.dataclass(frozen=True)
class ProcessGroups:
    """The processes that generate and those that train (disjoint, each sorted)."""

    generation: tuple[int, ...]
    training: tuple[int, ...]

    def role_of(self, process: int) -> Role:
        if process in self.generation:
            return Role.GENERATE
        if process in self.training:
            return Role.TRAIN
        raise ValueError(f"process {process} holds no device of the plan (generation {list(self.generation)}, "
                         f"training {list(self.training)})")

    @property
    def role(self) -> Role:
        """This process's role."""
        return self.role_of(jax.process_index())


def process_groups(graph: Graph) -> ProcessGroups | None:
    """The roles of the processes under `graph`: None when every process takes part in every device stage (one
    process, or generation and training on the same processes: the colocated path), else the two disjoint groups.

    Raises GraphError, naming the stages, when generation and training share a process without sharing all of
    them (a placement whose devices split a process between the roles), or when a process holds no device of the
    plan (it would have nothing to run and would still be waited for)."""
    generate = graph.stages_of_kind(StageKind.GENERATE)[0]
    generation = {d.process_index for d in placement_devices(graph, generate.placement)}
    trainers: dict[int, list[str]] = {}
    for stage in graph.stages:
        if stage.host or stage.name == generate.name:
            continue
        for device in placement_devices(graph, stage.placement):
            trainers.setdefault(device.process_index, []).append(stage.name)
    training = set(trainers)
    if generation == training:
        return None
    shared = sorted(generation & training)
    if shared:
        stages = sorted({name for process in shared for name in trainers[process]})
        raise GraphError(f"stage {generate.name!r} (placement {generate.placement!r}) runs on processes "
                         f"{sorted(generation)} and stages {stages} on processes {sorted(training)}: process(es) "
                         f"{shared} would hold devices of both; place generation and training either on the same "
                         "processes or on disjoint ones (whole processes)", stage=generate.name)
    idle = sorted(set(range(jax.process_count())) - generation - training)
    if idle:
        raise GraphError(f"process(es) {idle} hold no device of the plan (generation on processes "
                         f"{sorted(generation)}, training on {sorted(training)}); give every process a role",
                         stage=generate.name)
    return ProcessGroups(generation=tuple(sorted(generation)), training=tuple(sorted(training)))


def writer_process(graph: Graph) -> int:
    """The process that writes the run's files (metrics, samples, trace, checkpoint metadata) and speaks for it:
    process 0, or over process groups the first training process (it holds the training state and every step's
    results; the generation processes hold neither)."""
    groups = process_groups(graph)
    return 0 if groups is None else groups.training[0]


def heads(graph: Graph, placement: str) -> list[jax.Device]:
    """The first device of `placement` in each of its processes (in process order): where host data travel."""
    first: dict[int, jax.Device] = {}
    for device in placement_devices(graph, placement):
        first.setdefault(device.process_index, device)
    return [first[p] for p in sorted(first)]


def _replicated(devices: Sequence[jax.Device]) -> NamedSharding:
    return NamedSharding(Mesh(np.array(list(devices), dtype=object), ("process",)), PartitionSpec())


def _host_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """`value` as a global array of `sharding`, built by each process from its own copy (no communication)."""
    value = np.ascontiguousarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)


def _host_value(array: jax.Array) -> np.ndarray:
    """The whole value of a replicated global array from this process's shard."""
    return np.asarray(array.addressable_shards[0].data)


def _encode(record: dict[str, Any], size: int, what: str) -> np.ndarray:
    data = json.dumps(record, separators=(",", ":")).encode()
    if len(data) + 8 > size:
        raise ValueError(f"{what}: {len(data)} bytes of host data do not fit the {size} bytes reserved for them")
    out = np.zeros(size, np.uint8)
    out[:8] = np.frombuffer(np.array([len(data)], np.int64).tobytes(), np.uint8)
    out[8:8 + len(data)] = np.frombuffer(data, np.uint8)
    return out


def _record_terms(record: dict[str, Any]) -> list[TermStats]:
    """The reward terms a generation process's piece record carries (`send_piece`)."""
    return [TermStats(name=name, total=total, scored=scored, errors=errors)
            for name, total, scored, errors in record["terms"]]


def _decode(encoded: np.ndarray) -> dict[str, Any]:
    length = int(np.frombuffer(encoded[:8].tobytes(), np.int64)[0])
    return json.loads(encoded[8:8 + length].tobytes().decode())


@dataclasses.dataclass
class ReceivedRollout:
    """A rollout piece as the training processes receive it."""

    piece: Piece  # its rewards future holds every row's task reward and the summed statistics
    version: int
    examples: list[Example]  # the step's prompts
    data_state: dict[str, Any]
    metrics: dict[str, float] | None = None  # dynamic sampling, last piece: the step's reward metrics (every round's)
    rollout_metrics: dict[str, float] | None = None  # last piece: the generation side's `Rollout.metrics`


class RoleLinks:
    """The transfers between the generation and the training processes of one run (see the module docstring).

    `weights_like` is the generation copy's tree of shapes, `weights_targets` its shardings on the generation mesh
    and `weights_staging` the same layout over the training devices; `rows` and `length` a rollout piece's shape.
    `examples` are the data iterator's examples (rows travel as indices into them); `address` is where this
    process's transfer server listens (`DistributedConfig.address()`). `carry`: with partial rollouts, the most
    groups in flight and the samples of a group; pieces then carry every token's weights version too.
    Constructing it is a collective of every process (the transfer servers' addresses are exchanged); after that
    nothing here is a collective."""

    def __init__(self, graph: Graph, groups: ProcessGroups, *, weights_like: Any, weights_staging: Any,
                 weights_targets: Any, rows: int, length: int, examples: Sequence[Example],
                 address: ProcessAddress = ProcessAddress(), carry: tuple[int, int] | None = None):
        self.groups = groups
        generate = graph.stages_of_kind(StageKind.GENERATE)[0]
        train = graph.stages_of_kind(StageKind.ACTOR_UPDATE)[0]
        self.generation_heads, self.training_heads = heads(graph, generate.placement), heads(graph, train.placement)
        self.weights = transfers.plan_transfer(weights_like, weights_staging, weights_targets)
        self.rows, self.length = rows, length
        self.carry_shape = carry
        self.meta_bytes = 8192 + 256 * rows
        self._sources = {"batch": _replicated(self.generation_heads),
                         "meta": [_replicated([head]) for head in self.generation_heads]}
        targets = _replicated(self.training_heads)
        like = self._piece_like()
        self.pieces = transfers.plan_transfer(like, self._piece_sources(), targets)
        self.control = transfers.plan_transfer(jax.ShapeDtypeStruct((_CONTROL_BYTES,), np.uint8),
                                               _replicated(self.training_heads), _replicated(self.generation_heads))
        if carry is not None:  # each step's carry goes to the training processes, a resumed run's comes back
            carried = carry_like(*carry, length)
            generation, training = _replicated(self.generation_heads), _replicated(self.training_heads)
            self.carry_out = transfers.plan_transfer(carried, generation, training)
            self.carry_in = transfers.plan_transfer(carried, training, generation)
        self.examples = list(examples)
        self._example_index = {id(example): index for index, example in enumerate(self.examples)}
        self.links = transfers.ProcessTransfers(address)
        self.weight_offers: list[dict[str, float]] = []  # training side: when each version was offered
        self.weight_pulls: list[dict[str, float]] = []  # generation side: when each version's pull started/ended

    # ---- shapes -----------------------------------------------------------------------------------
    def _piece_like(self) -> dict[str, Any]:
        shape = (self.rows, self.length)
        like = {"tokens": jax.ShapeDtypeStruct(shape, np.int32), "token_mask": jax.ShapeDtypeStruct(shape, np.int8),
                "response_mask": jax.ShapeDtypeStruct(shape, np.int8),
                "behaviour_logprobs": jax.ShapeDtypeStruct(shape, np.float32)}
        if self.carry_shape is not None:  # partial rollouts: the weights version of every token
            like["versions"] = jax.ShapeDtypeStruct(shape, np.int32)
        like["meta"] = [jax.ShapeDtypeStruct((self.meta_bytes,), np.uint8) for _ in self.generation_heads]
        return like

    def _piece_sources(self) -> dict[str, Any]:
        batch = self._sources["batch"]
        sources = {"tokens": batch, "token_mask": batch, "response_mask": batch, "behaviour_logprobs": batch,
                   "meta": list(self._sources["meta"])}
        if self.carry_shape is not None:
            sources["versions"] = batch
        return sources

    def _empty_rows(self) -> dict[str, np.ndarray]:
        """A piece's row arrays, zero (its token versions -1: unknown)."""
        shape = (self.rows, self.length)
        host = {"tokens": np.zeros(shape, np.int32), "token_mask": np.zeros(shape, np.int8),
                "response_mask": np.zeros(shape, np.int8), "behaviour_logprobs": np.zeros(shape, np.float32)}
        if self.carry_shape is not None:
            host["versions"] = np.full(shape, -1, np.int32)
        return host

    @property
    def weights_bytes(self) -> int:
        """Bytes of one weights version (every generation device's shard once)."""
        return self.weights.nbytes

    # ---- weights ----------------------------------------------------------------------------------
    def send_weights(self, version: int, params: Any, now) -> None:
        """Training side: offers weights `version` (in the staging layout) to the generation processes; `now()` is
        the clock the offer is recorded with."""
        transfers.send(self.links, self.weights, version * 4 + _WEIGHTS, params)
        self.weight_offers.append({"version": version, "time": now()})

    def receive_weights(self, version: int, now) -> Any:
        """Generation side: weights `version` in the generation layout (waits until they have arrived); `now()` is
        the clock the pull's start and end are recorded with."""
        start = now()
        return self.open_weights(version, self.request_weights(version), start, now)

    def request_weights(self, version: int) -> Any:
        """Generation side: starts pulling weights `version` (returns at once; `piece_arrived` tells whether they
        are there, `open_weights` waits for them). Each version may be requested once."""
        return transfers.receive(self.links, self.weights, version * 4 + _WEIGHTS)

    def open_weights(self, version: int, requested: Any, start: float, now) -> Any:
        """Generation side: weights `version` requested at time `start` (`request_weights`), once arrived; the
        pull is recorded with `now()`."""
        params = jax.block_until_ready(requested)
        me = jax.process_index()
        sources = sorted({source for source, target in self.weights.routes if target == me})
        self.weight_pulls.append({"version": version, "start": start, "end": now(),
                                  "bytes": self.weights.received_bytes(me), "sources": sources})
        return params

    # ---- rollouts ---------------------------------------------------------------------------------
    def _piece_id(self, step: int, index: int, pieces: int) -> int:
        return (step * pieces + index) * 4 + _PIECE

    def send_piece(self, step: int, pieces: int, piece: Piece, *, version: int, examples: Sequence[Example],
                   data_state: dict[str, Any], rewards: np.ndarray, stats: RewardStats,
                   metrics: dict[str, float] | None = None, rollout_metrics: dict[str, float] | None = None) -> None:
        """Generation side: offers `piece` of `step` with this process's block of its rewards (and, with dynamic
        sampling, on the last piece the step's reward metrics, which cover every round's sequences; on the last
        piece the rollout's own metrics, e.g. the sampler's occupancy)."""
        completions = piece.completions
        rows = [[c.prompt_index, c.sample_index, int(c.prompt_ids.shape[0]), c.length, _FINISH.index(c.finish_reason),
                 -1 if c.version is None else c.version, self._example_index[id(e)], c.model_mask is not None,
                 c.token_versions is not None] for c, e in zip(completions, piece.examples)]
        record = {"status": "ok", "rows": rows, "version": version,
                  "examples": [self._example_index[id(e)] for e in examples],
                  "data": {"epoch": data_state["epoch"], "position": data_state["position"]},
                  "rewards": [float(r) for r in np.asarray(rewards, np.float32)],
                  "stats": [stats.errors, stats.timeouts, stats.nonfinite, stats.seconds],
                  "first_error": stats.first_error,
                  "terms": [[t.name, t.total, t.scored, t.errors] for t in stats.terms], "metrics": metrics,
                  "rollout_metrics": rollout_metrics}
        batch = piece.batch
        host = {"tokens": np.asarray(batch.tokens, np.int32), "token_mask": np.asarray(batch.token_mask, np.int8),
                "response_mask": np.asarray(batch.response_mask, np.int8),
                "behaviour_logprobs": np.asarray(batch.behaviour_logprobs, np.float32)}
        if self.carry_shape is not None:  # each token's version, where the packed row holds the token
            host["versions"] = np.full((self.rows, self.length), -1, np.int32)
            for row, completion in enumerate(completions):
                prompt = int(completion.prompt_ids.shape[0])
                host["versions"][row, prompt:prompt + completion.length] = completion.versions()
        elif any(c.token_versions is not None for c in completions):
            raise ValueError("a rollout piece with per-token weights versions, over links planned without them "
                             "(RoleLinks(carry=...): partial rollouts)")
        self._offer_piece(step, piece.index, pieces, host, record)

    def send_failure(self, step: int, index: int, pieces: int, error: BaseException) -> None:
        """Generation side: offers, in place of piece `index` of `step`, the rollout stage's failure."""
        message = f"{type(error).__name__}: {error}"[:2000]
        self._offer_piece(step, index, pieces, self._empty_rows(), {"status": "error", "message": message})

    def _offer_piece(self, step: int, index: int, pieces: int, host: dict[str, np.ndarray], record: dict) -> None:
        meta = _encode(record, self.meta_bytes, f"step {step} rollout piece {index}")
        sources = self._piece_sources()
        tree = {name: _host_array(value, sources[name]) for name, value in host.items()}
        # record i lives on generation process i's head only: each process offers its own
        tree["meta"] = [_host_array(meta, sharding) for sharding in sources["meta"]]
        transfers.send(self.links, self.pieces, self._piece_id(step, index, pieces), tree)

    def request_piece(self, step: int, index: int, pieces: int) -> Any:
        """Training side: starts pulling piece `index` of `step`; returns its arrays, ready once it has arrived
        (`piece_arrived`), to be read with `open_piece`."""
        return transfers.receive(self.links, self.pieces, self._piece_id(step, index, pieces))

    @staticmethod
    def piece_arrived(tree: Any) -> bool:
        """Whether every array of a requested piece has arrived (does not wait)."""
        return all(leaf.is_ready() for leaf in jax.tree.leaves(tree))

    def open_piece(self, step: int, index: int, tree: Any, *, base_data_state: dict[str, Any]) -> ReceivedRollout:
        """Training side: piece `index` of `step` from its arrays (`request_piece`; waits for them). Raises
        RuntimeError with the generation processes' message when the rollout stage failed."""
        tree = jax.block_until_ready(tree)
        records = [_decode(_host_value(meta)) for meta in tree["meta"]]
        failed = [r["message"] for r in records if r["status"] != "ok"]
        if failed:
            raise RuntimeError(f"the rollout stage of step {step} failed in the generation processes: {failed[0]}")
        first = records[0]
        host = {name: _host_value(tree[name])
                for name in ("tokens", "token_mask", "response_mask", "behaviour_logprobs")}
        batch = TrainBatch(tokens=host["tokens"], token_mask=host["token_mask"].astype(bool),
                           response_mask=host["response_mask"].astype(bool),
                           behaviour_logprobs=host["behaviour_logprobs"])
        completions, row_examples = [], []
        versions = _host_value(tree["versions"]) if "versions" in tree else None
        for row, fields in enumerate(first["rows"]):
            prompt_index, sample_index, prompt, length, finish, version, example, masked, versioned = fields
            tokens = batch.tokens[row]
            mask = batch.response_mask[row, prompt:prompt + length].copy() if masked else None
            token_versions = versions[row, prompt:prompt + length].astype(np.int64) if versioned else None
            completions.append(Completion(
                prompt_index=prompt_index, sample_index=sample_index, prompt_ids=tokens[:prompt].copy(),
                response_ids=tokens[prompt:prompt + length].copy(),
                behaviour_logprobs=batch.behaviour_logprobs[row, prompt:prompt + length].copy(),
                finish_reason=_FINISH[finish], version=None if version < 0 else version, model_mask=mask,
                token_versions=token_versions))
            row_examples.append(self.examples[example])
        rewards = np.concatenate([np.asarray(r["rewards"], np.float32) for r in records])
        if len(rewards) != len(completions):
            raise RuntimeError(f"step {step} piece {index}: {len(rewards)} rewards for {len(completions)} rows")
        stats = np.array([r["stats"] for r in records], np.float64)
        first_error = next((r["first_error"] for r in records if r["first_error"]), "")
        scored: concurrent.futures.Future = concurrent.futures.Future()
        scored.set_result((rewards, RewardStats(count=len(rewards), errors=int(stats[:, 0].sum()),
                                                timeouts=int(stats[:, 1].sum()), nonfinite=int(stats[:, 2].sum()),
                                                seconds=float(stats[:, 3].max()), first_error=first_error,
                                                mean_reward=float(rewards.mean()) if len(rewards) else 0.0,
                                                terms=merge_terms([_record_terms(r) for r in records]))))
        piece = Piece(index=index, examples=row_examples, completions=completions, batch=batch, rewards=scored)
        return ReceivedRollout(piece=piece, version=first["version"],
                               examples=[self.examples[i] for i in first["examples"]],
                               data_state={**base_data_state, **first["data"]}, metrics=first["metrics"],
                               rollout_metrics=first["rollout_metrics"])

    # ---- the carry (partial rollouts) -------------------------------------------------------------------
    def send_carry(self, step: int, snapshot: dict[str, Any]) -> None:
        """Generation side: offers the groups in flight after `step` (`PartialRollouts.snapshot`)."""
        self._offer_carry(self.carry_out, ((step + 1) << 2) | _CARRY, snapshot, self.generation_heads)

    def request_carry(self, step: int) -> Any:
        """Training side: starts pulling the carry after `step` (`piece_arrived` tells whether it is there)."""
        return transfers.receive(self.links, self.carry_out, ((step + 1) << 2) | _CARRY)

    @staticmethod
    def open_carry(tree: Any) -> dict[str, Any]:
        """The snapshot of a requested carry (`request_carry`, `receive_start_carry`; waits for it)."""
        return carry_snapshot({name: _host_value(array) for name, array in jax.block_until_ready(tree).items()})

    def send_start_carry(self, snapshot: dict[str, Any]) -> None:
        """Training side: offers the groups in flight the run starts with (a resumed run's, from its checkpoint;
        none otherwise)."""
        self._offer_carry(self.carry_in, _START_CARRY, snapshot, self.training_heads)

    def receive_start_carry(self) -> dict[str, Any]:
        """Generation side: the groups in flight the training processes start with (waits for them)."""
        return self.open_carry(transfers.receive(self.links, self.carry_in, _START_CARRY))

    def _offer_carry(self, plan: transfers.TransferPlan, transfer_id: int, snapshot: dict[str, Any],
                     devices: Sequence[jax.Device]) -> None:
        arrays = carry_arrays(snapshot, *self.carry_shape, self.length)
        sharding = _replicated(devices)
        transfers.send(self.links, plan, transfer_id, {name: _host_array(value, sharding)
                                                       for name, value in arrays.items()})

    # ---- the start of the run -------------------------------------------------------------------------
    def send_start(self, step: int, data_state: dict[str, Any]) -> None:
        """Training side: tells the generation processes where the run starts (a resumed run's checkpoint step and
        data position; step 0 and the fresh position otherwise)."""
        encoded = _encode({"step": step, "data": data_state}, _CONTROL_BYTES, "the start-of-run message")
        transfers.send(self.links, self.control, _START, _host_array(encoded, _replicated(self.training_heads)))

    def receive_start(self) -> tuple[int, dict[str, Any]]:
        """Generation side: the step and data position the training processes start from (waits for them)."""
        record = _decode(_host_value(jax.block_until_ready(transfers.receive(self.links, self.control, _START))))
        return record["step"], record["data"]

    # ---- the end of the run ---------------------------------------------------------------------------
    def finish(self, error: BaseException | None = None) -> None:
        """Training side: tells the generation processes that the run ended (or failed with `error`)."""
        record = {"status": "ok"} if error is None else {"status": "error",
                                                         "message": f"{type(error).__name__}: {error}"[:2000]}
        encoded = _encode(record, _CONTROL_BYTES, "the end-of-run message")
        transfers.send(self.links, self.control, _CONTROL, _host_array(encoded, _replicated(self.training_heads)))

    def await_finish(self, give_up: Callable[[], bool] = lambda: False) -> dict[str, Any] | None:
        """Generation side: waits for the training processes' end-of-run message and returns it; None as soon
        as `give_up()` (polled) holds."""
        message = transfers.receive(self.links, self.control, _CONTROL)
        while not message.is_ready():
            if give_up():
                return None
            time.sleep(0.02)
        return _decode(_host_value(message))


