"""The contiguous generation state: every layer's state for a fixed number of rows (slots), and their lengths.

Layer l holds the state its mixer kind declares (`contiguous_state` of `layer_stack.MIXERS[kind]`): full attention
keys and values of every position (`full_attention.AttentionCache`), a sliding layer a ring of its window, a recurrent
layer a state per row. `Decoder` hands `layer(l)` to layer l's mixer and gathers what it returns (`with_layers`).
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Int

from rpegjax.models.config import ModelConfig
from rpegjax.models.kinds import map_state
from rpegjax.models.layer_stack import mixer_of


@flax.struct.dataclass
class KVCache:
    """Generation state of every layer for b rows of `capacity` cache positions (static: the positions a row can
    address, which a live bucket's window narrows) and each row's valid tokens (`lengths`)."""

    layers: tuple
    lengths: Int[Array, " b"]
    capacity: int = flax.struct.field(pytree_node=False)

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> KVCache:
        dtype = cfg.jnp_dtype if dtype is None else dtype
        layers = tuple(mixer_of(cfg, i).contiguous_state(cfg, i, batch=batch, capacity=capacity, dtype=dtype)
                       for i in range(cfg.num_layers))
        return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32), capacity=capacity)

    def layer(self, index: int):
        """What layer `index`'s mixer receives (another cache type, the sampler's paged cache, offers the same
        `layer` / `with_layers` pair)."""
        return self.layers[index]

    def with_layers(self, written: list, added: Int[Array, " b"]) -> KVCache:
        return self.replace(layers=tuple(written), lengths=self.lengths + added)

    def map_layers(self, function, *others: KVCache) -> tuple:
        """Every layer's state with each array replaced by `function(spec, array, *the same array of others)`."""
        return tuple(map_state(function, layer, *(other.layers[i] for other in others))
                     for i, layer in enumerate(self.layers))
