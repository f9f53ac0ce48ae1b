"""Training checkpoints with orbax: arrays (parameters, optimiser state, RNG) plus JSON metadata
(step, data position, resolved config, graph/plan).

Orbax writes each step into a temporary directory and renames it only once complete, so a run
killed mid-write leaves no checkpoint that `latest_step` would pick up; old checkpoints are
deleted only after a newer one is committed, so a crash never loses the last complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils


class CheckpointError(RuntimeError):
    pass


class _OrbaxFailureFilter(logging.Filter):
    """Drops the error records (with tracebacks) that orbax's background threads log for a failed write: the
    failure reaches the Checkpointer as an exception too, which it reports as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and "orbax" in record.pathname)


class _NumpyFromPrimary(ocp.type_handlers.NumpyHandler):
    """orbax's NumpyHandler, writing from the group's primary process. orbax's writes from process 0 only (its
    arrays are replicated on every host): a group of one training process that is not process 0 (process 0
    generates) hands every array over from the host, and would commit a checkpoint without them."""

    def __init__(self, primary: int):
        super().__init__()
        self._primary = primary

    async def _background_serialize(self, values, infos, args=None):
        writes = []
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            if jax.process_index() != self._primary:
                continue
            subdir = ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint)
            spec = ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint, process_index=subdir)
            writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio.gather(*writes)


class Checkpointer:
    """Saves and restores `(arrays, metadata)` pairs under `directory/<step>`; keeps the last `keep`."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 2, asynchronous: bool = True,
                 processes: Sequence[int] | None = None):
        """`processes`: the processes that save together (None: all of them; they also restore together); the
        first writes the shared files. A run over process groups checkpoints from its training processes alone
        (written in the same format: a colocated run restores it)."""
        if keep < 1:
            raise ValueError(f"Checkpointer keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        self._processes = None if processes is None else tuple(processes)
        multiprocessing = ocp.options.MultiprocessingOptions()
        handlers = None
        self._save_args = ocp.args.StandardSave
        if processes is not None:
            # orbax creates the directory only when every process takes part, and its items' handlers (down to the
            # array handler, which writes each array's metadata) take process 0 as primary unless told otherwise
            primary = min(processes)
            multiprocessing = ocp.options.MultiprocessingOptions(primary_host=primary, active_processes=set(processes))
            self.directory.mkdir(parents=True, exist_ok=True)
            types = ocp.type_handlers
            registry = types.create_type_handler_registry(
                (int, types.ScalarHandler()), (float, types.ScalarHandler()), (np.number, types.ScalarHandler()),
                (np.ndarray, _NumpyFromPrimary(primary)), (str, types.StringHandler()),
                (jax.Array, types.ArrayHandler(primary_host=primary)))
            handlers = {"arrays": ocp.PyTreeCheckpointHandler(multiprocessing_options=multiprocessing,
                                                              type_handler_registry=registry),
                        "metadata": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)}
            self._save_args = ocp.args.PyTreeSave
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=asynchronous,
                                               create=processes is None, multiprocessing_options=multiprocessing)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._quiet = _OrbaxFailureFilter()
        logging.getLogger("absl").addFilter(self._quiet)  # orbax logs through absl

    def save(self, step: int, arrays: Any, metadata: dict[str, Any]) -> None:
        """Starts writing checkpoint `step` (in the background when asynchronous). A write that fails (a full
        disk, a read-only directory; here or in the background write of the previous one) raises
        CheckpointError naming the directory; the committed checkpoints are left as they were."""
        if self._processes is not None and jax.process_count() > 1:
            # orbax refuses an array one process holds whole while several processes run (its guard against pmap's
            # host-local arrays): a group of one training process holds every array so. Written from the host
            # instead: the same files, which any run restores into its own shardings
            arrays = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable
                                  else x, arrays)
        with self._writing(step):
            self._manager.save(
                step,
                args=ocp.args.Composite(arrays=self._save_args(arrays), metadata=ocp.args.JsonSave(metadata)),
                force=True,
            )

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        try:
            yield
        except CheckpointError:
            raise
        except Exception as error:  # orbax wraps OS errors in its own types: find the cause to name it
            cause = _os_error(error)
            what = f"checkpoint {self.directory / str(step)}" if step is not None else f"checkpoints in {self.directory}"
            if _disk_full(error):
                reason = "the disk is full (no space left on device)"
            elif cause is not None:
                reason = f"{cause.strerror or cause} ({cause.filename})"
            else:
                reason = f"{type(error).__name__}: {error}"
            raise CheckpointError(f"cannot write {what}: {reason}; the earlier complete checkpoints are intact "
                                  f"({self.all_steps() or 'none'})") from error

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def set_aside(self, step: int, destination: pathlib.Path) -> pathlib.Path:
        """Moves damaged checkpoint `step` to `destination` (kept for inspection, out of the way of a new
        save of that step); returns where it went."""
        destination.parent.mkdir(parents=True, exist_ok=True)
        (self.directory / str(step)).rename(destination)
        self._manager.reload()
        return destination

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores the arrays with the structure, shapes, dtypes and shardings of `like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        if self._processes is None:
            arrays = ocp.args.StandardRestore(abstract)
        else:  # the handlers `processes` saved with (a run over process groups restoring in its training processes)
            arrays = ocp.args.PyTreeRestore(item=abstract,
                                            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(arrays=arrays, metadata=ocp.args.JsonRestore()))
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
        with self._writing(None):
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            with self._writing(None):
                self._manager.wait_until_finished()
        finally:
            self._manager.close()
            logging.getLogger("absl").removeFilter(self._quiet)


def _disk_full(error: BaseException) -> bool:
    """Whether `error` (or a cause along its chain) is a full disk: an OSError ENOSPC, or TensorStore's error
    for one (a ValueError naming the OS error code)."""
    cause = _os_error(error)
    if cause is not None and cause.errno == errno.ENOSPC:
        return True
    seen = set()
    while error is not None and id(error) not in seen:
        if re.search(rf"os_error_code='{errno.ENOSPC}'|No space left on device", str(error)):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, or along its chain of causes), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
