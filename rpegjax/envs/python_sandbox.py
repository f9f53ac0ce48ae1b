"""An opt-in Python tool: model-written code run in a fresh, limited interpreter inside an OS-level sandbox.

Each call starts `python -I -S` (isolated mode, no site-packages: the standard library only) through a bootstrap
that sets hard resource limits (`resource.setrlimit`; raising a hard limit needs a capability the code does not
have) and then runs the code read from stdin:
  * address space (`memory_mb`, per process): an allocation past it raises MemoryError;
  * CPU seconds (`cpu_s`, per process): SIGXCPU kills it;
  * the size of any file written (`max_output_bytes`; the captured stdout and stderr are files): a write past it
    fails;
  * processes and threads (`max_processes`, bubblewrap only): a fork past it fails. Linux 5.14+ counts them
    per user namespace, so only the sandbox's own (older kernels count every process of the job's user); the
    kernel exempts a job running as root, where a fork bomb is bounded by `timeout_s` alone.
The host kills the sandbox past `timeout_s` of wall time (a sleeping or blocked process uses no CPU).

`isolation=bubblewrap` (the default) runs the interpreter under bubblewrap (`bwrap` 0.8 or later, the Debian/Ubuntu
package `bubblewrap`) with new user, PID, network, IPC, UTS and cgroup namespaces, no capabilities, no further user
namespaces, an empty environment (HOME=/tmp) and its own session. Its file system is built from nothing and holds
exactly:
  * read-only: the system's shared libraries (/usr/lib, /usr/lib32, /usr/lib64, /usr/libx32 where they exist, and
    /lib* as the host has them), the interpreter's executable, standard library and shared library directory
    (for a pyenv or conda install: its `lib/`), every site-packages directory of the interpreter hidden under an
    empty read-only tmpfs;
  * /proc of its own PID namespace (only its own processes; system-wide files such as /proc/cpuinfo stay
    readable), a minimal read-only /dev (null, zero, full, random, urandom, tty, pts, an empty shm);
  * /tmp: a private tmpfs of `tmp_mb` MiB, the working directory and the only writable place, gone with the call.
Nothing else of the host exists inside: no /etc (so no /etc/passwd), no home directory (a Python installed under
one shows only its own files), no package source, no run directory, no cache. The network namespace has only its
own loopback: no host interface, no host port (127.0.0.1 included), no abstract Unix socket of the host. The PID namespace shows and signals only the
sandbox's processes, and when the call ends (the code exits, or is killed past a limit) every process inside it
is killed by the kernel, including children that forked and called setsid. Where `bwrap` is missing or cannot
create the namespaces (user namespaces disabled, a container's seccomp profile), constructing the sandbox raises
SandboxError saying what to install or enable.

`isolation=none` (chosen by name only) runs the same interpreter and limits (but `max_processes`) in an empty
temporary directory without any sandbox, killing its process group past `timeout_s`: the code can
read and write every file the job's user can (the run directory, checkpoints, ~/.cache, the package source),
use the network, signal the user's processes (the trainer included), and leave processes behind that started
their own session. Use it only for code one trusts, e.g. on a machine without user namespaces.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import IO

from rpegjax.envs.bubblewrap import (
    await_namespace_end,
    bubblewrap_command,
    interpreter,
    interpreter_filesystem,
    read_status,
)
from rpegjax.envs.protocol import TaggedToolEnvironment

# Runs in the sandboxed interpreter: the limits, then the code (read from stdin).
_BOOTSTRAP = r"""
import resource, sys
memory, cpu, file_size, processes = (int(x) for x in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
if processes:
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
code = sys.stdin.read()
del resource, memory, cpu, file_size, processes
exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
_INSTALL_BUBBLEWRAP = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
_WEAKER = ("isolation=none (rollout.sandbox_isolation in a run's config) runs without a sandbox, for trusted code "
           "only")


class SandboxIsolation(enum.StrEnum):
    BUBBLEWRAP = "bubblewrap"  # namespaces, a file system of the interpreter only, a private /tmp (the default)
    NONE = "none"  # the limits only: no file, network or process isolation (trusted code only)


class SandboxStatus(enum.StrEnum):
    OK = "ok"
    ERROR = "error"  # the code raised (or exited non-zero)
    TIMEOUT = "timeout"  # past timeout_s of wall time, or cpu_s of CPU: killed
    MEMORY = "memory"  # past memory_mb: MemoryError
    OUTPUT = "output"  # wrote past max_output_bytes (its writes fail)


class SandboxError(RuntimeError):
    """The sandbox cannot run as configured (bubblewrap missing, user namespaces not permitted)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # what the code may write to any file (its stdout and stderr are files)
    max_output_chars: int = 2000  # what the model reads back
    max_processes: int = 64  # processes and threads inside the sandbox (see the module docstring)
    tmp_mb: int = 64  # the private /tmp (bubblewrap)
    isolation: SandboxIsolation = SandboxIsolation.BUBBLEWRAP
    bubblewrap: str = "bwrap"  # the bubblewrap program: a name looked up on PATH, or a path

    def __post_init__(self) -> None:
        object.__setattr__(self, "isolation", SandboxIsolation(self.isolation))
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < math.inf:
            raise ValueError(f"SandboxConfig.timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in ("cpu_s", "memory_mb", "max_output_bytes", "max_output_chars", "max_processes", "tmp_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.bubblewrap, str) or not self.bubblewrap:
            raise ValueError(f"SandboxConfig.bubblewrap must name the bwrap program, got {self.bubblewrap!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    status: SandboxStatus
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float


class PythonSandbox:
    """Runs code under `config` (see the module docstring); `run(code)` -> SandboxResult, `sandbox(code)` -> the
    text the model reads."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = SandboxConfig() if config is None else config
        self._bubblewrap: str | None = None
        if self.config.isolation == SandboxIsolation.BUBBLEWRAP:
            self._bubblewrap = shutil.which(self.config.bubblewrap)
            if self._bubblewrap is None:
                raise SandboxError(f"SandboxConfig.isolation=bubblewrap needs the bubblewrap program "
                                   f"({self.config.bubblewrap!r}), which is not found: {_INSTALL_BUBBLEWRAP}; "
                                   f"{_WEAKER}")
            self._filesystem = interpreter_filesystem()
            self._probe()

    def _probe(self) -> None:
        """Starts the interpreter in the sandbox once: SandboxError, saying what to enable, if it cannot."""
        result, started = self._run("pass", timeout_s=60.0)
        if not started or result.status != SandboxStatus.OK:
            failure = result.stderr.strip() or f"exit status {result.returncode} ({result.status.value})"
            raise SandboxError(
                f"SandboxConfig.isolation=bubblewrap: bubblewrap ({self._bubblewrap}) cannot start the sandbox "
                f"here: {failure}. It needs bubblewrap 0.8 or later and unprivileged user namespaces (sysctl "
                "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 where it exists, "
                "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10+; in a container, a seccomp profile "
                f"that allows them); {_WEAKER}")

    def run(self, code: str) -> SandboxResult:
        result, started = self._run(code, timeout_s=self.config.timeout_s)
        if not started:  # bwrap failed before the code ran: not the code's doing
            raise SandboxError(f"bubblewrap ({self._bubblewrap}) could not start the sandbox: {result.stderr.strip()}")
        return result

    def _run(self, code: str, timeout_s: float) -> tuple[SandboxResult, bool]:
        """-> (the result, whether the code started: bwrap may fail before)."""
        config = self.config
        python = [interpreter(), "-I", "-S", "-c", _BOOTSTRAP, str(config.memory_mb << 20), str(config.cpu_s),
                  str(config.max_output_bytes), str(config.max_processes if self._bubblewrap else 0)]
        with tempfile.TemporaryDirectory(prefix="rpegjax-sandbox-") as directory:
            out_path, err_path = os.path.join(directory, "stdout"), os.path.join(directory, "stderr")
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err, \
                    open(os.path.join(directory, "status"), "w+b") as status_file:
                if self._bubblewrap is None:
                    work = os.path.join(directory, "work")
                    os.mkdir(work)
                    returncode, killed = _execute(python, code, out, err, timeout_s, cwd=work)
                    started = True
                else:
                    returncode, killed, started = self._execute_in_bubblewrap(python, code, out, err, timeout_s,
                                                                              status_file)
            seconds = time.monotonic() - start
            stdout, stderr = (self._read(path) for path in (out_path, err_path))
            # Python ignores SIGXFSZ: a write past the limit raises instead, so the file size tells
            flooded = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= config.max_output_bytes
        result = SandboxResult(status=_classify(returncode, killed, flooded, stderr), stdout=stdout, stderr=stderr,
                               returncode=returncode, seconds=seconds)
        return result, started

    def _execute_in_bubblewrap(self, python: list[str], code: str, out: IO[bytes], err: IO[bytes],
                               timeout_s: float, status_file: IO[bytes]) -> tuple[int, bool, bool]:
        """-> (return code, killed for the timeout, whether the code started), once no process of the sandbox
        is left."""
        command = [*bubblewrap_command(self._bubblewrap, self._filesystem, tmp_bytes=self.config.tmp_mb << 20,
                                       status_fd=status_file.fileno()), *python]
        returncode, killed = _execute(command, code, out, err, timeout_s, cwd="/", pass_fds=(status_file.fileno(),))
        status = read_status(status_file)
        await_namespace_end(status, deadline_s=5.0)
        if returncode > 128 and returncode - 128 in signal.valid_signals():
            returncode = 128 - returncode  # bwrap reports a signal as 128 + its number
        return returncode, killed, killed or "child-pid" in status

    def _read(self, path: str) -> str:
        with open(path, "rb") as file:
            return file.read(4 * self.config.max_output_chars).decode("utf-8", errors="replace")

    def __call__(self, code: str) -> str:
        """The tool's output as the model reads it: stdout, then the error (last line of stderr) or the limit hit."""
        result = self.run(code)
        text = result.stdout
        if result.status == SandboxStatus.ERROR:
            lines = result.stderr.strip().splitlines()
            text += f"error: {lines[-1] if lines else f'exit status {result.returncode}'}"
        elif result.status != SandboxStatus.OK:
            text += f"error: {result.status.value} limit exceeded"
        return text[: self.config.max_output_chars]


def _execute(command: list[str], code: str, out: IO[bytes], err: IO[bytes], timeout_s: float, *, cwd: str,
             pass_fds: tuple[int, ...] = ()) -> tuple[int, bool]:
    """Runs `command` in its own session, killed past `timeout_s` -> (return code, killed for the timeout)."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=cwd,
                               env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True, pass_fds=pass_fds)
    try:
        process.communicate(code.encode(), timeout=timeout_s)
        return process.returncode, False
    except subprocess.TimeoutExpired:
        # its session: bwrap (whose init then dies with it, and the namespace with the init), or with
        # isolation=none the interpreter and the children that did not start their own session
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return process.returncode, True


def _classify(returncode: int, killed: bool, flooded: bool, stderr: str) -> SandboxStatus:
    if killed or returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # past timeout_s, or past cpu_s (soft, hard)
        return SandboxStatus.TIMEOUT
    if flooded or returncode == -signal.SIGXFSZ:
        return SandboxStatus.OUTPUT
    if returncode == 0:
        return SandboxStatus.OK
    if "MemoryError" in stderr.rstrip().rsplit("\n", 1)[-1]:
        return SandboxStatus.MEMORY
    return SandboxStatus.ERROR


def python_environment(sandbox: PythonSandbox | None = None, *, instructions: str | None = None) -> TaggedToolEnvironment:
    """The Python tool environment: `<python>code</python>` -> `<output>stdout</output>`."""
    return TaggedToolEnvironment(
        name="python", tool=PythonSandbox() if sandbox is None else sandbox, call_start="<python>",
        call_end="</python>", result_start="<output>", result_end="</output>",
        instructions=("You may run Python: write <python>code</python> and read its printed <output>.\n"
                      if instructions is None else instructions))
