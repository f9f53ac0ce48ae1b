"""Maps between one Hugging Face tensor and one of our parameters, with no reference to a model (pure numpy).

A map is a triple (to_ours, to_hf, window): `to_ours(hf)` and `to_hf(ours)` convert whole arrays; `window(ours)` takes
a window of our parameter (one device's shard: one slice per dimension with explicit start and stop and unit step)
and returns the window of the HF tensor that holds it and the function turning that HF block into our block, so a
process reads only what it places. `hf_layout` and the layer kinds name tensors with these (`TensorLayout`: one HF
tensor, our parameter's path and the map).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Window = tuple[slice, ...]  # one slice per dimension, with explicit start and stop and unit step
Maps = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray],
             Callable[[Window], tuple[Window, Callable[[np.ndarray], np.ndarray]]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """How one HF tensor maps onto one parameter of our `Decoder` state.

    `window(ours)` maps a window of our parameter (a device's shard) to the window of the HF tensor that
    holds it and a function turning that HF block into our block: a process reads only what it places.
    """

    name: str  # HF name
    path: tuple[str | int, ...]  # path in `nnx.state(decoder)`
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    window: Callable[[Window], tuple[Window, Callable[[np.ndarray], np.ndarray]]]
    expert: int | None = None  # this tensor is [expert] of our parameter (stacked over experts); maps act on it


def tensor_layout(name: str, path: tuple[str | int, ...], hf_shape: tuple[int, ...], maps: Maps | None = None,
                  expert: int | None = None) -> TensorLayout:
    """The layout of HF tensor `name` onto our parameter at `path` through `maps` (default: the same array)."""
    maps = identity() if maps is None else maps
    return TensorLayout(name=name, path=path, hf_shape=hf_shape, to_ours=maps[0], to_hf=maps[1], window=maps[2],
                        expert=expert)


def _unchanged(x: np.ndarray) -> np.ndarray:
    return x


def identity() -> Maps:
    """The same array on both sides (norm scales, biases of our shape)."""
    return _unchanged, _unchanged, lambda ours: (ours, _unchanged)


def _heads(window: slice, e: int) -> slice:
    """HF rows (or columns) of heads `window` in a head-major [n*e] dimension."""
    return slice(window.start * e, window.stop * e)


def _length(window: slice) -> int:
    return window.stop - window.start


def in_projection(d: int, n: int, e: int) -> Maps:
    """HF [n*e, d] <-> ours [d, n, e]."""

    def window(ours: Window) -> tuple[Window, Callable]:
        dims, heads, head_dim = ours
        return (_heads(heads, e), dims), lambda w: w.T.reshape(_length(dims), _length(heads), e)[:, :, head_dim]

    return (lambda w: w.T.reshape(d, n, e)), (lambda w: w.reshape(d, n * e).T), window


def out_projection(h: int, e: int, d: int) -> Maps:
    """HF [d, h*e] <-> ours [h, e, d]."""

    def window(ours: Window) -> tuple[Window, Callable]:
        heads, head_dim, dims = ours
        return (dims, _heads(heads, e)), lambda w: w.T.reshape(_length(heads), e, _length(dims))[:, head_dim, :]

    return (lambda w: w.T.reshape(h, e, d)), (lambda w: w.reshape(h * e, d).T), window


def bias(n: int, e: int) -> Maps:
    """HF [n*e] <-> ours [n, e]."""

    def window(ours: Window) -> tuple[Window, Callable]:
        heads, head_dim = ours
        return (_heads(heads, e),), lambda w: w.reshape(_length(heads), e)[:, head_dim]

    return (lambda w: w.reshape(n, e)), (lambda w: w.reshape(n * e)), window


def leading_one(ours_shape: tuple[int, ...]) -> Maps:
    """HF [1, *s] <-> ours [*s] (the value head's weight [1, d] and bias [1])."""

    def window(ours: Window) -> tuple[Window, Callable]:
        return (slice(0, 1), *ours), lambda w: w.reshape(w.shape[1:])

    return (lambda w: w.reshape(ours_shape)), (lambda w: w.reshape(1, *ours_shape)), window


def transposed() -> Maps:
    """HF [out, in] <-> ours [in, out] (a 2-D nn.Linear weight)."""
    return (lambda w: w.T), (lambda w: w.T), (lambda ours: (ours[::-1], lambda w: w.T))
