"""Abstract arrays: `jax.ShapeDtypeStruct`s with shardings, the inputs programs are lowered with ahead of time
(nothing allocated)."""

from __future__ import annotations

from typing import Any

import jax


def is_abstract(tree: Any) -> bool:
    """Whether every leaf of `tree` is a `jax.ShapeDtypeStruct`."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


def with_shardings(tree: Any, shardings: Any) -> Any:
    """Abstract arrays of `tree`'s shapes and dtypes carrying `shardings` (a tree like it)."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)
