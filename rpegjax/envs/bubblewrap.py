"""bubblewrap (`bwrap`) as the Python tool's sandbox: the file system it shows (the interpreter only), its
command line, its JSON status, and the wait until its PID namespace has ended. `rpegjax.envs.python_sandbox`
says what the sandbox holds and refuses."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import site
import sys
import sysconfig
import time
from typing import IO

SANDBOX_TMP = "/tmp"  # the private tmpfs: the working directory and the only writable place
_SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/lib", "/lib32", "/lib64", "/libx32")


def interpreter() -> str:
    """This process's Python executable, symlinks (a virtual environment's) resolved."""
    return os.path.realpath(sys.executable)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxFilesystem:
    symlinks: tuple[tuple[str, str], ...]  # (target, path): /lib -> usr/lib, as the host has them
    binds: tuple[str, ...]  # read-only, each directory before what lies in it
    hidden: tuple[str, ...]  # site-packages directories under an empty read-only tmpfs


def _within(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def interpreter_filesystem() -> SandboxFilesystem:
    """The system's shared libraries and this interpreter (executable, standard library, shared library
    directory), its site-packages hidden; nothing else of the host."""
    symlinks, binds = [], []
    for path in _SYSTEM_LIBRARIES:
        if os.path.islink(path):
            symlinks.append((os.readlink(path), path))
        elif os.path.isdir(path):
            binds.append(path)
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], interpreter()]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        paths.append(sysconfig.get_config_var("LIBDIR"))  # libpython
    for path in sorted({os.path.realpath(p) for p in paths}, key=len):  # a directory before what lies in it
        if os.path.exists(path) and not _within(path, binds):
            binds.append(path)
    hidden = sorted(p for p in {os.path.realpath(p) for p in site.getsitepackages()}
                    if os.path.isdir(p) and _within(p, binds))
    return SandboxFilesystem(symlinks=tuple(symlinks), binds=tuple(binds), hidden=tuple(hidden))


def bubblewrap_command(program: str, filesystem: SandboxFilesystem, *, tmp_bytes: int, status_fd: int) -> list[str]:
    """bwrap's arguments up to the command: every namespace, no capability, no nested user namespace, an empty
    environment and its own session; `filesystem` read-only, its own /proc, a read-only /dev, a private /tmp of
    `tmp_bytes`, everything else read-only and empty; its JSON status written to `status_fd`."""
    mounts = [argument for target, path in filesystem.symlinks for argument in ("--symlink", target, path)]
    mounts += [argument for path in filesystem.binds for argument in ("--ro-bind", path, path)]
    mounts += [argument for path in filesystem.hidden
               for argument in ("--perms", "0555", "--tmpfs", path, "--remount-ro", path)]
    return [program, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
            "--setenv", "HOME", SANDBOX_TMP, "--setenv", "LANG", "C.UTF-8", *mounts,
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(tmp_bytes), "--tmpfs", SANDBOX_TMP, "--chdir", SANDBOX_TMP,
            "--remount-ro", "/", "--json-status-fd", str(status_fd)]


def read_status(file: IO[bytes]) -> dict:
    """bwrap's JSON status lines, merged: child-pid (its init, PID 1 inside), pid-namespace, exit-code."""
    file.seek(0)
    merged, decoder, text = {}, json.JSONDecoder(), file.read().decode(errors="replace").strip()
    while text:
        record, end = decoder.raw_decode(text)
        merged.update(record)
        text = text[end:].strip()
    return merged


def await_namespace_end(status: dict, deadline_s: float) -> None:
    """Waits until the sandbox's init (and so, the kernel guarantees, every process of its PID namespace) has
    exited: bwrap returns as soon as the code's exit status is known, while its init is still killing the rest.
    Past `deadline_s` the init is killed (its death kills the namespace)."""
    pid, namespace = status.get("child-pid"), status.get("pid-namespace")
    end = time.monotonic() + deadline_s
    while pid is not None:
        try:  # the same process (not a reused pid), not yet a zombie
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
            alive = os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{namespace}]" and state not in (b"Z", b"X")
        except OSError:
            alive = False
        if not alive:
            return
        if time.monotonic() > end:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            end = math.inf
        time.sleep(0.005)
