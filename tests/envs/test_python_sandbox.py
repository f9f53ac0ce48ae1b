"""The Python sandbox: runs code; under bubblewrap (these tests need `bwrap`: apt-get install bubblewrap) every
known escape, tried by code inside the sandbox, fails: the old audit hook's global reset then a program,
a signal to a host process, a grandchild that starts its own session and writes later, writes to the package
source, ~/.cache and a directory of the test's, /etc/passwd, a connection to a host listener on 127.0.0.1; the
limits (wall time, CPU, memory, output, /tmp size) still hold; only the private /tmp is writable and it is gone
after the call. `isolation=none` is shown to protect none of it."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

import rpegjax
from rpegjax.envs.python_sandbox import (
    PythonSandbox,
    SandboxConfig,
    SandboxError,
    SandboxIsolation,
    SandboxStatus,
    python_environment,
)

# What model code would try first: the old sandbox's audit hook read this global, so resetting it disabled the hook.
RESET_HOOK = "import sys\nsys.modules['__main__'].BLOCKED = frozenset()\n"


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(SandboxConfig(timeout_s=20.0, cpu_s=5, memory_mb=256, max_output_bytes=1 << 16))


def test_runs_code_and_reports_errors(sandbox):
    result = sandbox.run("print(sum(range(10)))")
    assert result.status == SandboxStatus.OK and result.stdout == "45\n"
    assert sandbox("print(6 * 7)") == "42\n"
    assert sandbox("print('partial')\n1 / 0") == "partial\nerror: ZeroDivisionError: division by zero"
    assert sandbox("import json, math, re, fractions\nprint(math.comb(5, 2))") == "10\n"  # the standard library


def test_no_host_program_runs_after_the_hook_reset(sandbox):
    """No hook to disable: programs may start, but only the interpreter exists inside, and it sees no host file."""
    result = sandbox.run(RESET_HOOK + "import subprocess\nsubprocess.run(['id'])")
    assert result.status == SandboxStatus.ERROR and "FileNotFoundError" in result.stderr and "'id'" in result.stderr
    child = sandbox.run(RESET_HOOK + "import subprocess\nprint(subprocess.run([sys.executable, '-c', "
                        "'print(open(\"/etc/passwd\").read())'], capture_output=True, text=True).stderr)")
    assert child.status == SandboxStatus.OK and "FileNotFoundError" in child.stdout and "root:" not in child.stdout


def test_a_host_process_cannot_be_signalled(sandbox):
    """Code that kills a host process by its pid, then every process it can signal (kill -1), leaves it alive:
    the PID namespace holds only the sandbox's processes."""
    host = subprocess.Popen(["sleep", "60"])
    try:
        result = sandbox.run(RESET_HOOK + "import os\n" + "".join(
            f"try:\n    os.kill({pid}, 9)\nexcept OSError as e:\n    print(type(e).__name__)\n"
            for pid in (host.pid, -1)))
        time.sleep(0.2)
        assert host.poll() is None
        assert result.stdout == "ProcessLookupError\nProcessLookupError\n"  # kill -1: nothing else to signal
        visible = sandbox.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
        assert visible.stdout == "[1, 2]\n"  # bubblewrap's init and the interpreter
    finally:
        host.kill()
        host.wait()


