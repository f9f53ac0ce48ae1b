"""Where the step loop gets each step's rollout from: one protocol, three sources.

- `ThreadedSource`: a rollout worker thread (`rpegjax-rollout`) runs the rollout stage of step after step as soon
  as the weights it may read exist, so with asynchrony bound k >= 1 generation of the next k steps overlaps
  training (k = 0: the two alternate exactly). Its rollouts are handed over with their pieces pending. A
  generation process of a run over process groups uses it too: the consumer there sends each piece as it
  finishes (`rpegjax.runtime.sending.RolloutSender`), and only the worker thread launches device programs.
- `InlineSource`: step t's rollout is generated in the calling thread when step t asks for it. Several processes
  on one mesh must launch the same device programs in the same order, which two threads cannot promise; the
  weights each rollout reads, and so every result, are those of the threaded source, only the overlap is lost.
- `ReceivedSource`: a training process of a run over process groups receives each rollout from the generation
  processes (`rpegjax.runtime.roles.RoleLinks`), piece by piece as they arrive; closing it tells them that the
  run ended, or failed.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from rpegjax.graph.trace import Trace
from rpegjax.runtime.roles import ReceivedRollout, RoleLinks
from rpegjax.runtime.rollout_stage import Rollout, RolloutStage
from rpegjax.runtime.scoring import RolloutScores
from rpegjax.runtime.versions import RuntimeStopped, generation_version

_POLL_S = 0.005  # how often the receiving thread looks for a piece's arrival


class RolloutSource(Protocol):
    """Each step's rollout, asked for in step order between `start` and `close`."""

    def start(self, steps: range) -> None:
        """Prepares the rollouts of `steps` (e.g. starts a thread generating them)."""

    def next(self, step: int) -> Rollout:
        """Step `step`'s rollout (waits for it; its pieces may still be pending). Raises the rollout stage's
        failure."""

    def close(self, error: BaseException | None) -> None:
        """Ends the source after the last step, or after `error` stopped the loop. The parameter store has been
        stopped by then, so nothing waits for weights any more."""


class InlineSource:
    """Generates each step's rollout in the calling thread, when it is asked for."""

    def __init__(self, stage: RolloutStage):
        self.stage = stage

    def start(self, steps: range) -> None:
        pass

    def next(self, step: int) -> Rollout:
        rollout, params = self.stage.start(step)
        self.stage.generate(rollout, params)
        return rollout

    def close(self, error: BaseException | None) -> None:
        pass


class ThreadedSource:
    """Generates the rollouts of every step in a worker thread, each as soon as its weights exist; a rollout is
    handed over before its generation starts (pieces pending), a failure in place of the next rollout."""

    def __init__(self, stage: RolloutStage):
        self.stage = stage
        self._rollouts: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None

    def start(self, steps: range) -> None:
        self._worker = threading.Thread(target=self._produce, args=(steps,), name="rpegjax-rollout", daemon=True)
        self._worker.start()

    def _produce(self, steps: range) -> None:
        try:
            for step in steps:
                rollout, params = self.stage.start(step)
                self._rollouts.put(rollout)
                self.stage.generate(rollout, params)
        except RuntimeStopped:
            return
        except BaseException as error:  # handed to the step loop, which raises it
            self._rollouts.put(error)

    def next(self, step: int) -> Rollout:
        rollout = self._rollouts.get()
        if isinstance(rollout, BaseException):
            raise rollout
        return rollout

    def close(self, error: BaseException | None) -> None:
        if self._worker is not None:
            self._worker.join(timeout=60)


