"""The weight-sync stage's two halves: the generation copy of the actor's weights, and publishing it as a version.

The copy is in the generation layout: on the generation devices (`StagePrograms.sync`: a jitted copy on the same
devices, or a move across device sets), or, over process groups, laid over the training devices
(`StagePrograms.staged_sync`) for a transfer to take to the generation processes. Publishing version v puts it in
the parameter store, which the rollout stage reads, and over process groups offers it to the generation processes
(only the versions a rollout of this run reads: an offer is held until it is pulled).
"""

from __future__ import annotations

from typing import Any

from rpegjax.graph.trace import Trace
from rpegjax.runtime.programs import StagePrograms
from rpegjax.runtime.roles import RoleLinks
from rpegjax.runtime.versions import ParameterStore


class WeightPublisher:
    """Copies and publishes weights versions; `read_versions` are the versions the run's rollouts read (set by
    `Runtime.run`), the only ones sent over `links` (None: no process groups)."""

    def __init__(self, programs: StagePrograms, store: ParameterStore, trace: Trace, links: RoleLinks | None):
        self.programs = programs
        self.store = store
        self.trace = trace
        self.links = links
        self.read_versions: set[int] = set()

    def copy(self, state: Any) -> Any:
        """The generation copy of the actor weights of training `state` (one device program)."""
        return self.programs.sync(state) if self.links is None else self.programs.staged_sync(state)

    def publish(self, version: int, params: Any) -> None:
        """Makes weights `version` (a generation copy) readable by generation."""
        self.store.put(version, params)
        if self.links is not None and version in self.read_versions:
            self.links.send_weights(version, params, self.trace.now)
