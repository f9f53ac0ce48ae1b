"""What a paged layer's state reads besides its own arrays in one sampler call: its page group's page table and
the call's static attention settings (`PageView`); the paged cache (`rpegjax.generate.paged_cache`) binds one to
each layer it hands to a mixer."""

from __future__ import annotations

import flax.struct
from jaxtyping import Array, Int

from rpegjax.options import DecodeAttention


@flax.struct.dataclass
class PageView:
    """The rows' page table of the layer's page group (replica-local page ids; column c holds cache indices
    c*n .. c*n + n-1), how many of its columns a gathered attention reads (`window_pages`), and the decode kernel."""

    table: Int[Array, "b m"]
    window_pages: int = flax.struct.field(pytree_node=False, default=0)
    decode_attention: DecodeAttention = flax.struct.field(pytree_node=False, default=DecodeAttention.GATHER)
    pallas_interpret: bool = flax.struct.field(pytree_node=False, default=False)


def per_replica(x: Array, replicas: int) -> Array:
    """[b ...] -> [r b/r ...]: slot b lives in replica b // (b/r), as the batch sharding splits it."""
    return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
