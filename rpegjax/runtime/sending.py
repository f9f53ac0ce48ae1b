"""A generation process's side of a run over process groups (`rpegjax.runtime.roles`): the weights its rollouts
read, pulled from the training processes, and each rollout piece sent to them (with partial rollouts, after the
step's last piece the groups still in flight)."""

from __future__ import annotations

import threading
from typing import Any

from rpegjax.graph.trace import Trace
from rpegjax.runtime.roles import RoleLinks
from rpegjax.runtime.rollout_stage import Rollout
from rpegjax.runtime.versions import ParameterStore


class PulledWeights:
    """Weights by version for the rollout stage of a generation process: each version pulled from the training
    processes once, kept in `store` while later steps read it.

    `newest(v, at_most)` is the generation side of weights in flight (partial rollouts' `inflight_weights`): it
    starts pulling every version in (v, `at_most`] that the training processes offer (`offered`, the publisher's
    `read_versions`) and returns the newest that has arrived, never waiting. Pulls run in the background between
    calls; a version requested that way is read from its pull when a step starts with it (an offer is pulled once).
    Only the rollout worker thread calls it."""

    def __init__(self, links: RoleLinks, store: ParameterStore, trace: Trace):
        self.links = links
        self.store = store
        self.trace = trace
        self.offered: set[int] = set()
        self._pulls: dict[int, tuple[float, Any]] = {}  # version -> (when requested, arrays arriving)

    def __call__(self, version: int) -> Any:
        self.store.prune(version)  # versions only grow: older ones are read by no later step (nor in flight)
        return self.fetch(version)

    def fetch(self, version: int) -> Any:
        """Version `version`'s weights, pulled if they are not here yet (waiting for them); keeps older versions (a
        step taking weights in flight still starts the next step with an older one under a bound k >= 2)."""
        if version not in self.store.versions():
            start, requested = self._pulls.pop(version, None) or (self.trace.now(), self.links.request_weights(version))
            self.store.put(version, self.links.open_weights(version, requested, start, self.trace.now))
        return self.store.get(version)

    def newest(self, newer_than: int, at_most: int) -> tuple[int, Any] | None:
        """The newest weights version in (`newer_than`, `at_most`] that has arrived, and its weights, or None."""
        have = set(self.store.versions())
        for version in sorted(self.offered):
            if newer_than < version <= at_most and version not in have and version not in self._pulls:
                self._pulls[version] = (self.trace.now(), self.links.request_weights(version))
        for version, (start, requested) in sorted(self._pulls.items()):
            if self.links.piece_arrived(requested):
                del self._pulls[version]
                self.store.put(version, self.links.open_weights(version, requested, start, self.trace.now))
        return self.store.newest(newer_than, at_most)


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
        if rollout.carry is not None:  # partial rollouts: the training processes checkpoint the groups in flight
            with self.trace.span("carry_send", rollout.step, rollout.version, self.placement, kind="transfer"):
                self.links.send_carry(rollout.step, rollout.carry)
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