def _host_processes_with(token: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if token.encode() in file.read():
                    found.append(int(pid))
        except OSError:
            pass  # ended meanwhile
    return found


def _late_writer(target: pathlib.Path, token: str, delay_s: float, parent_s: float = 0.0) -> str:
    """Code that forks a child, which starts its own session and forks a grandchild that execs an interpreter
    (with `token` in its command line, for the host's process list) that writes `target` `delay_s` later; the
    parent prints once that interpreter runs (it tells through a pipe), `parent_s` later."""
    writer = (f"import os, time; os.write(%d, b'x'); time.sleep({delay_s}); "
              f"open({str(target)!r}, 'w').write('survived')")
    return (RESET_HOOK + "import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
            "    if os.fork() == 0:\n        print('grandchild started', flush=True)\n"
            "        os.set_inheritable(w, True)\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', {writer!r} % w, {token!r}])\n"
            f"    os._exit(0)\nos.close(w)\nos.read(r, 1)\ntime.sleep({parent_s})\nprint('parent done')")


def test_no_process_outlives_the_call(sandbox, tmp_path):
    token = f"rpegjax-sandbox-test-{uuid.uuid4()}"
    target = tmp_path / "late.txt"
    result = sandbox.run(_late_writer(target, token, delay_s=5))
    assert result.status == SandboxStatus.OK and result.stdout == "grandchild started\nparent done\n"
    assert _host_processes_with(token) == []  # at once, not eventually
    time.sleep(6)
    assert not target.exists()


def test_isolation_none_protects_none_of_it(tmp_path):
    """The weaker mode, chosen by name, is what its documentation says: the grandchild survives and writes."""
    token = f"rpegjax-sandbox-test-{uuid.uuid4()}"
    target = tmp_path / "late.txt"
    result = PythonSandbox(SandboxConfig(isolation=SandboxIsolation.NONE)).run(_late_writer(target, token, delay_s=1))
    try:
        assert result.status == SandboxStatus.OK and result.stdout == "grandchild started\nparent done\n"
        assert _host_processes_with(token) != []
        deadline = time.monotonic() + 30
        while not target.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert target.read_text() == "survived"
    finally:
        for pid in _host_processes_with(token):
            os.kill(pid, signal.SIGKILL)


def test_host_files_are_neither_written_nor_read(sandbox, tmp_path):
    """The package source, ~/.cache/rpegjax, a directory of the test's, the interpreter's own directory and the
    host's /tmp: no write lands; /etc/passwd and the package source cannot be read."""
    name = f"sandbox-escape-{uuid.uuid4()}"
    package = pathlib.Path(rpegjax.__file__).parent
    targets = [package / name, pathlib.Path.home() / ".cache" / "rpegjax" / name, tmp_path / name,
               pathlib.Path(os.path.realpath(sys.executable)).parent / name, pathlib.Path(tempfile.gettempdir()) / name]
    code = RESET_HOOK + "import os\n" + "".join(
        f"try:\n    os.makedirs(os.path.dirname({str(t)!r}), exist_ok=True)\n    open({str(t)!r}, 'w').write('x')\n"
        f"    print('wrote', {str(t)!r})\nexcept OSError as e:\n    print('refused', type(e).__name__)\n"
        for t in targets)
    result = sandbox.run(code)
    assert result.status == SandboxStatus.OK
    written = [line for line in result.stdout.splitlines() if line.startswith("wrote")]
    assert written == [f"wrote {t}" for t in targets if str(t).startswith("/tmp/")]  # into its own /tmp
    assert not any(target.exists() for target in targets)
    with open("/etc/passwd") as file:
        host_passwd = file.read()
    read = sandbox.run(f"for path in ('/etc/passwd', {str(package / '__init__.py')!r}):\n    try:\n"
                       "        print(open(path).read())\n    except OSError as e:\n        print(type(e).__name__)")
    assert read.stdout == "FileNotFoundError\nFileNotFoundError\n" and host_passwd.splitlines()[0] not in read.stdout


def test_only_the_private_tmp_is_writable_and_it_is_gone_after_the_call(sandbox):
    """Every directory of the sandbox's file system (but /proc) is tried: only /tmp takes a file; the next call
    finds /tmp empty, and the host directory that held the call's output (its stdout's path) is gone."""
    walk = ("import os\nwritable = []\nfor root, dirs, files in os.walk('/'):\n    if root == '/':\n"
            "        dirs.remove('proc')\n    try:\n"
            "        open(os.path.join(root, '.write-probe'), 'w').close()\n        writable.append(root)\n"
            "    except OSError:\n        pass\nprint(writable)\nprint(os.getcwd())\n"
            "open('/tmp/left-behind', 'w').write('x')\nprint(os.readlink('/proc/self/fd/1'))")
    result = PythonSandbox(SandboxConfig(timeout_s=120.0, cpu_s=60)).run(walk)
    writable, cwd, host_stdout = result.stdout.splitlines()
    assert result.status == SandboxStatus.OK and (writable, cwd) == ("['/tmp']", "/tmp")
    assert host_stdout.endswith("/stdout") and not os.path.exists(os.path.dirname(host_stdout))
    assert sandbox("import os\nprint(os.listdir('/tmp'))") == "[]\n"


def test_no_privilege_can_be_regained(sandbox):
    """No capability; no new user namespace (where one would regain them), mount or network namespace; the
    read-only host libraries cannot be remounted writable."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for flag in (0x10000000, 0x00020000, 0x40000000):  # CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET\n"
            "    print(libc.unshare(flag), ctypes.get_errno() in (1, 28))  # EPERM, or ENOSPC: no user namespace left\n"
            "print(libc.mount(b'none', b'/usr/lib', None, 0x20 | 0x1000, None))  # MS_REMOUNT | MS_BIND, writable\n"
            "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('Cap')])")
    assert sandbox(code) == "-1 True\n-1 True\n-1 True\n-1\n" + str(["0000000000000000"] * 5) + "\n"


def test_concurrent_calls_keep_their_own_output(sandbox):
    """The episode runner calls the tool from a thread pool: each call gets its own sandbox and output."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda i: sandbox(f"print({i} * 2)"), range(24)))
    assert outputs == [f"{i * 2}\n" for i in range(24)]


def test_private_tmp_is_bounded():
    sandbox = PythonSandbox(SandboxConfig(tmp_mb=2, max_output_bytes=1 << 20))
    result = sandbox.run("for i in range(8):\n    open(f'/tmp/{i}', 'wb').write(bytes(1 << 19))\n    print(i)")
    assert result.status == SandboxStatus.ERROR and "No space left on device" in result.stderr
    assert result.stdout.split() == [str(i) for i in range((2 << 20) // (1 << 19))]  # the files that fit in 2 MiB


def test_network_is_unreachable(sandbox):
    """A connect to a live listener on the host's 127.0.0.1 is refused (the sandbox has its own loopback) and
    the listener sees no connection; no name resolves; the only interface is the sandbox's loopback."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    result = sandbox.run(RESET_HOOK + f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
                         "s.sendall(b'hello')\nprint('connected')")
    server.settimeout(0.2)  # a connection that had been made would wait in the listen queue, sandbox gone or not
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()
    assert result.status == SandboxStatus.ERROR and "ConnectionRefusedError" in result.stderr
    dns = sandbox.run("import socket\nprint(socket.getaddrinfo('pypi.org', 443))")
    assert dns.status == SandboxStatus.ERROR and "socket.gaierror" in dns.stderr
    interfaces = "print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').read().splitlines()[2:]))"
    assert sandbox(interfaces) == "['lo']\n"


def test_wall_timeout_kills():
    sandbox = PythonSandbox(SandboxConfig(timeout_s=3.0))
    result = sandbox.run("import time\nprint('started', flush=True)\ntime.sleep(60)\nprint('woke')")
    assert result.status == SandboxStatus.TIMEOUT and result.returncode == -signal.SIGKILL
    assert result.stdout == "started\n" and result.seconds < 30
    quick = PythonSandbox(SandboxConfig(timeout_s=0.5))
    assert quick("import time\ntime.sleep(60)") == "error: timeout limit exceeded"


def test_wall_timeout_kills_the_grandchildren_too(tmp_path):
    token = f"rpegjax-sandbox-test-{uuid.uuid4()}"
    code = _late_writer(tmp_path / "late.txt", token, delay_s=30, parent_s=60)
    result = PythonSandbox(SandboxConfig(timeout_s=3.0)).run(code)
    assert result.status == SandboxStatus.TIMEOUT and result.stdout == "grandchild started\n"
    assert _host_processes_with(token) == []


def test_cpu_limit_kills():
    sandbox = PythonSandbox(SandboxConfig(timeout_s=120.0, cpu_s=1))
    result = sandbox.run("while True:\n    pass")
    assert result.status == SandboxStatus.TIMEOUT and result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    assert result.seconds < 120


def test_memory_limit_stops_an_allocation():
    sandbox = PythonSandbox(SandboxConfig(memory_mb=256))
    result = sandbox.run("data = bytearray(1 << 30)\nprint('allocated')")
    assert result.status == SandboxStatus.MEMORY and result.stdout == ""
    assert sandbox.run("data = bytearray(64 << 20)\nprint(len(data))").stdout == f"{64 << 20}\n"  # below it: fine


def test_output_flood_is_stopped():
    sandbox = PythonSandbox(SandboxConfig(max_output_bytes=4096, max_output_chars=100))
    result = sandbox.run("while True:\n    print('x' * 1000)")
    assert result.status == SandboxStatus.OUTPUT
    assert len(sandbox("while True:\n    print('x' * 1000)")) == 100


def test_python_environment_step(sandbox):
    env = python_environment(sandbox)
    observation = env.step([{"role": "assistant", "content": "Let me check. <python>print(2 ** 10)</python>"}])
    assert not observation.done and observation.text == "<output>1024\n</output>"
    assert env.step([{"role": "assistant", "content": "A:1024"}]).done


def test_missing_bubblewrap_is_a_clear_error(monkeypatch, tmp_path):
    with pytest.raises(SandboxError, match=r"needs the bubblewrap program \('/nonexistent/bwrap'\), which is not "
                                           r"found: install bubblewrap \(Debian/Ubuntu: apt-get install bubblewrap"):
        PythonSandbox(SandboxConfig(bubblewrap="/nonexistent/bwrap"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxError, match=r"needs the bubblewrap program \('bwrap'\), which is not found"):
        PythonSandbox()


def test_bubblewrap_that_cannot_start_is_a_clear_error(tmp_path):
    """A bwrap that fails (as it does where user namespaces are disabled) is reported with its message."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxError, match=r"cannot start the sandbox here: bwrap: setting up uid map: Permission "
                                           r"denied\. It needs bubblewrap 0\.8 or later and unprivileged user "
                                           r"namespaces"):
        PythonSandbox(SandboxConfig(bubblewrap=str(fake)))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="SandboxConfig.memory_mb must be a positive integer, got 0"):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ValueError, match="'sometimes' is not a valid SandboxIsolation"):
        SandboxConfig(isolation="sometimes")
    with pytest.raises(ValueError, match="SandboxConfig.bubblewrap must name the bwrap program, got ''"):
        SandboxConfig(bubblewrap="")
