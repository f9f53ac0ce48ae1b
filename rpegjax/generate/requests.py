"""What the sampler's controller serves: requests (a context, a token budget, a number of samples), the initial
ones of a call and, through a `RequestFeed`, ones that arrive while it runs.

A multi-turn episode (`rpegjax.envs.rollout`) is a chain of requests: when a turn ends in a tool call, the
host runs the tool and feeds back the episode's context extended by the tool's output, which is admitted
into the next free slot like any prompt while the other slots keep decoding.

PRNG streams: sample j of a request draws its step-n token with (key_index, first_sample + j, n)
(`sampling.row_step_keys`). The initial prompts of `Sampler.stream` use key_index = prompt index and
first_sample = 0, so the samples do not depend on slots or timing; a feed chooses streams that do not
collide (an episode's later turns use their own sample indices).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Request:
    """`samples` sequences of at most `budget` new tokens each, continuing `tokens` (int32 [s]); the samples
    of one request share one prefill (a group)."""

    tokens: np.ndarray
    budget: int
    samples: int = 1
    key_index: int
    first_sample: int = 0
    kept: int | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


class RequestFeed(Protocol):
    """Requests that become ready while the controller runs (e.g. an episode's next turn after its tool ran)."""

    def poll(self) -> list[Request]:
        """The requests ready now, without waiting."""
        ...

    def wait(self) -> list[Request]:
        """Called when no sequence is running or pending: blocks until requests are ready and returns them, or
        returns [] when no more will ever come (the controller then ends)."""
        ...


class RequestQueue:
    """The requests a controller serves (`requests`, in order of arrival) and the entries still waiting for a slot
    (`pending`, a deque the controller pops and pushes back). `entry(index, request)` is what waits: a request's
    index (contiguous cache), or its index with the samples still to run (paged cache, which preempts samples)."""

    def __init__(self, requests: Iterable[Request], entry: Callable[[int, Request], Any]):
        self.requests: list[Request] = []
        self.pending: collections.deque = collections.deque()
        self._entry = entry
        self.add(requests)

    def add(self, new: Iterable[Request]) -> None:
        for request in new:
            self.pending.append(self._entry(len(self.requests), request))
            self.requests.append(request)

    def refill(self, feed: RequestFeed | None, *, idle: bool) -> bool:
        """Takes the requests `feed` has ready; when `idle` (no slot runs) and nothing waits, blocks on the feed.
        False when the controller is done: idle, nothing waiting, and no request will ever come."""
        if feed is not None:
            self.add(feed.poll())
        if self.pending or not idle:
            return True
        if feed is None:
            return False
        self.add(feed.wait())
        return bool(self.pending)


def check_request(request: Request, *, where: str, vocab_size: int, capacity: int, max_new_tokens: int,
                  max_samples: int) -> Request:
    """`request` with int32 tokens, or a ValueError naming `where` and what does not fit the sampler."""
    ids = np.asarray(request.tokens)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{where} is empty or not a flat list of token ids (shape {ids.shape})")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where} holds non-integer token ids (dtype {ids.dtype})")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{where} has token ids outside [0, {vocab_size})")
    for name in ("budget", "samples"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    if request.budget > max_new_tokens:
        raise ValueError(f"{where}: budget {request.budget} exceeds the sampler's max_new_tokens={max_new_tokens}")
    if ids.size + request.budget > capacity:
        raise ValueError(f"{where}: {ids.size} context tokens + budget {request.budget} exceed the sampler's "
                         f"capacity of {capacity} tokens")
    if request.samples > max_samples:
        raise ValueError(f"{where}: {request.samples} samples exceed the {max_samples} slots a group may use")
    if request.kept is not None and request.samples != 1:
        raise ValueError(f"{where}: a request continuing kept pages (kept={request.kept}) is one sample, got "
                         f"{request.samples}")
    return dataclasses.replace(request, tokens=ids.astype(np.int32))
