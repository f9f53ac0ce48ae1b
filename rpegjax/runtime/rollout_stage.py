"""The rollout stage: step t's prompts generated with the weights the asynchrony bound allows, handed over in pieces.

Generation of step t reads weights version `t - k` under asynchrony bound k (read off the graph's generate edge),
and waits for it: so a rollout never runs ahead of the bound. When the generate stage has n micro-batches, its
rollout is handed over in n pieces of whole prompt groups as they finish (continuous batching), and reward scoring
of a piece starts on the host at once (the reward stage, traced when its scores arrive).

Dynamic sampling (DAPO; `rpegjax.learners.group_filter`) is part of the stage: with it, the stage waits for each
round's rewards, keeps the groups whose rewards differ and generates further rounds of prompts, with the same
weights version, until the step's batch holds as many groups as prompts per step (or the extra-round cap is
reached). The trainer receives a batch of the usual shape, every row generated with version t - k, so the
asynchrony bound and the version bookkeeping are those of a plain rollout. Pieces of the batch are handed over as
soon as their groups are kept, the last one when the stage ends. Extra round r of step t samples with
`fold_in(fold_in(key, t), r)`.

Partial rollouts (`rpegjax.runtime.partial_rollouts`) are part of the stage too: generation keeps two batches of
groups in flight, step t takes the first batch that completes and the rest carries into step t + 1's generation,
continued with its weights; every token records the version that sampled it, and the staleness bound holds for
the oldest token of each trained group.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rpegjax.data.example import Example
from rpegjax.data.iterator import DataIterator
from rpegjax.generate.sampler import SamplerStats
from rpegjax.graph.ir import Graph, GraphError, Payload, StageKind
from rpegjax.graph.trace import Trace
from rpegjax.learners.group_filter import DynamicSamplingConfig, GroupBatchFiller
from rpegjax.runtime.partial_rollouts import PartialRolloutConfig, PartialRollouts
from rpegjax.runtime.programs import Piece, StagePrograms
from rpegjax.runtime.sampled_groups import SampledGroup, group_piece, split_groups
from rpegjax.runtime.scoring import RolloutScores, Scorer
from rpegjax.runtime.versions import generation_version


@dataclasses.dataclass
class Rollout:
    """One step's rollout as the trainer receives it; pieces are filled in by the rollout stage as they finish.
    With dynamic sampling the rollout stage also sets `scores` and the final `data_state` before it hands
    over the last piece; with partial rollouts `examples` (filled in place), `data_state` and `metrics`."""

    step: int
    version: int
    examples: list[Example]
    pieces: list[concurrent.futures.Future]
    data_state: dict[str, Any]  # the data iterator's position after this step's batch (and extra rounds)
    scores: RolloutScores | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the rollout stage's own (partial rollouts)
    carry: dict[str, Any] | None = None  # partial rollouts: the groups in flight after this step (a checkpoint's)


class RolloutStage:
    """Runs the graph's generate (and reward) stage for one step at a time.

    `weights(version)` returns the generation-layout weights of `version` (waiting for them); `prompt_ids(examples)`
    tokenises a batch of examples (host work). Step t samples with `fold_in(key, t)`, so runs are reproducible
    whatever the thread timing. `newest(v, step)`: the newest published weights in (v, step] (partial rollouts'
    weights in flight). Programs used: `programs.generate` (the pieces) and, with dynamic sampling,
    `scorer.collect` (each round's rewards, gathered over processes)."""

    def __init__(self, graph: Graph, programs: StagePrograms, data: DataIterator, *,
                 prompt_ids: Callable[[Sequence[Example]], list[list[int]]], key: jax.Array, trace: Trace,
                 weights: Callable[[int], Any], scorer: Scorer, dynamic_sampling: DynamicSamplingConfig | None,
                 partial: PartialRolloutConfig | None = None,
                 newest: Callable[[int, int], tuple[int, Any] | None] | None = None):
        generates = graph.stages_of_kind(StageKind.GENERATE)
        if len(generates) != 1:
            raise GraphError(f"the runtime needs exactly one generate stage, found {len(generates)}")
        self.stage = generates[0]
        weight_edges = [e for e in graph.in_edges(self.stage.name) if e.payload == Payload.ACTOR_GENERATE_PARAMS]
        if len(weight_edges) != 1:
            raise GraphError(f"stage {self.stage.name!r} must read {Payload.ACTOR_GENERATE_PARAMS} over one edge",
                             stage=self.stage.name)
        self.weight_edge = weight_edges[0]
        self.async_bound = self.weight_edge.version_offset - 1
        self.reward_stages = graph.stages_of_kind(StageKind.REWARD)
        self.pieces = self.stage.microbatches
        self.programs = programs
        self.data = data
        self.prompt_ids = prompt_ids
        self.key = key
        self.trace = trace
        self.weights = weights
        self.scorer = scorer
        self.dynamic_sampling = dynamic_sampling
        self.partial = None
        self.newest = newest  # newest(v, step): a published version in (v, step] and its weights, or None
        self.fetch = weights  # fetch(v): version v's weights mid-step (waits; unlike `weights`, frees no older one)
        if partial is not None:
            rollout = programs.rollout
            self.partial = PartialRollouts(partial, sampler=rollout.sampler, sampling=rollout.sampling,
                                           group_size=programs.group_size, batch_size=data.batch_size,
                                           async_bound=self.async_bound)

    def check_batch(self, prompts: int) -> None:
        """Refuses a step of `prompts` prompts that do not split into the stage's micro-batches."""
        if prompts % self.pieces:
            raise GraphError(f"stage {self.stage.name!r}: {prompts} prompts per step cannot be split into "
                             f"{self.pieces} micro-batches", stage=self.stage.name)

    def start(self, step: int) -> tuple[Rollout, Any]:
        """Step `step`'s rollout with its pieces pending, and the weights it reads (waits for them)."""
        version = self.weight_edge.read_version(step)
        assert version == generation_version(step, self.async_bound)
        params = self.weights(version)
        examples = [] if self.partial is not None else self.data.next_batch()  # partial: taken by `generate`
        self.check_batch(len(examples) if self.partial is None else self.data.batch_size)
        rollout = Rollout(step=step, version=version, examples=examples,
                          pieces=[concurrent.futures.Future() for _ in range(self.pieces)],
                          data_state=self.data.state())
        return rollout, params

    def generate(self, rollout: Rollout, params: Any) -> None:
        """Runs the generate stage of `rollout`, completing its pieces as they finish (a failure fails those not
        handed over yet, and is raised)."""
        step, version = rollout.step, rollout.version
        try:
            with self.trace.span(self.stage.name, step, version, self.stage.placement):
                if self.dynamic_sampling is not None:
                    self._generate_filled(rollout, params)
                    return
                if self.partial is not None:
                    self._generate_partial(rollout, params)
                    return
                prompts, key = self.prompt_ids(rollout.examples), jax.random.fold_in(self.key, step)
                stats, handed = SamplerStats(), 0
                for piece in self.programs.generate(params, rollout.examples, prompts, key=key, version=version,
                                                    pieces=self.pieces, stats=stats):
                    self._trace_reward(piece, step)
                    handed += 1
                    if handed == self.pieces:  # the trainer reads the metrics once the last piece is there
                        rollout.metrics.update(occupancy_metrics(stats))
                    rollout.pieces[piece.index].set_result(piece)
        except BaseException as error:
            for future in rollout.pieces:
                if not future.done():
                    future.set_exception(error)
            raise

    def _generate_partial(self, rollout: Rollout, params: Any) -> None:
        """Partial rollouts (`rpegjax.runtime.partial_rollouts`): the groups in flight topped up with new prompts,
        generated until the step's batch has completed; its pieces are handed over together."""
        self.partial.fill(self.data.next_batch, self.prompt_ids)
        rollout.data_state = self.data.state()
        step = rollout.step
        newer = None if self.newest is None else (lambda version: self.newest(version, step))
        stats = SamplerStats()
        groups, rollout.metrics = self.partial.run_step(step, rollout.version, params,
                                                        jax.random.fold_in(self.key, step), newer, stats=stats,
                                                        fetch=self.fetch)
        rollout.metrics.update(occupancy_metrics(stats))
        rollout.examples[:] = [g.example for g in groups]
        rollout.carry = self.partial.snapshot(self.data.examples)
        per_piece = len(groups) // self.pieces
        for index in range(self.pieces):
            chosen = range(index * per_piece, (index + 1) * per_piece)
            items = [(c, None) for i in chosen for c in groups[i].completions(i, rollout.version)]
            piece = self.programs.rollout.pack_piece(index, items, rollout.examples)
            self._trace_reward(piece, rollout.step)
            rollout.pieces[index].set_result(piece)

    def restore_carry(self, carry: dict[str, Any] | None) -> None:
        """Partial rollouts: the groups in flight that a resumed run's next step continues (a checkpoint's)."""
        if carry is not None and self.partial is None:
            raise ValueError("the checkpoint holds sequences carried over by partial rollouts (rollout.partial); "
                             "resuming without them would lose their prompts: resume with rollout.partial=true")
        if self.partial is not None:
            self.partial.restore(carry or {"groups": []}, self.data.examples)

    # ---- dynamic sampling ----------------------------------------------------------------------
    def _generate_filled(self, rollout: Rollout, params: Any) -> None:
        """Dynamic sampling: rounds of generation with `rollout`'s weights until its batch holds one group with
        differing rewards per prompt of the step (or the cap is reached); see the module docstring."""
        step, group_size = rollout.step, self.programs.group_size
        per_piece = len(rollout.examples) // self.pieces
        filler: GroupBatchFiller[SampledGroup] = GroupBatchFiller(len(rollout.examples), group_size,
                                                                   self.dynamic_sampling, where=f"step {step}: ")
        examples, handed = rollout.examples, 0
        sampled, decode_stats = _SampledRounds(), SamplerStats()
        own_rows = self.programs.rollout.own_rows
        while True:
            pieces = self._generate_round(rollout, params, examples, filler.rounds, sampled, decode_stats)
            rewards, groups = [], []
            for piece in sorted(pieces, key=lambda p: p.index):  # collecting rewards is a collective: one order
                task, stats = self.scorer.collect(piece)
                shaping = self.scorer.shaping(piece.completions)
                sampled.add(task, shaping, stats)
                rewards.append(task + shaping)
                groups += split_groups(piece, task, shaping, group_size)
            filler.add_round(np.concatenate(rewards), groups)
            # every piece but the last goes downstream as soon as its groups are kept: its inference can start
            while handed < self.pieces - 1 and len(filler.kept) >= (handed + 1) * per_piece:
                chunk = filler.kept[handed * per_piece:(handed + 1) * per_piece]
                rollout.pieces[handed].set_result(group_piece(handed, chunk, np.ones(per_piece, bool), own_rows))
                handed += 1
            if not filler.needs_more:
                break
            examples = self.data.next_batch()
        filled = filler.finish()
        rollout.scores = self._filled_scores(filled, sampled)
        rollout.data_state = self.data.state()
        rollout.metrics.update(occupancy_metrics(decode_stats))
        for index in range(handed, self.pieces):
            chunk = slice(index * per_piece, (index + 1) * per_piece)
            rollout.pieces[index].set_result(group_piece(index, filled.groups[chunk], filled.trained[chunk], own_rows))

    def _generate_round(self, rollout: Rollout, params: Any, examples: list[Example], round_index: int,
                        sampled: _SampledRounds, stats: SamplerStats) -> list[Piece]:
        """The pieces of one round of dynamic sampling (round 0 samples with the step's key; `stats` counts its
        decode chunks)."""
        key = jax.random.fold_in(self.key, rollout.step)
        key = jax.random.fold_in(key, round_index) if round_index else key
        pieces = []
        for piece in self.programs.generate(params, examples, self.prompt_ids(examples), key=key,
                                            version=rollout.version, pieces=self.pieces, stats=stats):
            self._trace_reward(piece, rollout.step)
            pieces.append(piece)
            sampled.tokens += sum(c.length for c in piece.completions)
        return pieces

    def _filled_scores(self, filled, sampled: _SampledRounds) -> RolloutScores:
        """The scores of a filled batch; its metrics are those of every sequence sampled in the step's rounds."""
        task = np.concatenate([g.task for g in filled.groups])
        shaping = np.concatenate([g.shaping for g in filled.groups])
        sampled_task = np.concatenate(sampled.task)
        metrics = self.scorer.metrics(sampled_task, np.concatenate(sampled.shaping), sampled.stats)
        metrics.update(filled.metrics)
        metrics["dynamic_sampling/generated_sequences"] = float(len(sampled_task))
        metrics["dynamic_sampling/generated_tokens"] = float(sampled.tokens)
        trained = np.repeat(filled.trained, self.programs.group_size)
        if trained.any():
            metrics["dynamic_sampling/batch_reward"] = float(task[trained].mean())
        return RolloutScores(task=task, shaping=shaping, metrics=metrics)

    def _trace_reward(self, piece: Piece, step: int) -> None:
        if not self.reward_stages:
            return
        start = self.trace.now()
        stage = self.reward_stages[0]

        def done(_: concurrent.futures.Future) -> None:
            self.trace.record(stage=stage.name, step=step, version=None, devices=stage.placement, start=start,
                              end=self.trace.now(), microbatch=piece.index if self.pieces > 1 else None)

        piece.rewards.add_done_callback(done)


def occupancy_metrics(stats: SamplerStats) -> dict[str, float]:
    """How busy a step's generation kept the sampler (`stats` of its calls): `generate/slot_occupancy`, running
    sequence-steps / (slots x decode steps); `generate/bucket_occupancy`, / the rows the live buckets decoded;
    `generate/decode_steps`. None of them without a decode step."""
    if not stats.decode_steps:
        return {}
    return {"generate/slot_occupancy": stats.slot_occupancy(), "generate/bucket_occupancy": stats.bucket_occupancy(),
            "generate/decode_steps": float(stats.decode_steps)}


@dataclasses.dataclass
class _SampledRounds:
    """What every round of a dynamically sampled step generated: task rewards, shaping terms, reward statistics
    (per piece) and response tokens."""

    task: list[np.ndarray] = dataclasses.field(default_factory=list)
    shaping: list[np.ndarray] = dataclasses.field(default_factory=list)
    stats: list[Any] = dataclasses.field(default_factory=list)
    tokens: int = 0

    def add(self, task: np.ndarray, shaping: np.ndarray, stats: Any) -> None:
        self.task.append(task)
        self.shaping.append(shaping)
        self.stats.append(stats)
