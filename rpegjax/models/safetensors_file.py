"""The safetensors format read by byte ranges and written as a stream, so that neither side holds a whole file.

A file is an 8-byte little-endian header length, a JSON header `{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {...}}` and the row-major tensor bytes. `SafetensorsFile.read` copies only the
rows a requested window touches into this process's memory, with plain reads rather than a memory map: pages
of a mapped file that a column window touches would all count as this process's resident memory (all of a
[v, d] tensor for a window of its columns), which is what a process loading its own shards must avoid. A
window that keeps only some columns reads its rows in blocks of at most `READ_BLOCK_BYTES`.
`write_safetensors` writes the header from the tensors' shapes, then each tensor as it is produced.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

DTYPES = {"F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16), "F32": np.dtype("<f4"),
          "F64": np.dtype("<f8"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
          "I64": np.dtype("<i8"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
CODES = {dtype: code for code, dtype in DTYPES.items()}
READ_BLOCK_BYTES = 64 << 20
_MAX_HEADER_BYTES = 100 << 20  # as the safetensors library: a larger header is corrupt, not a checkpoint


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file (the message names the file)."""


class SafetensorsFile:
    """The header of one safetensors file, and reads of windows of its tensors.

    The header is checked on opening: valid JSON, known dtypes, each tensor's byte range exactly its
    shape's size, ranges inside the file. Reading a tensor whose dtype is not in `DTYPES` raises.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                prefix = handle.read(8)
                if len(prefix) < 8:
                    raise SafetensorsError("shorter than its 8-byte header length")
                (header_bytes,) = struct.unpack("<Q", prefix)
                if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
                    raise SafetensorsError(f"header length {header_bytes} exceeds the file ({size} bytes)")
                header = json.loads(handle.read(header_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SafetensorsError(f"{self.path}: header is not valid JSON ({error})") from None
        except SafetensorsError as error:
            raise SafetensorsError(f"{self.path}: {error}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self._data_start = 8 + header_bytes
        self.metadata = header.pop("__metadata__", None)
        self._entries: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name -> (dtype code, shape, offset)
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, size - self._data_start)

    def _check_entry(self, name: str, entry, data_bytes: int) -> tuple[str, tuple[int, ...], int]:
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SafetensorsError(f"{self.path}: tensor {name!r} has a malformed header entry {entry!r}") from None
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
            raise SafetensorsError(f"{self.path}: tensor {name!r} has a malformed header entry {entry!r}")
        itemsize = DTYPES[code].itemsize if code in DTYPES else None
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise SafetensorsError(f"{self.path}: tensor {name!r} spans {end - begin} bytes, its shape {shape} "
                                   f"of {code} needs {math.prod(shape) * itemsize}")
        if not begin <= end <= data_bytes:
            raise SafetensorsError(f"{self.path}: tensor {name!r} ends at byte {end} of a {data_bytes}-byte data "
                                   "section (truncated?)")
        return code, shape, begin

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype_code(self, name: str) -> str:
        return self._entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str, window: Sequence[slice] | None = None) -> np.ndarray:
        """The tensor `name`, or its `window` (one unit-step slice per dimension), as a new numpy array."""
        code, shape, begin = self._entries[name]
        if code not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {code}, which we do not read")
        dtype = DTYPES[code]
        window = tuple(slice(None) for _ in shape) if window is None else tuple(window)
        bounds = [s.indices(n) for s, n in zip(window, shape, strict=True)]
        if any(step != 1 for _, _, step in bounds):
            raise ValueError(f"{self.path}: tensor {name!r}: windows take unit steps, got {window}")
        if not shape:
            return self._read_rows(begin, dtype, 1).reshape(())
        row_shape, row_items = shape[1:], math.prod(shape[1:])
        inner = tuple(slice(start, stop) for start, stop, _ in bounds[1:])
        whole_rows = all(start == 0 and stop == n for (start, stop, _), n in zip(bounds[1:], row_shape))
        first, last = bounds[0][0], max(bounds[0][0], bounds[0][1])
        out_shape = (last - first, *(max(stop - start, 0) for start, stop, _ in bounds[1:]))
        if whole_rows or row_items == 0:
            return self._read_rows(begin + first * row_items * dtype.itemsize, dtype, (last - first) * row_items
                                   ).reshape(out_shape)
        out = np.empty(out_shape, dtype)
        rows_per_block = max(1, READ_BLOCK_BYTES // max(row_items * dtype.itemsize, 1))
        for row in range(first, last, rows_per_block):
            count = min(rows_per_block, last - row)
            block = self._read_rows(begin + row * row_items * dtype.itemsize, dtype, count * row_items)
            out[row - first : row - first + count] = block.reshape(count, *row_shape)[(slice(None), *inner)]
        return out

    def _read_rows(self, offset: int, dtype: np.dtype, items: int) -> np.ndarray:
        out = np.empty(items, dtype)
        view, done = memoryview(out.view(np.uint8)), 0
        with open(self.path, "rb", buffering=0) as handle:
            while done < len(view):
                got = os.preadv(handle.fileno(), [view[done:]], self._data_start + offset + done)
                if got == 0:
                    raise SafetensorsError(f"{self.path}: file ends inside its data section (truncated?)")
                done += got
        return out


def write_safetensors(path: str | os.PathLike, specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                      tensors: Iterable[tuple[str, np.ndarray]], *, metadata: dict[str, str] | None = None) -> None:
    """Writes a safetensors file of the tensors `specs` lists ((name, dtype, shape), in file order), taking
    them one at a time from `tensors` (same names, same order), so that only one is ever in memory here.

    Raises ValueError when a tensor does not match its spec (x86 and ARM hosts are little-endian, as the format).
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # as the safetensors library: the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        produced = iter(tensors)
        for name, dtype, shape in specs:
            got_name, array = next(produced, (None, None))
            if got_name != name or array.dtype != np.dtype(dtype) or tuple(array.shape) != tuple(shape):
                raise ValueError(f"write_safetensors {path}: expected tensor {name!r} {np.dtype(dtype)} {tuple(shape)}, "
                                 f"got {got_name!r}" + ("" if array is None else f" {array.dtype} {array.shape}"))
            handle.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # the bytes, not a copy
        handle.flush()
        os.fsync(handle.fileno())
