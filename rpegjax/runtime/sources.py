"""Where the step loop gets each step's rollout from: one protocol, three sources.

- `ThreadedSource`: a rollout worker thread (`rpegjax-rollout`) runs the rollout stage of step after step as soon
  as the weights it may read exist, so with asynchrony bound k >= 1 generation of the next k steps overlaps
  training (k = 0: the two alternate exactly). Its rollouts are handed over with their pieces pending.
- `InlineSource`: step t's rollout is generated in the calling thread when step t asks for it. Several processes
  on one mesh must launch the same device programs in the same order, which two threads cannot promise; the
  weights each rollout reads, and so every result, are those of the threaded source, only the overlap is lost.
  A generation process of a run over process groups uses it too (its loop runs in a thread of its own).
- `ReceivedSource`: a training process of a run over process groups receives each rollout from the generation
  processes (`rpegjax.runtime.roles.RoleLinks`); closing it tells them that the run ended, or failed.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Protocol

from rpegjax.runtime.roles import RoleLinks
from rpegjax.runtime.rollout_stage import Rollout, RolloutStage
from rpegjax.runtime.versions import RuntimeStopped, generation_version


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
    """Receives each step's rollout, piece by piece, from the generation processes; `data_state()` is the data
    iterator's state the received positions are laid over."""

    def __init__(self, links: RoleLinks, *, pieces: int, async_bound: int, data_state):
        self.links = links
        self.pieces = pieces
        self.async_bound = async_bound
        self.data_state = data_state

    def start(self, steps: range) -> None:
        pass

    def next(self, step: int) -> Rollout:
        received = [self.links.receive_piece(step, index, self.pieces, base_data_state=self.data_state())
                    for index in range(self.pieces)]
        version = generation_version(step, self.async_bound)
        if any(r.version != version for r in received):
            raise RuntimeError(f"step {step}: the rollout was generated with weights version "
                               f"{[r.version for r in received]}, the bound allows only {version}")
        futures = []
        for r in received:
            futures.append(concurrent.futures.Future())
            futures[-1].set_result(r.piece)
        last = received[-1]
        return Rollout(step=step, version=version, examples=last.examples, pieces=futures, data_state=last.data_state)

    def close(self, error: BaseException | None) -> None:
        self.links.finish(error)
