"""rpegjax.runtime.sending.RolloutSender: a generation process sends each piece of a step as soon as it has finished
(links stubbed), the step's reward metrics with the last piece of a dynamically sampled step, and the failure in
place of the pieces not sent; with partial rollouts the step's carry after its last piece. `PulledWeights`: a
version pulled in flight (never waited for) is the one a later step starts with, each pulled once."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from rpegjax.graph.trace import Trace
from rpegjax.rewards.runner import RewardStats
from rpegjax.runtime.programs import Piece
from rpegjax.runtime.rollout_stage import Rollout
from rpegjax.runtime.scoring import RolloutScores
from rpegjax.runtime.sending import PulledWeights, RolloutSender
from rpegjax.runtime.versions import ParameterStore

TIMEOUT = 10


class _Links:
    def __init__(self):
        self.sent: list[tuple[int, int, dict | None]] = []
        self.failures: list[tuple[int, int, str]] = []
        self.rollout_metrics: list[dict | None] = []

    def send_piece(self, step, pieces, piece, *, version, examples, data_state, rewards, stats, metrics=None,
                   rollout_metrics=None):
        self.sent.append((step, piece.index, metrics))
        self.rollout_metrics.append(rollout_metrics)

    def send_failure(self, step, index, pieces, error):
        self.failures.append((step, index, str(error)))


def _piece(index: int) -> Piece:
    scored = concurrent.futures.Future()
    scored.set_result((np.zeros(2, np.float32), RewardStats(count=2, errors=0, timeouts=0, mean_reward=0.0,
                                                            seconds=0.0)))
    return Piece(index=index, examples=[], completions=[], batch=None, rewards=scored)


def _rollout(step: int, pieces: int = 2) -> Rollout:
    return Rollout(step=step, version=step, examples=[], data_state={"epoch": 0, "position": 0},
                   pieces=[concurrent.futures.Future() for _ in range(pieces)])


def _sender(links: _Links, trace: Trace, pieces: int = 2) -> RolloutSender:
    return RolloutSender(links, trace, "rollout", pieces=pieces, first_step=0)


def _wait_until(condition) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_each_piece_leaves_as_soon_as_it_has_finished():
    links, trace = _Links(), Trace()
    sender, rollout = _sender(links, trace), _rollout(0)
    thread = threading.Thread(target=sender, args=(rollout,), daemon=True)
    thread.start()
    rollout.pieces[0].set_result(_piece(0))
    _wait_until(lambda: len(links.sent) == 1)  # sent while piece 1 still decodes
    assert links.sent == [(0, 0, None)]
    rollout.pieces[1].set_result(_piece(1))
    thread.join(TIMEOUT)
    assert links.sent == [(0, 0, None), (0, 1, None)] and not links.failures
    sends = [e for e in trace.events if e.stage == "rollout_send"]
    assert [(e.step, e.microbatch, e.devices, e.kind) for e in sends] == [(0, 0, "rollout", "transfer"),
                                                                          (0, 1, "rollout", "transfer")]


def test_the_last_piece_of_a_dynamically_sampled_step_carries_its_reward_metrics():
    links = _Links()
    sender, rollout = _sender(links, Trace()), _rollout(0)
    rollout.scores = RolloutScores(task=np.zeros(4, np.float32), shaping=np.zeros(4, np.float32),
                                   metrics={"reward": 0.5})
    for index in range(2):
        rollout.pieces[index].set_result(_piece(index))
    sender(rollout)
    assert links.sent == [(0, 0, None), (0, 1, {"reward": 0.5})]


def test_a_failure_is_sent_in_place_of_every_piece_not_sent():
    links = _Links()
    sender, rollout = _sender(links, Trace(), pieces=3), _rollout(4, pieces=3)
    rollout.pieces[0].set_result(_piece(0))
    error = RuntimeError("decode failed")
    for future in rollout.pieces[1:]:
        future.set_exception(error)
    with pytest.raises(RuntimeError, match="decode failed"):
        sender(rollout)
    sender.close(error)
    assert links.sent == [(4, 0, None)]
    assert links.failures == [(4, 1, "decode failed"), (4, 2, "decode failed")]
    assert not sender.unsent.is_set()


class _WeightLinks:
    """Weights version v arrive when the test adds v to `arrived`; every request is recorded."""

    def __init__(self):
        self.requested: list[int] = []
        self.arrived: set[int] = set()

    def request_weights(self, version: int):
        self.requested.append(version)
        return version

    def piece_arrived(self, version: int) -> bool:
        return version in self.arrived

    def open_weights(self, version, requested, start, now):
        assert requested in self.arrived, "the test never waits for weights that have not arrived"
        return f"weights {version}"


def test_weights_in_flight_are_pulled_without_waiting_and_each_once():
    links, store = _WeightLinks(), ParameterStore()
    pulled = PulledWeights(links, store, Trace())
    pulled.offered = {0, 1, 2, 3}
    links.arrived = {0}
    assert pulled(0) == "weights 0"
    assert pulled.newest(0, 2) is None  # versions 1 and 2 requested, none there yet: no wait
    assert links.requested == [0, 1, 2]
    links.arrived |= {2}
    assert pulled.newest(0, 2) == (2, "weights 2")  # the newest arrived, 1 still on its way
    assert pulled.newest(2, 2) is None and links.requested == [0, 1, 2]
    links.arrived |= {1}
    assert pulled(1) == "weights 1"  # from its pending pull, not a second one
    assert pulled(2) == "weights 2" and links.requested == [0, 1, 2]
    assert store.versions() == (2,)  # older versions are read by no later step
