"""bubblewrap's part of the Python sandbox: the file system it binds (the interpreter, nothing of the project or
home), its JSON status, and the wait for the sandbox's init (which never waits on a reused pid)."""

import io
import os
import pathlib
import re
import site
import subprocess
import sysconfig
import time

import rpegjax
from rpegjax.envs.bubblewrap import await_namespace_end, interpreter, interpreter_filesystem, read_status


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def test_the_filesystem_binds_the_interpreter_and_hides_its_packages():
    filesystem = interpreter_filesystem()
    for needed in (interpreter(), os.path.realpath(sysconfig.get_paths()["stdlib"])):
        assert any(_within(needed, bind) for bind in filesystem.binds), needed
    for packages in {os.path.realpath(p) for p in site.getsitepackages()}:
        if os.path.isdir(packages) and any(_within(packages, bind) for bind in filesystem.binds):
            assert packages in filesystem.hidden
    source = str(pathlib.Path(rpegjax.__file__).resolve().parent)
    for absent in (source, str(pathlib.Path.home()), "/etc", os.getcwd()):
        assert not any(_within(absent, bind) for bind in filesystem.binds), absent
    assert "/" not in filesystem.binds


def test_read_status_merges_bwraps_json_documents():
    text = b'{ "child-pid": 41, "pid-namespace": 4026532181 }\n{ "exit-code": 3 }\n'
    assert read_status(io.BytesIO(text)) == {"child-pid": 41, "pid-namespace": 4026532181, "exit-code": 3}


def test_the_wait_ignores_a_reused_pid_and_kills_an_init_past_its_deadline():
    process = subprocess.Popen(["sleep", "60"])
    try:
        namespace = int(re.fullmatch(r"pid:\[(\d+)\]", os.readlink(f"/proc/{process.pid}/ns/pid")).group(1))
        start = time.monotonic()
        await_namespace_end({"child-pid": process.pid, "pid-namespace": namespace + 1}, deadline_s=30)
        assert time.monotonic() - start < 5 and process.poll() is None  # not the sandbox's: not waited on
        await_namespace_end({"child-pid": process.pid, "pid-namespace": namespace}, deadline_s=0.2)
        assert process.wait(timeout=5) == -9  # taken for the sandbox's init, past the deadline: killed
    finally:
        process.kill()
        process.wait()
