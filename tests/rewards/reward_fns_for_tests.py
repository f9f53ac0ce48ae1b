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
