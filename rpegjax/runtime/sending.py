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
    """Sends each step's rollout, piece by piece, with this process's block of its rewards, to the training
    processes. `close(error)` sends the failure in place of every piece of the current step not sent yet;
    `unsent` is set when even that fails (the training processes will then never hear of it)."""

    def __init__(self, links: RoleLinks, *, pieces: int, first_step: int):
        self.links = links
        self.pieces = pieces
        self.step = first_step  # the step whose pieces are being sent
        self.sent: set[int] = set()
        self.unsent = threading.Event()

    def __call__(self, rollout: Rollout) -> None:
        self.step, self.sent = rollout.step, set()
        for future in rollout.pieces:
            piece = future.result()
            rewards, stats = piece.rewards.result()
            self.links.send_piece(rollout.step, self.pieces, piece, version=rollout.version, examples=rollout.examples,
                                  data_state=rollout.data_state, rewards=rewards, stats=stats)
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
