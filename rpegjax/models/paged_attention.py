"""Decode attention over the paged pool with the Pallas paged-attention kernel: each row reads its own pages.

The gathered path (`full_attention.attend_pages`, `DecodeAttention.GATHER`) gathers every row's page-table window
of the bucket's longest row and masks past the row's length, so after most rows of a replica finish or while
they are short, the step still reads rows x the longest row's pages. JAX's Pallas kernel
(`jax.experimental.pallas.ops.gpu.paged_attention`, Triton) takes per row a block table and a length and stops
at the row's last page (`DecodeAttention.PALLAS`): the KV bytes a step reads are the sum of the rows' own
lengths. It wants each replica's pool as [k p n e] (KV head, page, offset, head dim), the pool's layout
(`full_attention.PagedAttention`: [r k p n e] per layer), so nothing is transposed per step.

Per replica and step, for a row with query at cache index i (its new token already written) and block table T:

    out[h] = softmax_j(q[h] . K[kv(h), T[j // n], j % n] / sqrt(e)) V[...]   over j < i + 1

The kernel does not scale q: it is scaled here (by 1/sqrt(e), in the compute dtype). Rows split over the slot
replicas like the pools: with a mesh the kernel runs inside `shard_map` (a Pallas call is a custom call XLA's
partitioner cannot split: it would gather the pools), each device on its replicas' pools and KV heads, a `vmap`
over the replicas it holds. The kernel is a CUDA (Triton) kernel: any other platform is refused unless the
caller asks for Pallas's interpret mode (tests and debugging on CPU; slow).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from rpegjax.sharding.rules import ActivationSharding

# The kernel's blocks: q heads per KV head padded to BLOCK_H (it requires a multiple of 16); PAGES_PER_BLOCK pages
# per inner iteration (8 pages of 16 tokens: 128 keys, Triton's usual tile); a row's table split into at most
# K_SPLITS partitions run in parallel (JAX's defaults), those wholly past the row's length skipped.
BLOCK_H = 16
PAGES_PER_BLOCK = 8
K_SPLITS = 16
# the platforms the Triton kernel compiles for (compile-only CUDA devices of a dry run report "gpu")
KERNEL_PLATFORMS = ("gpu", "cuda")


def check_kernel(platform: str, *, page_size: int, head_dim: int, interpret: bool, where: str) -> None:
    """Refuses the kernel on a platform it does not compile for, unless in Pallas interpret mode, and at shapes
    Triton cannot tile (its blocks, pages x page size by the head dim, are powers of two of at least 16)."""
    if interpret:
        return
    if platform not in KERNEL_PLATFORMS:
        raise ValueError(f"{where}: decode_attention=pallas runs the Pallas paged-attention kernel, a CUDA (Triton) "
                         f"kernel; the sampler's devices are {platform!r}. Use decode_attention=gather there (or "
                         "Pallas interpret mode, CacheConfig(pallas_interpret=True), for tests and debugging)")
    for name, value in (("page_size", page_size), ("head_dim", head_dim)):
        if value & (value - 1) or value < (1 if name == "page_size" else 16):
            raise ValueError(f"{where}: decode_attention=pallas tiles {name}={value} in Triton blocks, which must be "
                             f"powers of two (head_dim >= 16); use decode_attention=gather or another {name}")


def kernel_blocks(columns: int) -> tuple[int, int, int]:
    """(pages per compute block, k splits, padded table columns) for a page table of `columns` columns: the
    kernel needs the columns to be k_splits x a multiple of the pages per block."""
    per_block = min(PAGES_PER_BLOCK, 1 << (columns.bit_length() - 1))
    splits = min(K_SPLITS, -(-columns // per_block))
    step = per_block * splits
    return per_block, splits, -(-columns // step) * step


def _replica_attention(q: Float[Array, "r b h e"], k: Float[Array, "r k p n e"], v: Float[Array, "r k p n e"],
                       table: Int[Array, "r b m"], lengths: Int[Array, "r b"], *, interpret: bool
                       ) -> Float[Array, "r b h e"]:
    """The kernel on each replica's rows and pool (`vmap` over r); `lengths` = keys each row attends to."""
    per_block, splits, columns = kernel_blocks(table.shape[-1])
    table = jnp.pad(table, ((0, 0), (0, 0), (0, columns - table.shape[-1])))  # page 0, past every row's length
    kernel = functools.partial(pallas_paged.paged_attention, block_h=BLOCK_H, pages_per_compute_block=per_block,
                               k_splits=splits, interpret=interpret)
    return jax.vmap(kernel)(q, k, v, table, lengths)


def paged_decode_attention(q: Float[Array, "b 1 h e"], k: Float[Array, "r k p n e"], v: Float[Array, "r k p n e"],
                           page_table: Int[Array, "b m"], query_index: Int[Array, "b 1"],
                           live: Bool[Array, " b"] | None = None, *, sharding: ActivationSharding | None,
                           pool_spec: PartitionSpec | None, interpret: bool) -> Float[Array, "b 1 h e"]:
    """One new token per row attending over its own pages up to its cache index `query_index` (inclusive): rows
    b split over the r replicas in blocks (row i in replica i // (b/r)), page ids replica-local. Rows not `live`
    (finished, or padding a live bucket) read no page (length 0; their output is 0 and unused). `pool_spec`: the
    pools' PartitionSpec on `sharding`'s mesh (None without a mesh)."""
    e, n = q.shape[-1], k.shape[3]
    lengths = jnp.minimum(query_index[:, 0] + 1, page_table.shape[1] * n).astype(jnp.int32)
    lengths = lengths if live is None else jnp.where(live, lengths, 0)
    scaled = (q[:, 0].astype(jnp.float32) / math.sqrt(e)).astype(q.dtype)

    def local(q, k, v, table, lengths):
        r = k.shape[0]
        split = lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:])  # noqa: E731
        out = _replica_attention(split(q), k, v, split(table), split(lengths), interpret=interpret)
        return out.reshape(q.shape)

    if sharding is None:
        return local(scaled, k, v, page_table, lengths)[:, None]
    rows, heads, pages, offsets, dim = pool_spec
    if pages is not None or offsets is not None or dim is not None:
        raise ValueError(f"decode_attention=pallas: the pool is split as {pool_spec}; the kernel needs each device "
                         "to hold whole pages and head dims (split only replicas and KV heads)")
    q_spec, row_spec = PartitionSpec(rows, heads, None), PartitionSpec(rows)
    out = jax.shard_map(local, mesh=sharding.mesh, check_vma=False,
                        in_specs=(q_spec, pool_spec, pool_spec, PartitionSpec(rows, None), row_spec),
                        out_specs=q_spec)(scaled, k, v, page_table, lengths)
    return out[:, None]


__all__ = ["BLOCK_H", "KERNEL_PLATFORMS", "K_SPLITS", "PAGES_PER_BLOCK", "check_kernel", "kernel_blocks",
           "paged_decode_attention"]