class ReceivedSource:
    """Receives each step's rollout, piece by piece, from the generation processes. `next(step)` requests every
    piece of the step (the pulls run in the background), waits for the first and returns the rollout with the
    others pending: a receiving thread (`rpegjax-receive`) hands each over as it arrives, so the step's inference
    starts on the first pieces while the generation processes still decode the rest. Each arrival is a trace
    event `rollout_arrival` on `placement` (from the request to the arrival). `data_state()` is the data iterator's
    state the received positions are laid over. With dynamic sampling the last piece brings the step's reward
    metrics: the rollout's scores (task rewards as received, `shaping(completions)` added here) are set before
    that piece is handed over. With partial rollouts the groups in flight after the step (sent after its last
    piece) become the rollout's `carry` before the last piece is handed over."""

    def __init__(self, links: RoleLinks, *, pieces: int, async_bound: int, data_state, trace: Trace,
                 placement: str, shaping: Callable[[list], np.ndarray]):
        self.links = links
        self.pieces = pieces
        self.async_bound = async_bound
        self.data_state = data_state
        self.trace = trace
        self.placement = placement
        self.shaping = shaping
        self._stop = threading.Event()
        self._receiver: threading.Thread | None = None

    def start(self, steps: range) -> None:
        pass

    def next(self, step: int) -> Rollout:
        version = generation_version(step, self.async_bound)
        requested_at = self.trace.now()
        requested = [self.links.request_piece(step, index, self.pieces) for index in range(self.pieces)]
        carry = None if self.links.carry_shape is None else self.links.request_carry(step)
        rollout = Rollout(step=step, version=version, examples=[], data_state={},
                          pieces=[concurrent.futures.Future() for _ in range(self.pieces)])
        first = self._arrive(rollout, 0, requested[0], requested_at)
        rollout.examples, rollout.data_state = first.examples, first.data_state
        self._hand_over(rollout, first, carry)
        if self.pieces > 1:
            self._receiver = threading.Thread(target=self._receive, args=(rollout, requested, requested_at, carry),
                                              name="rpegjax-receive", daemon=True)
            self._receiver.start()
        return rollout

    def _receive(self, rollout: Rollout, requested: list, requested_at: float, carry) -> None:
        """Hands over pieces 1, 2, ... of `rollout` as they arrive; a failure fails every piece not handed over."""
        for index in range(1, self.pieces):
            try:
                self._hand_over(rollout, self._arrive(rollout, index, requested[index], requested_at), carry)
            except BaseException as error:  # raised by the step executor, which waits for these pieces
                for future in rollout.pieces[index:]:
                    future.set_exception(error)
                return

    def _arrive(self, rollout: Rollout, index: int, tree, requested_at: float) -> ReceivedRollout:
        """Piece `index` of `rollout` once it has arrived (polled, so that `close` can stop the wait)."""
        self._await(tree, f"step {rollout.step}: the run ended while piece {index} was awaited")
        self.trace.record(stage="rollout_arrival", step=rollout.step, version=rollout.version, devices=self.placement,
                          start=requested_at, end=self.trace.now(), kind="transfer", microbatch=index)
        received = self.links.open_piece(rollout.step, index, tree, base_data_state=self.data_state())
        if received.version != rollout.version:
            raise RuntimeError(f"step {rollout.step}: piece {index} was generated with weights version "
                               f"{received.version}, the bound allows only {rollout.version}")
        return received

    def _await(self, tree, stopped: str) -> None:
        while not self.links.piece_arrived(tree):
            if self._stop.is_set():
                raise RuntimeStopped(stopped)
            time.sleep(_POLL_S)

    def _hand_over(self, rollout: Rollout, received: ReceivedRollout, carry) -> None:
        index = received.piece.index
        if index == self.pieces - 1:
            if carry is not None:  # sent right after the last piece: checkpoints of this step hold it
                self._await(carry, f"step {rollout.step}: the run ended while its carry was awaited")
                rollout.carry = self.links.open_carry(carry)
            rollout.data_state = received.data_state  # dynamic sampling: the position after every round
            rollout.metrics.update(received.rollout_metrics or {})  # read by the trainer once the last piece is here
            if received.metrics is not None:
                pieces = [future.result() for future in rollout.pieces[:-1]] + [received.piece]
                task = np.concatenate([piece.rewards.result()[0] for piece in pieces]).astype(np.float32)
                shaping = np.concatenate([self.shaping(piece.completions) for piece in pieces])
                rollout.scores = RolloutScores(task=task, shaping=shaping, metrics=dict(received.metrics))
        rollout.pieces[index].set_result(received.piece)

    def close(self, error: BaseException | None) -> None:
        self._stop.set()
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        self.links.finish(error)
