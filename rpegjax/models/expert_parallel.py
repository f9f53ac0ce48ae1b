"""Expert computation with the experts split over an `expert` mesh axis, and the capacity-factor mode.

Expert parallelism: the activation rules map logical axis EXPERT to mesh axes that also split the batch (the
`expert` axis is data-like for everything but the experts). Each device holds x/E experts (E = the expert axes'
size) and the tokens of its rows; inside `shard_map` it routes its tokens' assignments to the devices holding
their experts, computes its experts on what it received, and sends the results back:

dropless (`dispatch_dropless`): the n*k assignments sorted by expert go out by `jax.lax.ragged_all_to_all`, each
    device's run to the shard of its experts (sizes all-gathered first, a vector of x counts per device); the
    receiver regroups them by local expert and runs three `jax.lax.ragged_dot`; the inverse exchange brings the
    results home. Static shapes need the worst case: the receive buffer holds E*n*k rows (every assignment of
    every peer could pick this device's experts). Nothing is dropped. XLA:CPU has no ragged all-to-all: on CPU
    devices the same exchange is built from all-gathers (`gathered_all_to_all`, same result, E times the traffic).
capacity (`dispatch_capacity`): each expert takes at most C = min(t, ceil(c * t * k / x)) assignments of each row
    (t tokens, c the capacity factor), first come (token order, then the token's k slots) first served; the rest
    are dropped (the token keeps its residual only) and counted. Buffers [x, rows*C, d] cross with a plain
    `jax.lax.all_to_all` and every expert's tokens go through one batched matmul. Capacity is per row, so the
    same tokens are dropped however the rows are sharded (and without expert parallelism: same maths, no
    exchange). Padding tokens (`valid` false) take no capacity and get no expert output.

Tensor parallelism splits every expert's width f over the tensor axes (each device computes a partial output,
summed over them at the end); fsdp/context shards of the expert kernels' d are all-gathered at the `shard_map`
boundary (their gradients reduce-scattered back by its transpose).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.activations import swiglu
from rpegjax.models.experts import apply_experts
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding

Kernels = tuple[Float[Array, "x d f"], Float[Array, "x d f"], Float[Array, "x f d"]]


def expert_axes(sharding: ActivationSharding | None) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the experts are split over; () without expert parallelism."""
    return () if sharding is None else sharding.mesh_axes(axes.EXPERT)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C: how many of a row's `tokens` * `top_k` assignments each expert takes (an expert appears once per token)."""
    return min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts))


def compute_experts(x: Float[Array, "b t d"], expert_ids: Int[Array, "b t k"], weights: Float[Array, "b t k"],
                    kernels: Kernels, sharding: ActivationSharding | None, capacity_factor: float | None, *,
                    valid: Bool[Array, "b t"] | None = None) -> tuple[Float[Array, "b t d"], Int[Array, "b t"]]:
    """sum_j w_tj * expert_{e_tj}(x_t) for every token, and how many of its k assignments were dropped (capacity
    mode; 0 when dropless), over the experts' layout in `sharding` (see the module docstring). `valid`: the real
    tokens (None: all), which alone take capacity in the capacity mode (dropless computes every token)."""
    b, t, d = x.shape
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
    if valid.shape != (b, t):
        raise ValueError(f"compute_experts: valid {valid.shape} does not match the tokens {(b, t)}")
    split = expert_axes(sharding)
    if not split:
        if capacity_factor is None:
            out = apply_experts(x.reshape(b * t, d), expert_ids.reshape(b * t, -1), weights.reshape(b * t, -1),
                                *kernels)
            return out.reshape(b, t, d), jnp.zeros((b, t), jnp.int32)
        if sharding is None or not sharding.mesh_axes(axes.BATCH) or b % sharding.shards(axes.BATCH):
            return dispatch_capacity(x, expert_ids, weights, valid, kernels, capacity_factor, (), 1, ())
        # rows split over the batch axes: each device dispatches its own rows to every expert inside `shard_map`.
        # Under GSPMD the buffers' scatter over [x, rows * C] was not partitioned: every device built the whole
        # batch's buffers (a Qwen3-30B-A3B f32 log-prob pass compiled to 140.67 GB per device on 32 H100s)
    num_experts = kernels[0].shape[0]
    batch = sharding.mesh_axes(axes.BATCH)
    shards = sharding.shards(axes.EXPERT)
    if not set(split) <= set(batch):
        raise ValueError(f"expert parallelism over mesh axes {split} needs the batch split over them too (activation "
                         f"rules split the batch over {batch}): each expert shard dispatches its own tokens")
    if split and num_experts % shards:
        raise ValueError(f"expert parallelism: {num_experts} experts are not divisible by mesh axes {split} "
                         f"({shards} devices); change the mesh")
    if b % sharding.shards(axes.BATCH):
        raise ValueError(f"expert parallelism: {b} rows are not divisible by the batch's mesh axes {batch} "
                         f"({sharding.shards(axes.BATCH)} devices)")
    tensor = sharding.mesh_axes(axes.MLP)
    rows = PartitionSpec(batch, None, None)
    experts = split or None
    kernel_specs = (PartitionSpec(experts, None, tensor or None), PartitionSpec(experts, None, tensor or None),
                    PartitionSpec(experts, tensor or None, None))
    if capacity_factor is None:
        exchange = ragged_exchange(sharding.mesh)

        def local(x, ids, w, valid, gate, up, down):
            return dispatch_dropless(x, ids, w, (gate, up, down), split, shards, tensor, exchange)
    else:
        def local(x, ids, w, valid, gate, up, down):
            return dispatch_capacity(x, ids, w, valid, (gate, up, down), capacity_factor, split, shards, tensor)
    tokens = PartitionSpec(batch, None)
    return jax.shard_map(local, mesh=sharding.mesh, in_specs=(rows, rows, rows, tokens, *kernel_specs),
                         out_specs=(rows, tokens), check_vma=False)(x, expert_ids, weights, valid, *kernels)


