"""The peer watch: every process of a launch learns within a second that another one died, with one error naming it.

The coordination service of `jax.distributed` finds a dead process by its missing heartbeats (after
`heartbeat_timeout_s`) and then aborts every other one with a C++ check failure and a stack trace. A killed
process, though, has its TCP connections closed by its host's kernel at once. So each process keeps one
connection to process 0 (`PeerWatch`, a thread): process 0 sees any other's connection end, the others see
process 0's end. A connection that ends without the process's goodbye (`close`) is a death: the process that
sees it tells every other (process 0 relays) and each prints one line naming the dead process, its host and its
process id, then exits with `DEAD_PEER_EXIT` without waiting for anything (a survivor blocked in a collective
would otherwise wait for the heartbeat timeout). A whole host that vanishes closes nothing: the heartbeat timeout
still catches it. A process that fails with an error says so in its goodbye; the others stop with its message
`FAILURE_GRACE_S` later unless they have failed themselves by then (every process takes the same decisions, so
most errors are raised by all of them, each reporting its own).

Checkpoints are written atomically (a finished step directory appears at once), so those a dead process leaves
behind are whole: `--resume` continues from the last one, with the same or another number of processes.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

from rpegjax.distributed.hosts import ProcessAddress
from rpegjax.distributed.launch import DistributedConfig

DEAD_PEER_EXIT = 75  # EX_TEMPFAIL: the job can be resumed from its last checkpoint
FAILURE_GRACE_S = 10.0  # a peer that raised: the time this process has to fail with its own message first
DEATH_GRACE_S = 2.0  # this process raised: the time a dead peer's report (the likely cause) has to arrive
_GOODBYE, _FAILED, _STOP = b"bye", b"failed", b"stop"


class PeerWatch:
    """This process's side of the watch (see the module docstring). Built by every process of a launch after
    `jax.distributed.initialize`: process 0 listens on its `address` and publishes it through the coordinator's
    key-value store (`publish(key, value)` / `lookup(key)`); the others connect to it. `exit(code)` ends the
    process (os._exit; tests replace it)."""

    def __init__(self, process: int, count: int, address: ProcessAddress, *, publish: Callable[[str, str], None],
                 lookup: Callable[[str], str], exit: Callable[[int], None] = os._exit):
        self.process, self.count, self.exit = process, count, exit
        self.host = address.host
        self._selector = selectors.DefaultSelector()
        self._peers: dict[socket.socket, tuple[int, str]] = {}  # connection -> (process, host)
        self._said_goodbye: set[int] = set()
        self._lock = threading.Lock()
        self._failed = False  # this process raised: it reports its own error
        self._stopping = threading.Event()  # a peer died or failed: this process is being ended
        if process == 0:
            self._listener = _listen(address)
            publish("rpegjax/peer_watch", f"{address.host}|{self._listener.getsockname()[1]}")
            self._selector.register(self._listener, selectors.EVENT_READ)
        else:
            host, port = lookup("rpegjax/peer_watch").split("|")
            connection = socket.create_connection((host, int(port)), timeout=60)
            connection.sendall(f"{process}|{address.host}|{os.getpid()}\n".encode())
            connection.settimeout(None)
            self._add(connection, 0, host)
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._thread.start()

    def _add(self, connection: socket.socket, process: int, host: str) -> None:
        self._peers[connection] = (process, host)
        self._selector.register(connection, selectors.EVENT_READ)

    def close(self, error: BaseException | None = None) -> None:
        """Says goodbye (this process finished, or failed with `error`) and stops watching. A failure first waits
        `DEATH_GRACE_S` for news of a dead peer, the likely cause (a transfer pull from a killed process fails at
        once): then the watch ends this process with that report instead."""
        if error is not None and self._stopping.wait(DEATH_GRACE_S):
            threading.Event().wait()  # the watch thread is printing the dead peer's report and exiting
        message = _GOODBYE if error is None else _FAILED + b" " + f"{type(error).__name__}: {error}"[:500].encode()
        with self._lock:
            self._failed = error is not None
            for connection in list(self._peers):
                try:
                    connection.sendall(message.replace(b"\n", b" ") + b"\n")
                except OSError:
                    pass

    def _run(self) -> None:
        buffers: dict[socket.socket, bytes] = {}
        while True:
            for key, _ in self._selector.select(timeout=1.0):
                if key.fileobj is getattr(self, "_listener", None):
                    self._accept()
                    continue
                connection = key.fileobj
                try:
                    data = connection.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    self._ended(connection)
                    continue
                buffers[connection] = buffers.get(connection, b"") + data
                *lines, buffers[connection] = buffers[connection].split(b"\n")
                for line in lines:
                    self._message(connection, line)

    def _accept(self) -> None:
        connection, (peer_host, _) = self._listener.accept()
        connection.settimeout(10)
        hello = b""
        while not hello.endswith(b"\n"):
            chunk = connection.recv(256)
            if not chunk:
                connection.close()
                return
            hello += chunk
        process, host, pid = hello.decode().strip().split("|")
        connection.settimeout(None)
        with self._lock:
            self._add(connection, int(process), f"{host} pid {pid}")

    def _message(self, connection: socket.socket, line: bytes) -> None:
        process, host = self._peers[connection]
        if line == _GOODBYE:
            self._said_goodbye.add(process)
        elif line.startswith(_FAILED):  # it raised: this process most likely raises the same; give it the time
            self._said_goodbye.add(process)
            message = f"process {process} of {self.count} ({host}) failed: {line[len(_FAILED) + 1:].decode()}"
            timer = threading.Timer(FAILURE_GRACE_S, self._stop, args=(message,))
            timer.daemon = True
            timer.start()
        elif line.startswith(_STOP):  # process 0 relays another's end
            self._stop(line[len(_STOP) + 1:].decode())

    def _ended(self, connection: socket.socket) -> None:
        process, host = self._peers.pop(connection)
        self._selector.unregister(connection)
        connection.close()
        if process not in self._said_goodbye:
            self._stop(f"process {process} of {self.count} ({host}) died at {time.strftime('%H:%M:%S')}: its "
                       f"connection to process {self.process} closed without a goodbye (killed, or crashed in "
                       "native code)")

    def _stop(self, message: str) -> None:
        """Tells the others (process 0 relays), prints one line and exits; nothing after this process's own
        failure (it reports that itself)."""
        with self._lock:
            if self._failed:
                return
            self._stopping.set()
            if self.process == 0:
                for connection in list(self._peers):
                    try:
                        connection.sendall(_STOP + b" " + message.replace("\n", " ").encode() + b"\n")
                    except OSError:
                        pass
        print(f"process {self.process}: error: {message}; stopping. Completed checkpoints are intact: continue "
              "with --resume RUN_DIR (any number of processes the saved shards divide)", file=sys.stderr, flush=True)
        self.exit(DEAD_PEER_EXIT)


def _listen(address: ProcessAddress) -> socket.socket:
    port = address.watch_port
    listener = socket.socket(socket.AF_INET6 if ":" in address.host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address.host, port))
    listener.listen(1024)
    return listener


def watch_peers(cfg: DistributedConfig) -> PeerWatch | None:
    """The peer watch of this process of a joined launch (after `initialize`); None for one process. The
    watch's address is exchanged through the coordinator's key-value store: no device collective runs."""
    if not cfg.is_multi_process:
        return None
    from jax._src import distributed as jax_distributed  # the key-value store has no public entry point

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("watch_peers: jax.distributed is not initialized (call rpegjax.distributed.initialize)")
    return PeerWatch(cfg.process_id, cfg.num_processes, cfg.address(), publish=client.key_value_set,
                     lookup=lambda key: client.blocking_key_value_get(key, cfg.initialization_timeout_s * 1000))
