"""Reward functions for tests/rewards/test_runner.py, in their own light module so that worker processes
import only this (a test module would drag pytest in)."""

import os
import time


def text_length(text, example):
    return float(len(text))


def misbehave(text, example):
    """Behaviour chosen by the text: hang, raise, die, return junk; otherwise 1."""
    if text == "hang":
        time.sleep(3600)
    if text == "raise":
        raise RuntimeError("deliberate failure")
    if text == "die":
        os._exit(3)
    if text == "none":
        return None
    if text == "nan":
        return float("nan")
    if text == "string":
        return "1.0"
    return 1.0


def slow(text, example):
    time.sleep(0.2)
    return 1.0


def huge(text, example):
    """1e300 fits a Python float but not the float32 rewards (it would become inf)."""
    return 1e300 if text == "huge" else 1.0


def hog(text, example):
    """Grabs memory ("memory": 2 GiB) or burns CPU ("cpu": forever), else 1."""
    if text == "memory":
        block = bytearray(2 * 2**30)
        return float(len(block))
    if text == "cpu":
        while True:
            pass
    return 1.0


def _worker_sockets():
    """The socket descriptors of this (worker) process: its pipe to the runner."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except OSError:
            continue
    return fds


def channel_breaker(text, example):
    """Breaks the worker's pipe to the runner as the text says; otherwise 1."""
    import json
    import struct

    for fd in _worker_sockets():
        if text == "garbage":  # binary garbage where a message belongs
            os.write(fd, b"\x00\x00\x00\x08\xff\xfe\x00garbage")
        elif text == "huge-header":  # a frame that claims 2 GiB
            os.write(fd, struct.pack("!I", 2**31))
        elif text == "half-frame":  # a frame header whose bytes never all come
            os.write(fd, struct.pack("!I", 4096) + b"[")
        elif text == "forged":  # a well-formed answer to an item it was not asked
            payload = json.dumps([10**6, "ok", 5.0]).encode()
            os.write(fd, struct.pack("!I", len(payload)) + payload)
        elif text == "bad-answer":  # the right frame shape, an answer that is not a reward
            payload = json.dumps([0, "ok", "not a number"]).encode()
            os.write(fd, struct.pack("!I", len(payload)) + payload)
        elif text == "close":
            os.close(fd)
    return 1.0


def batched_length(prompts, completions, answer, **kwargs):
    """TRL's batched form: one score per completion, from the completion, its prompt and a column."""
    return [float(len(c)) + (answer_ == c) + 0 * len(p) for p, c, answer_ in zip(prompts, completions, answer)]


def batched_misbehave(prompts, completions, **kwargs):
    """Batched: raises when a completion says so, None ("does not apply") for "skip", else 2."""
    if "raise" in completions:
        raise RuntimeError("batched failure")
    return [None if c == "skip" else 2.0 for c in completions]
