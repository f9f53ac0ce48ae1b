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
