"""A run directory belongs to one run at a time: the run claims it by locking `RUN_DIR/.lock` (`flock`, held
open for the run's life) before it checks or writes anything there, so two runs started together on one
directory cannot both train into it.

The lock is the kernel's: it is released when the holding process exits, however it ends (kill -9 included),
so a crashed run leaves no lock behind: `.lock` stays as a file, whose text (pid, host, start time) only names
the last holder for the error a second run prints. Over several processes of one run, process 0 holds it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import pathlib
import socket

import jax
import numpy as np

from rpegjax import distributed

LOCK_NAME = ".lock"


class RunDirectoryBusy(ValueError):
    """Another live run holds the run directory."""


class RunDirectoryLock:
    """The held lock of one run directory (`claim`); `release()` (or the process's exit) frees it."""

    def __init__(self, directory: pathlib.Path, handle: int):
        self.directory = directory
        self._handle: int | None = handle

    @classmethod
    def claim(cls, directory: str | pathlib.Path) -> RunDirectoryLock:
        """Creates `directory` if needed and locks it for this process; raises RunDirectoryBusy naming the
        directory and its holder when another live process holds it."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        while True:
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(handle)
                if error.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                raise RunDirectoryBusy(f"run directory {directory} is in use by another run ({_holder(path)}): wait "
                                       "for it to end, or choose another --run-dir") from None
            try:  # the file locked must still be the one at the path (a releasing run may have just removed it)
                same = os.fstat(handle).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(handle)
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(handle, 0)
        os.write(handle, f"pid {os.getpid()} on host {socket.gethostname()}, since {started}\n".encode())
        return cls(directory, handle)

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self, *, remove: bool = False) -> None:
        """Frees the lock; `remove` also deletes `.lock` (before unlocking: a run waiting on that file then
        sees it replaced and locks the new one)."""
        if self._handle is None:
            return
        if remove:
            (self.directory / LOCK_NAME).unlink(missing_ok=True)
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        os.close(self._handle)
        self._handle = None

    def __enter__(self) -> RunDirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(path: pathlib.Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return f"held by {text}" if text else "its holder has not written its name yet"


def run_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """What a run directory holds besides its lock."""
    return [child for child in directory.iterdir() if child.name != LOCK_NAME] if directory.is_dir() else []


def check_new_run(directory: str | pathlib.Path, *, overwrite: bool) -> None:
    """Refuses to start a new run in a directory that holds files (an earlier run's checkpoints and metrics
    would mix with this one's) unless `overwrite`; raises ValueError saying what to do. Checked under the lock:
    a run that finished between another's start and its claim is seen."""
    path = pathlib.Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"run directory {directory} exists and is not a directory")
    if run_files(path) and not overwrite:
        raise ValueError(f"run directory {directory} is not empty (an earlier run?): continue it with --resume "
                         f"{directory}, replace it with --overwrite, or choose another --run-dir")


def claim_run_directory(directory: str | pathlib.Path, *, resume: bool, overwrite: bool) -> RunDirectoryLock:
    """Locks `directory` for this run, then checks it may start there (a new run: empty unless `overwrite`)."""
    path = pathlib.Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"run directory {directory} exists and is not a directory")
    lock = RunDirectoryLock.claim(path)
    try:
        if not resume:
            check_new_run(path, overwrite=overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def claim_for_run(directory: str | pathlib.Path, *, resume: bool, overwrite: bool) -> RunDirectoryLock | None:
    """`claim_run_directory` by process 0 of the run, the verdict shared: every process raises when it failed
    (process 0 with the reason). Returns the lock in process 0, None in the others. A collective over several
    processes."""
    lock, failure = None, None
    if jax.process_index() == 0:
        try:
            lock = claim_run_directory(directory, resume=resume, overwrite=overwrite)
        except (ValueError, OSError) as error:
            failure = error
    if jax.process_count() > 1:
        failed = np.asarray(distributed.gather_to_all(np.array([failure is not None], np.int32), tiled=False))
        if failed.any() and failure is None:
            raise ValueError(f"process 0 could not claim the run directory {directory} (its message says why)")
    if failure is not None:
        raise failure
    return lock


def drop_if_empty(lock: RunDirectoryLock | None, *, fresh: bool) -> None:
    """Removes the run directory `lock` holds when this launch created it (`fresh`) and a failed run wrote
    nothing into it; releases the lock."""
    if lock is None:
        return
    if fresh and not run_files(lock.directory):
        lock.release(remove=True)
        try:
            lock.directory.rmdir()
        except OSError:  # another run claimed it meanwhile
            pass
    lock.release()
