"""rpegjax.runtime.sources.ReceivedSource: a training process's rollouts, handed over piece by piece as they arrive
from the generation processes (links stubbed: each piece arrives when the test says so)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import numpy as np
import pytest

from rpegjax.graph.trace import Trace
from rpegjax.rewards.runner import RewardStats
from rpegjax.runtime.programs import Piece
from rpegjax.runtime.roles import ReceivedRollout
from rpegjax.runtime.sources import ReceivedSource
from rpegjax.runtime.versions import RuntimeStopped

TIMEOUT = 10


@dataclasses.dataclass
class _Completion:
    length: int


def _piece(index: int, rewards: list[float]) -> Piece:
    scored = concurrent.futures.Future()
    scored.set_result((np.array(rewards, np.float32), RewardStats(count=len(rewards), errors=0, timeouts=0,
                                                                  mean_reward=0.0, seconds=0.0)))
    return Piece(index=index, examples=[], completions=[_Completion(3 + index)] * len(rewards), batch=None,
                 rewards=scored)


class _Links:
    """Piece (step, index) arrives when `arrive` is called; `open_piece` gives what `arrive` was given."""

    def __init__(self, carry_shape: tuple[int, int] | None = None):
        self.arrived: dict[tuple[int, int], ReceivedRollout | BaseException] = {}
        self.requested: list[tuple[int, int]] = []
        self.finished: list[BaseException | None] = []
        self.carry_shape = carry_shape  # partial rollouts: the step's carry (step, "carry") follows its pieces

    def request_carry(self, step: int):
        self.requested.append((step, "carry"))
        return (step, "carry")

    def open_carry(self, tree) -> dict:
        return self.arrived[tree]

    def arrive(self, step: int, index: int, received: ReceivedRollout | BaseException) -> None:
        self.arrived[(step, index)] = received

    def request_piece(self, step: int, index: int, pieces: int):
        self.requested.append((step, index))
        return (step, index)

    def piece_arrived(self, tree) -> bool:
        return tree in self.arrived

    def open_piece(self, step, index, tree, *, base_data_state):
        received = self.arrived[tree]
        if isinstance(received, BaseException):
            raise received
        return received

    def finish(self, error=None) -> None:
        self.finished.append(error)


def _received(index: int, *, version: int = 3, position: int = 1, metrics=None) -> ReceivedRollout:
    return ReceivedRollout(piece=_piece(index, [float(index), 1.0]), version=version, examples=["e"],
                           data_state={"epoch": 0, "position": position}, metrics=metrics)


def _source(links: _Links, trace: Trace, pieces: int = 2) -> ReceivedSource:
    # asynchrony bound 0: step 3 reads version 3
    return ReceivedSource(links, pieces=pieces, async_bound=0, data_state=lambda: {}, trace=trace, placement="train",
                          shaping=lambda completions: np.array([0.5 * c.length for c in completions], np.float32))


def _next_in_thread(source: ReceivedSource, step: int) -> concurrent.futures.Future:
    result = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(source.next(step))
        except BaseException as error:
            result.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return result


def test_the_rollout_is_handed_over_on_its_first_piece_and_the_rest_as_they_arrive():
    links, trace = _Links(), Trace()
    source = _source(links, trace)
    pending = _next_in_thread(source, 3)
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(timeout=0.1)  # nothing has arrived: the step waits
    assert links.requested == [(3, 0), (3, 1)]  # every piece's pull starts at once
    links.arrive(3, 0, _received(0))
    rollout = pending.result(timeout=TIMEOUT)
    assert rollout.pieces[0].done() and not rollout.pieces[1].done()  # inference can start on piece 0
    assert rollout.examples == ["e"] and rollout.version == 3
    links.arrive(3, 1, _received(1, position=2))
    assert rollout.pieces[1].result(timeout=TIMEOUT).index == 1
    assert rollout.data_state == {"epoch": 0, "position": 2}  # the last piece's position
    assert rollout.scores is None  # no dynamic sampling: the scorer scores the pieces
    arrivals = [e for e in trace.events if e.stage == "rollout_arrival"]
    assert [(e.step, e.microbatch, e.kind) for e in arrivals] == [(3, 0, "transfer"), (3, 1, "transfer")]
    assert arrivals[0].end <= arrivals[1].end
    source.close(None)
    assert links.finished == [None]


def test_a_failed_piece_fails_it_and_every_later_one():
    links = _Links()
    source = _source(links, Trace(), pieces=3)
    links.arrive(3, 0, _received(0))
    rollout = source.next(3)
    links.arrive(3, 1, RuntimeError("the rollout stage of step 3 failed in the generation processes: boom"))
    for future in rollout.pieces[1:]:
        with pytest.raises(RuntimeError, match="boom"):
            future.result(timeout=TIMEOUT)
    error = RuntimeError("step failed")
    source.close(error)
    assert links.finished == [error]


def test_a_piece_of_another_weights_version_is_refused():
    links = _Links()
    source = _source(links, Trace())
    links.arrive(3, 0, _received(0, version=2))
    with pytest.raises(RuntimeError, match="step 3: piece 0 was generated with weights version 2, the bound allows "
                                           "only 3"):
        source.next(3)


def test_closing_the_source_stops_the_wait_for_pieces_that_never_come():
    links = _Links()
    source = _source(links, Trace())
    links.arrive(3, 0, _received(0))
    rollout = source.next(3)
    source.close(RuntimeError("the trainer failed"))
    with pytest.raises(RuntimeStopped, match="step 3: the run ended while piece 1 was awaited"):
        rollout.pieces[1].result(timeout=TIMEOUT)


def test_dynamic_sampling_scores_arrive_with_the_last_piece():
    """The last piece carries the step's reward metrics (every round's, from the generation processes): the
    rollout's scores hold the received task rewards, the shaping of each row's length and those metrics."""
    links = _Links()
    source = _source(links, Trace())
    links.arrive(3, 0, _received(0))
    links.arrive(3, 1, _received(1, metrics={"reward": 0.25, "dynamic_sampling/extra_rounds": 2.0}))
    rollout = source.next(3)
    rollout.pieces[1].result(timeout=TIMEOUT)
    np.testing.assert_array_equal(rollout.scores.task, np.array([0.0, 1.0, 1.0, 1.0], np.float32))
    np.testing.assert_array_equal(rollout.scores.shaping, np.array([1.5, 1.5, 2.0, 2.0], np.float32))
    assert rollout.scores.metrics == {"reward": 0.25, "dynamic_sampling/extra_rounds": 2.0}
    source.close(None)


def test_partial_rollouts_carry_arrives_before_the_last_piece_is_handed_over():
    """The groups in flight after the step follow its last piece; the trainer sees them (to checkpoint) with it."""
    links = _Links(carry_shape=(4, 2))
    source = _source(links, Trace())
    links.arrive(3, 0, _received(0))
    rollout = source.next(3)
    assert links.requested == [(3, 0), (3, 1), (3, "carry")]
    links.arrive(3, 1, _received(1))
    with pytest.raises(concurrent.futures.TimeoutError):
        rollout.pieces[1].result(timeout=0.1)  # the last piece waits for the carry
    carry = {"groups": [{"example": 1, "prompt": [2], "samples": []}]}
    links.arrive(3, "carry", carry)
    assert rollout.pieces[1].result(timeout=TIMEOUT).index == 1
    assert rollout.carry == carry
    source.close(None)
