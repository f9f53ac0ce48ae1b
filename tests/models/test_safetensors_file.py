"""Our safetensors reader and writer against the safetensors library: windows equal numpy slicing, written files
load there bit for bit, and a process reads the rows of its window only."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rpegjax.models import safetensors_file
from rpegjax.models.safetensors_file import (
    SafetensorsError,
    SafetensorsFile,
    write_safetensors,
)

BF16 = np.dtype(jnp.bfloat16)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"matrix": rng.normal(size=(37, 11)).astype(np.float32), "half": rng.normal(size=(5, 3, 4)).astype(np.float16),
            "scalar": np.full((), 3.0), "empty": np.zeros((0, 4), np.float32), "ints": np.arange(6, dtype=np.int32)}


@pytest.mark.parametrize("block_bytes", [1, 100, 1 << 20])
def test_windows_equal_numpy_slicing(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(safetensors_file, "READ_BLOCK_BYTES", block_bytes)  # rows read one, a few, all at a time
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "t.safetensors"))
    file = SafetensorsFile(tmp_path / "t.safetensors")
    assert sorted(file.keys()) == sorted(tensors)
    assert file.shape("half") == (5, 3, 4) and file.dtype_code("half") == "F16"
    for name, value in tensors.items():
        assert file.read(name).dtype == value.dtype
        np.testing.assert_array_equal(file.read(name), value)
    windows = [(slice(3, 20), slice(2, 7)), (slice(0, 37), slice(10, 11)), (slice(36, 37), slice(0, 11)), (slice(5, 9), slice(None))]
    for window in windows:
        np.testing.assert_array_equal(file.read("matrix", window), tensors["matrix"][window])
    np.testing.assert_array_equal(file.read("half", (slice(1, 4), slice(0, 3), slice(1, 2))), tensors["half"][1:4, :, 1:2])


def test_written_files_load_in_the_safetensors_library(tmp_path):
    tensors = dict(_tensors(), brain=np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16))
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [(n, v.dtype, v.shape) for n, v in tensors.items()], iter(tensors.items()),
                      metadata={"format": "pt"})
    loaded = load_file(str(path))
    for name, value in tensors.items():
        if value.dtype != BF16:  # the library's numpy API has no bfloat16
            assert loaded[name].dtype == value.dtype
            np.testing.assert_array_equal(loaded[name], value)
    np.testing.assert_array_equal(SafetensorsFile(path).read("brain"), tensors["brain"])
    assert SafetensorsFile(path).metadata == {"format": "pt"}


def test_writer_refuses_a_tensor_that_is_not_the_announced_one(tmp_path):
    with pytest.raises(ValueError, match=r"expected tensor 'a' float32 \(2,\), got 'a' float32 \(3,\)"):
        write_safetensors(tmp_path / "x.safetensors", [("a", np.float32, (2,))], [("a", np.zeros(3, np.float32))])


def test_a_row_window_reads_only_its_rows(tmp_path, monkeypatch):
    save_file({"w": np.zeros((1000, 16), np.float32)}, str(tmp_path / "t.safetensors"))
    file = SafetensorsFile(tmp_path / "t.safetensors")
    read = []
    original = SafetensorsFile._read_rows
    monkeypatch.setattr(SafetensorsFile, "_read_rows",
                        lambda self, offset, dtype, items: read.append(items * dtype.itemsize) or original(self, offset, dtype, items))
    file.read("w", (slice(250, 500), slice(0, 16)))
    assert sum(read) == 250 * 16 * 4


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:5], "shorter than its 8-byte header length"),
    (lambda data: data[: len(data) - 4], "truncated"),
    (lambda data: (10**9).to_bytes(8, "little") + data[8:], "exceeds the file"),
    (lambda data: data[:8] + b"!" + data[9:], "not valid JSON"),
])
def test_damaged_files_are_named(tmp_path, damage, message):
    save_file({"w": np.zeros((4, 4), np.float32)}, str(tmp_path / "t.safetensors"))
    path = tmp_path / "t.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=message) as error:
        SafetensorsFile(path)
    assert str(path) in str(error.value)
