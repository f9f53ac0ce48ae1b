"""rpegjax.train.checkpoint on a full disk: one clear line (not orbax's tracebacks from its background threads),
the earlier checkpoints intact."""

import errno
import os

import jax.numpy as jnp
import pytest
from orbax.checkpoint._src.serialization import serialization

from rpegjax.train.checkpoint import Checkpointer, CheckpointError


def test_a_full_disk_at_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch, capfd):
    checkpoints = Checkpointer(tmp_path / "ckpt", keep=2)
    checkpoints.save(1, {"w": jnp.ones(4)}, {"next_step": 1})
    checkpoints.wait()

    async def full_disk(*args, **kwargs):  # what the array writer meets in orbax's background thread
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "ckpt"))

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    capfd.readouterr()
    with pytest.raises(CheckpointError) as raised:
        checkpoints.save(2, {"w": jnp.zeros(4)}, {"next_step": 2})
        checkpoints.wait()
    message = str(raised.value)
    assert "the disk is full (no space left on device)" in message
    assert "the earlier complete checkpoints are intact ([1])" in message and "\n" not in message
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err + printed.out, printed.err[-2000:]
    monkeypatch.undo()
    checkpoints.close()
    reopened = Checkpointer(tmp_path / "ckpt", asynchronous=False)
    assert reopened.all_steps() == [1]
    arrays, meta = reopened.restore({"w": jnp.zeros(4)})
    assert meta == {"next_step": 1} and float(arrays["w"].sum()) == 4.0
    reopened.close()
