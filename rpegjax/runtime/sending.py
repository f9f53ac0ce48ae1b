"""A generation process's side of a run over process groups (`rpegjax.runtime.roles`): the weights its rollouts
read, pulled from the training processes, and each rollout piece sent to them."""

from __future__ import annotations

import threading
from typing import Any

from rpegjax.graph.trace import Trace
from rpegjax.runtime.roles import RoleLinks
from rpegjax.runtime.rollout_stage import Rollout
from rpegjax.runtime.versions import ParameterStore


class PulledWeights:
    """Weights by version for the rollout stage of a generation process: each version pulled from the training
    processes once, kept in `store` while later steps read it."""

    def __init__(self, links: RoleLinks, store: ParameterStore, trace: Trace):
        self.links = links
        self.store = store
        self.trace = trace

    def __call__(self, version: int) -> Any:
        if version not in self.store.versions():
            self.store.prune(version)  # versions only grow: older ones are read by no later step
            self.store.put(version, self.links.receive_weights(version, self.trace.now))
        return self.store.get(version)


class RolloutSender:
    """Sends each step's rollout, piece by piece as each finishes and its rewards are scored, with this process's
    block of its rewards, to the training processes; the rollout is handed over with its pieces pending
    (`ThreadedSource`), so the first pieces leave while the rest still decode. Each send is a trace event
    (`rollout_send` on `placement`, the generate stage's). `close(error)` sends the failure in place of every
    piece of the current step not sent yet; `unsent` is set when even that fails (the training processes will
    then never hear of it)."""

    def __init__(self, links: RoleLinks, trace: Trace, placement: str, *, pieces: int, first_step: int):
        self.links = links
        self.trace = trace
        self.placement = placement
        self.pieces = pieces
        self.step = first_step  # the step whose pieces are being sent
        self.sent: set[int] = set()
        self.unsent = threading.Event()

    def __call__(self, rollout: Rollout) -> None:
        self.step, self.sent = rollout.step, set()
        for future in rollout.pieces:
            piece = future.result()
            rewards, stats = piece.rewards.result()
            last = piece.index == self.pieces - 1
            # dynamic sampling: the step's reward metrics cover every round; set before the last piece is handed over
            metrics = rollout.scores.metrics if last and rollout.scores is not None else None
            with self.trace.span("rollout_send", rollout.step, rollout.version, self.placement, kind="transfer",
                                 microbatch=piece.index):
                self.links.send_piece(rollout.step, self.pieces, piece, version=rollout.version,
                                      examples=rollout.examples, data_state=rollout.data_state, rewards=rewards,
                                      stats=stats, metrics=metrics,
                                      rollout_metrics=dict(rollout.metrics) if last else None)
            self.sent.add(piece.index)
        self.step, self.sent = rollout.step + 1, set()

    def close(self, error: BaseException | None) -> None:
        if error is None:
            return
        try:
            for index in range(self.pieces):
                if index not in self.sent:
                    self.links.send_failure(self.step, index, self.pieces, error)
        except BaseException:
            self.unsent.set()
