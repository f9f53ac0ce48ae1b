"""An opt-in Python tool: model-written code run in a fresh, limited interpreter with no network.

Each call starts `python -I -S` (isolated: no user site, no environment variables; no site-packages either,
so the code has the standard library only: numpy's import alone needs ctypes, which the hook below refuses) in an
empty temporary directory, with an empty environment, through a bootstrap that first
  * sets hard resource limits (`resource.setrlimit`, which the code cannot raise again): address space
    (`memory_mb`: an allocation past it raises MemoryError), CPU seconds (`cpu_s`: SIGXCPU kills it) and the
    size of any file written (the captured output included: a write past it fails);
  * installs an audit hook (`sys.addaudithook`, which cannot be removed) refusing socket creation, connects,
    DNS lookups, subprocesses, fork/exec and ctypes, so the code can neither open a connection nor start a
    program that could;
then runs the code. The host kills the whole process group past `timeout_s` of wall time (a sleeping or
blocked process uses no CPU). With `network=NAMESPACE` (the default) the interpreter also runs in a new, empty
network namespace (`unshare --net --map-root-user`): even code that slipped past the hook reaches no interface.
Where user namespaces are not permitted that mode is refused at construction with a clear error; choose
`network=AUDIT_HOOK` explicitly to rely on the hook alone.

Audit hooks are not a security boundary against a determined attacker (they stop Python-level calls, not a
native extension); the namespace is. Neither replaces a container for untrusted code at scale.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rpegjax.envs.protocol import TaggedToolEnvironment

# Runs in the sandboxed interpreter: limits, then the hook, then the code (read from stdin).
_BOOTSTRAP = r"""
import resource, sys
memory, cpu, file_size = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
code = sys.stdin.read()
BLOCKED = frozenset((
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "subprocess.Popen", "os.system",
    "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "os.kill", "os.killpg", "sys.addaudithook",
))
def _refuse(event, args):
    if event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_refuse)
del resource, _refuse
exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class NetworkIsolation(enum.StrEnum):
    NAMESPACE = "namespace"  # a new network namespace (no usable interface) plus the audit hook
    AUDIT_HOOK = "audit-hook"  # the audit hook alone


class SandboxStatus(enum.StrEnum):
    OK = "ok"
    ERROR = "error"  # the code raised (or exited non-zero)
    TIMEOUT = "timeout"  # past timeout_s of wall time, or cpu_s of CPU: killed
    MEMORY = "memory"  # past memory_mb: MemoryError
    OUTPUT = "output"  # wrote past max_output_bytes (its writes fail)


class SandboxError(RuntimeError):
    """The sandbox cannot run as configured (e.g. user namespaces are not permitted)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # what the code may write to any file (its stdout and stderr are files)
    max_output_chars: int = 2000  # what the model reads back
    network: NetworkIsolation = NetworkIsolation.NAMESPACE

    def __post_init__(self) -> None:
        object.__setattr__(self, "network", NetworkIsolation(self.network))
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < math.inf:
            raise ValueError(f"SandboxConfig.timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in ("cpu_s", "memory_mb", "max_output_bytes", "max_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxConfig.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxResult:
    status: SandboxStatus
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float


def _namespace_prefix() -> list[str]:
    return ["unshare", "--net", "--map-root-user"]


def check_namespace() -> None:
    """Raises SandboxError unless this machine lets an unprivileged process enter a new network namespace."""
    if shutil.which("unshare") is None:
        raise SandboxError("SandboxConfig.network=namespace needs the `unshare` program (util-linux), which is not "
                           "installed; install it or choose network=audit-hook")
    probe = subprocess.run([*_namespace_prefix(), "true"], capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        raise SandboxError(f"SandboxConfig.network=namespace: `unshare --net --map-root-user` fails here "
                           f"({probe.stderr.strip() or probe.returncode}); user namespaces are not permitted, so choose "
                           "network=audit-hook (the audit hook alone) or enable them")


class PythonSandbox:
    """Runs code under `config` (see the module docstring); `run(code)` -> SandboxResult, `sandbox(code)` -> the
    text the model reads."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = SandboxConfig() if config is None else config
        if self.config.network == NetworkIsolation.NAMESPACE:
            check_namespace()

    def run(self, code: str) -> SandboxResult:
        config = self.config
        command = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(config.memory_mb << 20), str(config.cpu_s),
                   str(config.max_output_bytes)]
        if config.network == NetworkIsolation.NAMESPACE:
            command = [*_namespace_prefix(), *command]
        with tempfile.TemporaryDirectory(prefix="rpegjax-sandbox-") as directory:
            out_path, err_path = os.path.join(directory, "stdout"), os.path.join(directory, "stderr")
            work = os.path.join(directory, "work")
            os.mkdir(work)
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work,
                                           env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True)
                killed = False
                try:
                    process.communicate(code.encode(), timeout=config.timeout_s)
                except subprocess.TimeoutExpired:
                    killed = True
                    os.killpg(process.pid, signal.SIGKILL)  # its own session: the code's children die too
                    process.wait()
            seconds = time.monotonic() - start
            stdout, stderr = (self._read(path) for path in (out_path, err_path))
            # Python ignores SIGXFSZ: a write past the limit raises instead, so the file size tells
            flooded = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= config.max_output_bytes
        code_ = process.returncode
        if killed or code_ in (-signal.SIGXCPU, -signal.SIGKILL):  # past timeout_s, or past cpu_s (soft, hard)
            status = SandboxStatus.TIMEOUT
        elif flooded or code_ == -signal.SIGXFSZ:
            status = SandboxStatus.OUTPUT
        elif code_ == 0:
            status = SandboxStatus.OK
        elif "MemoryError" in stderr.rstrip().rsplit("\n", 1)[-1]:
            status = SandboxStatus.MEMORY
        else:
            status = SandboxStatus.ERROR
        return SandboxResult(status=status, stdout=stdout, stderr=stderr, returncode=code_, seconds=seconds)

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