def _combine(y: Float[Array, "n k d"], weights: Float[Array, "n k"], tensor: tuple[str, ...], dtype) -> Array:
    """The weighted sum over a token's k experts in float32, summed over the tensor shards of the experts' width."""
    combined = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), weights.astype(jnp.float32))
    return (jax.lax.psum(combined, tensor) if tensor else combined).astype(dtype)


def _exclusive_cumsum(x: Int[Array, "..."], axis: int) -> Int[Array, "..."]:
    return jnp.cumsum(x, axis=axis) - x


def gathered_all_to_all(operand: Array, output: Array, input_offsets: Int[Array, " e"], send_sizes: Int[Array, " e"],
                        output_offsets: Int[Array, " e"], recv_sizes: Int[Array, " e"], *, axis_name) -> Array:
    """`jax.lax.ragged_all_to_all`'s result (one slice per peer) built from all-gathers: each device gathers every
    peer's operand and offsets and copies out the slices sent to it. For XLA:CPU, which has no ragged all-to-all;
    it moves E times the operand (what the receive buffer holds anyway)."""
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [source, n, ...]
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # where each source's slice for me starts
    lands = jax.lax.all_gather(output_offsets, axis_name)[:, me]  # where it lands in my output
    rows = jnp.arange(output.shape[0])[:, None]
    inside = (rows >= lands[None, :]) & (rows < (lands + recv_sizes)[None, :])  # [row, source]
    source = jnp.argmax(inside, axis=1)
    taken = operands[source, jnp.clip(starts[source] + rows[:, 0] - lands[source], 0, operand.shape[0] - 1)]
    written = jnp.any(inside, axis=1).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(written, taken, output)


def ragged_exchange(mesh) -> Callable[..., Array]:
    """The ragged all-to-all for `mesh`'s devices: XLA's collective (GPU, TPU), or `gathered_all_to_all` on CPU."""
    return gathered_all_to_all if mesh.devices.flat[0].platform == "cpu" else jax.lax.ragged_all_to_all


