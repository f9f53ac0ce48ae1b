"""Training checkpoints with orbax: arrays (parameters, optimiser state, RNG) plus JSON metadata
(step, data position, resolved config, graph/plan).

Orbax writes each step into a temporary directory and renames it only once complete, so a run
killed mid-write leaves no checkpoint that `latest_step` would pick up; old checkpoints are
deleted only after a newer one is committed, so a crash never loses the last complete one.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    pass


class Checkpointer:
    """Saves and restores `(arrays, metadata)` pairs under `directory/<step>`; keeps the last `keep`."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 2, asynchronous: bool = True):
        if keep < 1:
            raise ValueError(f"Checkpointer keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=asynchronous, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, arrays: Any, metadata: dict[str, Any]) -> None:
        """Starts writing checkpoint `step` (in the background when asynchronous)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), metadata=ocp.args.JsonSave(metadata)),
            force=True,
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores the arrays with the structure, shapes, dtypes and shardings of `like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()),
            )
        except Exception as error:  # orbax raises many types; name the checkpoint that failed
            raise CheckpointError(f"cannot restore checkpoint {self.directory / str(step)}: {error}") from error
        return restored.arrays, dict(restored.metadata)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step` (default: the latest), without reading any array."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
        except Exception as error:
            raise CheckpointError(f"cannot read the metadata of checkpoint {self.directory / str(step)}: {error}") from error
        return dict(restored.metadata)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
