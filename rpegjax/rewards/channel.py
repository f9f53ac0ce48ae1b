"""The pipe between a `RewardRunner` and a reward worker: length-prefixed frames over a socket.

The worker runs the user's code, and that code can reach the worker's end (it is an open file descriptor of
the same process): it may write bytes into it, read from it or close it. So the runner's end trusts nothing it
reads: worker messages are JSON (never unpickled: a forged pickle would run code in the trainer), a frame has
a size limit, and the runner reads without blocking, so a half-written frame never stalls it (the call's
deadline still runs, and the worker is killed when it passes). Anything that is not a well-formed message
(`ChannelBroken`) means the worker is broken: the runner counts the call as failed and starts another.

Runner -> worker frames hold pickles (the reward function, chunks of examples): the runner is trusted.
"""

from __future__ import annotations

import json
import socket
import struct

_HEADER = struct.Struct("!I")
MAX_WORKER_FRAME = 1 << 20
"""Bytes a worker message may take: replies are a few numbers and an error line."""


class ChannelBroken(Exception):
    """The worker's end of the pipe is closed or sent something that is not a well-formed message."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Writes one frame (blocking)."""
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 16))
        if not part:
            raise EOFError("the reward runner closed the pipe")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def receive_frame(sock: socket.socket) -> bytes:
    """Reads one frame (blocking; the worker side). EOFError when the runner closed the pipe."""
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return _receive_exactly(sock, size)


def send_message(sock: socket.socket, message: list) -> None:
    """A worker's message: a JSON list (`["ready"]`, `[index, status, value]`, `["failed", text]`)."""
    send_frame(sock, json.dumps(message, allow_nan=False).encode())


class MessageReader:
    """The runner's reading end: `read()` takes what the socket holds now (it never blocks) and returns the
    complete messages in it, and a `ChannelBroken` (None while the pipe is sound) for end of file, an oversized
    frame, or a frame that is not a JSON list; messages before the break are still returned."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> tuple[list[list], ChannelBroken | None]:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return [], None
        except OSError as error:
            return [], ChannelBroken(f"the worker's pipe failed ({error})")
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > MAX_WORKER_FRAME:
                return messages, ChannelBroken(f"the worker sent a frame of {size} bytes (at most {MAX_WORKER_FRAME}):"
                                               " not a message; did the reward function write to the worker's pipe?")
            if len(self._buffer) < _HEADER.size + size:
                break
            payload = bytes(self._buffer[_HEADER.size:_HEADER.size + size])
            del self._buffer[:_HEADER.size + size]
            try:
                message = json.loads(payload)
            except (UnicodeDecodeError, json.JSONDecodeError):
                return messages, ChannelBroken(f"the worker sent undecodable bytes {payload[:40]!r}; did the reward "
                                               "function write to the worker's pipe?")
            if not isinstance(message, list) or not message:
                return messages, ChannelBroken(f"the worker sent {message!r:.80}, not a message")
            messages.append(message)
        return messages, None if data else ChannelBroken("the worker closed its pipe")
