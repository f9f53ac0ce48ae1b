"""The worker side of reward scoring: checking a reward value, rewards of several terms scored term by term,
and the loop a worker (a process or a thread) runs for the `RewardRunner`.

A reward is either a plain function `fn(text, example) -> float`, or a `TermedReward` (e.g. the weighted sum
of a user's functions, `rpegjax.rewards.custom.WeightedReward`) that scores each term on its own, so that one
term's failure costs only that term (it adds 0) and each term's mean and errors can be logged.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from rpegjax.data.example import Example
from rpegjax.rewards.channel import receive_frame, send_message

RewardFn = Callable[[str, Example], float]
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_ERROR_CHARS = 500


class NonFiniteReward(ValueError):
    """A reward function returned NaN, inf, or a number too large for the float32 rewards (1e300 -> inf)."""


def checked_reward(value: object, who: str = "reward function") -> float:
    """`value` as a float reward: a bool or a number float32 holds finitely; otherwise `TypeError`, or
    `NonFiniteReward` for NaN, inf or a magnitude past float32's, each naming `who`."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{who} returned {type(value).__name__} {value!r:.80}; expected a finite float")
    if not math.isfinite(value) or abs(float(value)) > _FLOAT32_MAX:
        raise NonFiniteReward(f"{who} returned {value!r}; rewards are float32, finite and at most "
                              f"{_FLOAT32_MAX:.3g} in magnitude")
    return float(value)


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:_ERROR_CHARS]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TermScores:
    """One completion scored term by term: `values[i]` is term i's (unweighted) score, None where it failed
    with `errors[i]` ('' where it did not); `nonfinite` counts the failures that were NaN/inf values;
    `total` is the weighted sum in which a failed term adds 0."""

    total: float
    values: tuple[float | None, ...]
    errors: tuple[str, ...]
    nonfinite: int = 0

    def to_message(self) -> list:
        return [self.total, list(self.values), list(self.errors), self.nonfinite]

    @classmethod
    def from_message(cls, payload: object, terms: int) -> TermScores:
        """The scores a worker sent; ValueError when `payload` is not the message of `terms` terms."""
        ok = (isinstance(payload, list) and len(payload) == 4 and isinstance(payload[1], list)
              and isinstance(payload[2], list) and len(payload[1]) == len(payload[2]) == terms)
        if ok:
            total, values, errors, nonfinite = payload
            ok = (isinstance(total, (int, float)) and isinstance(nonfinite, int)
                  and all(v is None or isinstance(v, (int, float)) for v in values)
                  and all(isinstance(e, str) for e in errors))
        if not ok:
            raise ValueError(f"not the scores of {terms} reward terms: {payload!r:.120}")
        return cls(total=float(total), values=tuple(values), errors=tuple(errors), nonfinite=nonfinite)


@runtime_checkable
class TermedReward(Protocol):
    """A reward scored term by term (see the module docstring). `term_names` name the terms (metric names);
    `batched`: whether `score_terms` should get whole chunks of completions (a term scores a batch at once)
    rather than one completion per call (each call then timed on its own)."""

    @property
    def term_names(self) -> tuple[str, ...]: ...

    @property
    def batched(self) -> bool: ...

    def score_terms(self, texts: Sequence[str], examples: Sequence[Example]) -> list[TermScores]: ...


def _replies(fn: RewardFn | TermedReward, chunk: list[tuple[int, str, Example]]) -> list[list]:
    """The messages answering `chunk` (one per item, in order)."""
    if isinstance(fn, TermedReward):
        try:
            scores = fn.score_terms([text for _, text, _ in chunk], [example for _, _, example in chunk])
            if len(scores) != len(chunk):
                raise RuntimeError(f"score_terms returned {len(scores)} scores for {len(chunk)} completions")
            replies = []
            for (index, _, _), score in zip(chunk, scores):
                try:  # finite terms can still sum past float32 (huge weights)
                    checked_reward(score.total, "the weighted sum of the reward terms")
                    replies.append([index, "terms", score.to_message()])
                except NonFiniteReward as error:
                    replies.append([index, "nonfinite", str(error)[:_ERROR_CHARS]])
            return replies
        except Exception as error:  # score_terms catches each term's errors; this is its own failure
            return [[index, "error", describe_error(error)] for index, _, _ in chunk]
    replies = []
    for index, text, example in chunk:
        try:
            replies.append([index, "ok", checked_reward(fn(text, example))])
        except NonFiniteReward as error:
            replies.append([index, "nonfinite", str(error)[:_ERROR_CHARS]])
        except Exception as error:  # a reward function's failure is data, not a crash
            replies.append([index, "error", describe_error(error)])
    return replies


def serve(sock: socket.socket, fn: RewardFn | TermedReward, before_call: Callable[[], None] = lambda: None) -> None:
    """Worker loop (a worker process's main thread, or a daemon thread): score chunks until told to stop
    (a None chunk) or the pipe closes. Items are answered one by one, except a batched `TermedReward`'s chunk,
    which is scored at once."""
    batched = isinstance(fn, TermedReward) and fn.batched
    try:
        send_message(sock, ["ready"])
        while (chunk := pickle.loads(receive_frame(sock))) is not None:
            pieces = [chunk] if batched else [[item] for item in chunk]
            for piece in pieces:
                before_call()
                for reply in _replies(fn, piece):
                    send_message(sock, reply)
    except (EOFError, OSError):  # the runner closed our pipe (shutdown, or this worker was abandoned)
        pass
    finally:
        sock.close()


def serve_process(fd: int, memory_mb: int | None = None, cpu_s: int | None = None) -> None:
    """Entry point of a worker process: read the pickled reward function from socket `fd`, limit this
    process (see `rpegjax.rewards.runner.ResourceLimits`; after the imports, which are not the user's doing),
    then serve."""
    import resource

    sock = socket.socket(fileno=fd)
    try:
        fn = pickle.loads(receive_frame(sock))
        if memory_mb is not None:
            limit = memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except Exception as error:
        send_message(sock, ["failed", describe_error(error)])
        sock.close()
        return

    def before_call() -> None:
        # RLIMIT_CPU counts the process's whole life: move the soft limit to cpu_s past what is used now
        if cpu_s is not None:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            used = int(usage.ru_utime + usage.ru_stime) + 1
            _, hard = resource.getrlimit(resource.RLIMIT_CPU)
            soft = used + cpu_s
            resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))

    serve(sock, fn, before_call)
