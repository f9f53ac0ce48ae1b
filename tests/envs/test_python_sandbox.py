"""The Python sandbox: runs code, refuses the network, kills on wall time and CPU time, stops memory and output
floods; the namespace mode really leaves the code without a network interface."""

import signal
import socket

import pytest

from rpegjax.envs.python_sandbox import (
    NetworkIsolation,
    PythonSandbox,
    SandboxConfig,
    SandboxError,
    SandboxStatus,
    check_namespace,
    python_environment,
)


def _namespace_available() -> bool:
    try:
        check_namespace()
    except SandboxError:
        return False
    return True


MODES = [NetworkIsolation.AUDIT_HOOK,
         pytest.param(NetworkIsolation.NAMESPACE, marks=pytest.mark.skipif(
             not _namespace_available(), reason="user namespaces are not permitted on this machine"))]


@pytest.fixture(params=MODES)
def sandbox(request):
    return PythonSandbox(SandboxConfig(network=request.param, timeout_s=20.0, cpu_s=2, memory_mb=256,
                                       max_output_bytes=1 << 16))


def test_runs_code_and_reports_errors(sandbox):
    result = sandbox.run("print(sum(range(10)))")
    assert result.status == SandboxStatus.OK and result.stdout == "45\n"
    assert sandbox("print(6 * 7)") == "42\n"
    assert sandbox("print('partial')\n1 / 0") == "partial\nerror: ZeroDivisionError: division by zero"


def test_network_is_refused(sandbox):
    """A connect to a live server on 127.0.0.1 and a DNS lookup both fail, and the server sees no connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    result = sandbox.run(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
                         "s.sendall(b'hello')\nprint('connected')")
    server.settimeout(0.2)  # a connection that had been made would wait in the listen queue, sandbox gone or not
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()
    assert result.status == SandboxStatus.ERROR and "connected" not in result.stdout
    assert "PermissionError: sandbox: socket.__new__ is not allowed" in result.stderr
    dns = sandbox.run("import socket\nprint(socket.getaddrinfo('localhost', 80))")
    assert dns.status == SandboxStatus.ERROR and "socket.getaddrinfo is not allowed" in dns.stderr
    # nor can it start a program that would connect, or reach the C library directly
    for code, event in [("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
                        ("import os\nos.system('true')", "os.system"),
                        ("import ctypes\nctypes.CDLL(None)", "ctypes.dlopen")]:
        result = sandbox.run(code)
        assert result.status == SandboxStatus.ERROR and f"{event} is not allowed" in result.stderr


@pytest.mark.skipif(not _namespace_available(), reason="user namespaces are not permitted on this machine")
def test_namespace_mode_has_no_network_interface():
    """Beyond the hook: in namespace mode the interpreter's network namespace holds only a loopback device
    (down), unlike the host's."""
    code = "print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').read().splitlines()[2:]))"
    inside = PythonSandbox(SandboxConfig(network=NetworkIsolation.NAMESPACE)).run(code)
    outside = PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK)).run(code)
    assert inside.stdout == "['lo']\n"
    assert inside.stdout != outside.stdout or outside.stdout == "['lo']\n"


def test_wall_timeout_kills():
    sandbox = PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK, timeout_s=3.0))
    result = sandbox.run("import time\nprint('started', flush=True)\ntime.sleep(60)\nprint('woke')")
    assert result.status == SandboxStatus.TIMEOUT and result.returncode == -signal.SIGKILL
    assert result.stdout == "started\n" and result.seconds < 30
    quick = PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK, timeout_s=0.5))
    assert quick("import time\ntime.sleep(60)") == "error: timeout limit exceeded"


def test_cpu_limit_kills():
    sandbox = PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK, timeout_s=120.0, cpu_s=1))
    result = sandbox.run("while True:\n    pass")
    assert result.status == SandboxStatus.TIMEOUT and result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    assert result.seconds < 120


def test_memory_limit_stops_an_allocation():
    sandbox = PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK, memory_mb=256))
    result = sandbox.run("data = bytearray(1 << 30)\nprint('allocated')")
    assert result.status == SandboxStatus.MEMORY and result.stdout == ""
    assert sandbox.run("data = bytearray(64 << 20)\nprint(len(data))").stdout == f"{64 << 20}\n"  # below it: fine


def test_output_flood_is_stopped():
    sandbox = PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK, max_output_bytes=4096,
                                          max_output_chars=100))
    result = sandbox.run("while True:\n    print('x' * 1000)")
    assert result.status == SandboxStatus.OUTPUT
    assert len(sandbox("while True:\n    print('x' * 1000)")) == 100


def test_python_environment_step():
    env = python_environment(PythonSandbox(SandboxConfig(network=NetworkIsolation.AUDIT_HOOK)))
    observation = env.step([{"role": "assistant", "content": "Let me check. <python>print(2 ** 10)</python>"}])
    assert not observation.done and observation.text == "<output>1024\n</output>"
    assert env.step([{"role": "assistant", "content": "A:1024"}]).done


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="SandboxConfig.memory_mb must be a positive integer, got 0"):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ValueError, match="'sometimes' is not a valid NetworkIsolation"):
        SandboxConfig(network="sometimes")