def dispatch_dropless(x: Float[Array, "b t d"], expert_ids: Int[Array, "b t k"], weights: Float[Array, "b t k"],
                      kernels: Kernels, split: tuple[str, ...], shards: int, tensor: tuple[str, ...],
                      exchange: Callable[..., Array] = jax.lax.ragged_all_to_all
                      ) -> tuple[Float[Array, "b t d"], Int[Array, "b t"]]:
    """One device's part of the dropless exchange (inside `shard_map` over the `shards` devices of `split`):
    kernels hold its x/E local experts, `tensor` its slice of their width; `exchange` has
    `jax.lax.ragged_all_to_all`'s signature and semantics (`ragged_exchange`)."""
    b, t, d = x.shape
    k = expert_ids.shape[-1]
    local_experts = kernels[0].shape[0]
    num_experts = local_experts * shards
    n = b * t * k
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # assignments grouped by expert, so by destination shard
    sorted_x = x.reshape(b * t, d)[order // k]
    counts = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    all_counts = jax.lax.all_gather(counts, split).reshape(shards, num_experts)  # [source, expert]
    sends = all_counts.reshape(shards, shards, local_experts).sum(-1)  # [source, destination shard]
    me = jax.lax.axis_index(split)
    send_sizes, recv_sizes = sends[me], sends[:, me]
    input_offsets = _exclusive_cumsum(send_sizes, 0)
    output_offsets = _exclusive_cumsum(sends, 0)[me]  # where my run lands on each receiver: after lower sources'
    received = exchange(sorted_x, jnp.zeros((shards * n, d), x.dtype), input_offsets, send_sizes, output_offsets,
                        recv_sizes, axis_name=split)
    # the buffer holds source 0's rows by local expert, then source 1's, ...; regroup by local expert
    mine = jax.lax.dynamic_slice_in_dim(all_counts, me * local_experts, local_experts, axis=1)  # [source, local]
    segment_sizes = jnp.concatenate([mine.reshape(-1), (shards * n - jnp.sum(mine))[None]])
    segment_experts = jnp.concatenate([jnp.tile(jnp.arange(local_experts), shards), jnp.array([local_experts])])
    row_expert = jnp.repeat(segment_experts, segment_sizes, total_repeat_length=shards * n)
    regroup = jnp.argsort(row_expert, stable=True)  # unused rows (expert id local_experts) last
    group_sizes = jnp.sum(mine, axis=0).astype(jnp.int32)
    grouped = received[regroup]
    gate, up, down = (kernel.astype(x.dtype) for kernel in kernels)
    hidden = swiglu(jax.lax.ragged_dot(grouped, gate, group_sizes), jax.lax.ragged_dot(grouped, up, group_sizes))
    out = jnp.zeros_like(received).at[regroup].set(jax.lax.ragged_dot(hidden, down, group_sizes))
    back_offsets = _exclusive_cumsum(sends, 1)[:, me]  # where each source's run started in its own sorted array
    returned = exchange(out, jnp.zeros((n, d), x.dtype), _exclusive_cumsum(recv_sizes, 0), recv_sizes, back_offsets,
                        send_sizes, axis_name=split)
    y = returned[jnp.argsort(order)].reshape(b * t, k, d)
    combined = _combine(y, weights.reshape(b * t, k), tensor, x.dtype)
    return combined.reshape(b, t, d), jnp.zeros((b, t), jnp.int32)


def dispatch_capacity(x: Float[Array, "b t d"], expert_ids: Int[Array, "b t k"], weights: Float[Array, "b t k"],
                      valid: Bool[Array, "b t"], kernels: Kernels, capacity_factor: float, split: tuple[str, ...],
                      shards: int, tensor: tuple[str, ...]) -> tuple[Float[Array, "b t d"], Int[Array, "b t"]]:
    """The capacity mode on one device's rows (inside `shard_map` over the `shards` devices of `split`, or plain
    when `split` is empty)."""
    b, t, d = x.shape
    k = expert_ids.shape[-1]
    local_experts = kernels[0].shape[0]
    num_experts = local_experts * shards
    slots = capacity(t, k, num_experts, capacity_factor)
    ids = expert_ids.reshape(b, t * k)  # a row's assignments in token order, then slot order
    real = jnp.repeat(valid, k, axis=1)  # b (t k)
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.int32) * real[..., None]  # b (t k) x: padding takes none
    position = jnp.take_along_axis(jnp.cumsum(one_hot, axis=1), ids[..., None], axis=-1)[..., 0] - 1
    kept = real & (position < slots)
    # slot of each kept assignment in its expert's buffer [x, b * C]; a dropped one points past the end
    slot = jnp.where(kept, jnp.arange(b)[:, None] * slots + position, b * slots)
    tokens = jnp.repeat(x.reshape(b, t, d), k, axis=1)  # b (t k) d
    buffer = jnp.zeros((num_experts, b * slots, d), x.dtype).at[ids, slot].set(tokens, mode="drop")
    if split:  # [x, m, d] = [destination shard, local expert, m, d] -> [source shard, local expert, m, d]
        buffer = jax.lax.all_to_all(buffer.reshape(shards, local_experts, b * slots, d), split, 0, 0, tiled=False)
        buffer = buffer.transpose(1, 0, 2, 3).reshape(local_experts, shards * b * slots, d)
    gate, up, down = (kernel.astype(x.dtype) for kernel in kernels)
    hidden = swiglu(jnp.einsum("xmd,xdf->xmf", buffer, gate), jnp.einsum("xmd,xdf->xmf", buffer, up))
    out = jnp.einsum("xmf,xfd->xmd", hidden, down)
    if split:
        out = out.reshape(local_experts, shards, b * slots, d).transpose(1, 0, 2, 3)
        out = jax.lax.all_to_all(out, split, 0, 0, tiled=False).reshape(num_experts, b * slots, d)
    y = out.at[ids, slot].get(mode="fill", fill_value=0)  # b (t k) d; dropped assignments contribute nothing
    combined = _combine(y.reshape(b * t, k, d), weights.reshape(b * t, k), tensor, x.dtype)
    dropped = jnp.sum((real & ~kept).reshape(b, t, k), axis=-1).astype(jnp.int32)
    return combined.reshape(b, t, d), dropped
