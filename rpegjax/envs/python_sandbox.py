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
one shows only its own files), no package source, no run directory, no cache. The network namespace has only its own loopback: no host interface, no host port
(127.0.0.1 included), no abstract Unix socket of the host. The PID namespace shows and signals only the
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
import json
import math
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time

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
_SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/lib", "/lib32", "/lib64", "/libx32")
_SANDBOX_TMP = "/tmp"
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


def _interpreter() -> str:
    return os.path.realpath(sys.executable)


def _within(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def interpreter_mounts() -> list[str]:
    """bwrap arguments that show, read-only, the system's shared libraries and this interpreter (executable,
    standard library, shared library directory) with its site-packages hidden; nothing else of the host."""
    arguments, roots = [], []
    for path in _SYSTEM_LIBRARIES:
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
            roots.append(path)
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], _interpreter()]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        paths.append(sysconfig.get_config_var("LIBDIR"))  # libpython
    for path in sorted({os.path.realpath(p) for p in paths}, key=len):  # a directory before what lies in it
        if os.path.exists(path) and not _within(path, roots):
            arguments += ["--ro-bind", path, path]
            roots.append(path)
    for packages in sorted({os.path.realpath(p) for p in site.getsitepackages()}):
        if os.path.isdir(packages) and _within(packages, roots):
            arguments += ["--perms", "0555", "--tmpfs", packages, "--remount-ro", packages]
    return arguments


def _bubblewrap_command(program: str, config: SandboxConfig, status_fd: int) -> list[str]:
    return [program, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
            "--setenv", "HOME", _SANDBOX_TMP, "--setenv", "LANG", "C.UTF-8", *interpreter_mounts(),
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(config.tmp_mb << 20), "--tmpfs", _SANDBOX_TMP, "--chdir", _SANDBOX_TMP,
            "--remount-ro", "/", "--json-status-fd", str(status_fd)]


def find_bubblewrap(config: SandboxConfig) -> str:
    """The path of config.bubblewrap, checked by starting the interpreter in the sandbox; SandboxError if bwrap
    is missing or cannot create the namespaces here."""
    program = shutil.which(config.bubblewrap)
    if program is None:
        raise SandboxError(f"SandboxConfig.isolation=bubblewrap needs the bubblewrap program "
                           f"({config.bubblewrap!r}), which is not found: {_INSTALL_BUBBLEWRAP}; {_WEAKER}")
    with tempfile.TemporaryFile() as status:
        command = [*_bubblewrap_command(program, config, status.fileno()), _interpreter(), "-I", "-S", "-c", "pass"]
        try:
            probe = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False,
                                   pass_fds=(status.fileno(),))
            failure = probe.returncode != 0 and (probe.stderr.strip() or f"exit status {probe.returncode}")
        except subprocess.TimeoutExpired:
            failure = "it did not finish in 60 s"
    if failure:
        raise SandboxError(f"SandboxConfig.isolation=bubblewrap: bubblewrap ({program}) cannot start the sandbox "
                           f"here: {failure}. It needs bubblewrap 0.8 or later and unprivileged user namespaces "
                           "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 where it "
                           "exists, kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10+; in a container, "
                           f"a seccomp profile that allows them); {_WEAKER}")
    return program


def _read_status(file) -> dict:
    """bwrap's JSON status lines, merged: child-pid (its init, PID 1 inside), pid-namespace, exit-code."""
    file.seek(0)
    merged, decoder, text = {}, json.JSONDecoder(), file.read().decode(errors="replace").strip()
    while text:
        record, end = decoder.raw_decode(text)
        merged.update(record)
        text = text[end:].strip()
    return merged


def _await_namespace_end(status: dict, deadline_s: float) -> None:
    """Waits until the sandbox's init (and so, the kernel guarantees, every process of its PID namespace) has
    exited: bwrap returns as soon as the code's exit status is known, while its init is still killing the rest."""
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
                os.kill(pid, signal.SIGKILL)  # its death kills the namespace
            except ProcessLookupError:
                return
            end = math.inf
        time.sleep(0.005)


class PythonSandbox:
    """Runs code under `config` (see the module docstring); `run(code)` -> SandboxResult, `sandbox(code)` -> the
    text the model reads."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = SandboxConfig() if config is None else config
        bubblewrap = self.config.isolation == SandboxIsolation.BUBBLEWRAP
        self._bubblewrap = find_bubblewrap(self.config) if bubblewrap else None

    def run(self, code: str) -> SandboxResult:
        config = self.config
        python = [_interpreter(), "-I", "-S", "-c", _BOOTSTRAP, str(config.memory_mb << 20), str(config.cpu_s),
                  str(config.max_output_bytes), str(config.max_processes if self._bubblewrap else 0)]
        with tempfile.TemporaryDirectory(prefix="rpegjax-sandbox-") as directory:
            out_path, err_path = os.path.join(directory, "stdout"), os.path.join(directory, "stderr")
            work = os.path.join(directory, "work")  # isolation=none: the working directory
            os.mkdir(work)
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err, \
                    open(os.path.join(directory, "status"), "w+b") as status_file:
                command = python if self._bubblewrap is None else [
                    *_bubblewrap_command(self._bubblewrap, config, status_file.fileno()), *python]
                returncode, killed = self._execute(command, code, out, err, work, status_file.fileno())
                if self._bubblewrap is not None:
                    status = _read_status(status_file)
                    if "child-pid" not in status and not killed:
                        raise SandboxError(f"bubblewrap ({self._bubblewrap}) could not start the sandbox: "
                                           f"{self._read(err_path).strip()}")
                    _await_namespace_end(status, deadline_s=5.0)
                    if returncode > 128 and returncode - 128 in signal.valid_signals():
                        returncode = 128 - returncode  # bwrap reports a signal as 128 + its number
            seconds = time.monotonic() - start
            stdout, stderr = (self._read(path) for path in (out_path, err_path))
            # Python ignores SIGXFSZ: a write past the limit raises instead, so the file size tells
            flooded = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= config.max_output_bytes
        return SandboxResult(status=self._classify(returncode, killed, flooded, stderr), stdout=stdout,
                             stderr=stderr, returncode=returncode, seconds=seconds)

    def _execute(self, command: list[str], code: str, out, err, work: str, status_fd: int) -> tuple[int, bool]:
        """Runs `command` in its own session past timeout_s -> (return code, killed for the timeout)."""
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work,
                                   env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True,
                                   pass_fds=(status_fd,) if self._bubblewrap else ())
        try:
            process.communicate(code.encode(), timeout=self.config.timeout_s)
            return process.returncode, False
        except subprocess.TimeoutExpired:
            # its session: bwrap (whose init then dies with it, and the namespace with the init), or with
            # isolation=none the interpreter and the children that did not start their own session
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return process.returncode, True

    @staticmethod
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


def python_environment(sandbox: PythonSandbox | None = None, *, instructions: str | None = None) -> TaggedToolEnvironment:
    """The Python tool environment: `<python>code</python>` -> `<output>stdout</output>`."""
    return TaggedToolEnvironment(
        name="python", tool=PythonSandbox() if sandbox is None else sandbox, call_start="<python>",
        call_end="</python>", result_start="<output>", result_end="</output>",
        instructions=("You may run Python: write <python>code</python> and read its printed <output>.\n"
                      if instructions is None else instructions))
