"""`remat_scan`: the gradients of a checkpointed `lax.scan`, with one stacked buffer fewer in the backward and no
stacked copy between the forward and backward loops."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.models.layer_scan import remat_scan
from rpegjax.train import compile_target

LAYERS, D = 6, 256


def _layer(x, params, index, shared):
    """A residual block with a bfloat16 kernel (as the stack holds compute-dtype kernels), a float32 scale, a
    per-layer integer input and a shared (non-differentiated) array."""
    h = jnp.tanh((x.astype(jnp.bfloat16) @ params["w"]).astype(jnp.float32) * params["scale"])
    return x + h * shared["gate"] + index.astype(jnp.float32) * 1e-3


def _cast(master):
    """One layer's float32 masters with the kernel as its bfloat16 cast (as `_scan_layers` reads them)."""
    return dict(master, w=master["w"].astype(jnp.bfloat16))


def _stack(masters):
    return jax.tree.map(lambda *values: jnp.stack(values), *(_cast(m) for m in masters))


def _checkpointed(x, masters, indices, shared):
    """The reference: what `_scan_layers` differentiates without `remat_scan` (jax.checkpoint, nothing saved)."""

    def body(x, inputs):
        p, index = inputs
        step = jax.checkpoint(lambda x, p, index: _layer(x, p, index, shared),
                              policy=jax.checkpoint_policies.nothing_saveable)
        return step(x, p, index), None

    return jax.lax.scan(body, x, (_stack(masters), indices))[0]


def _inputs(rows: int):
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = {"w": jax.random.normal(keys[0], (LAYERS, D, D)) / np.sqrt(D),
               "scale": 1.0 + 0.1 * jax.random.normal(keys[1], (LAYERS, D))}
    masters = [jax.tree.map(lambda p, l=l: p[l], stacked) for l in range(LAYERS)]
    x = jax.random.normal(keys[2], (rows, D))
    return x, masters, jnp.arange(LAYERS, dtype=jnp.int32), {"gate": jnp.linspace(0.5, 1.5, D)}


def _loss(scan, head=None):
    """sum(out * weights), or sum(head(out)) when a head is given."""
    weights = jnp.cos(jnp.arange(D, dtype=jnp.float32))
    if head is None:
        head = lambda out: out * weights  # noqa: E731
    return lambda x, masters, indices, shared: jnp.sum(head(scan(x, masters, indices, shared)))


@pytest.mark.parametrize("runs", [1, 2, 4, LAYERS])
def test_gradients_equal_the_checkpointed_scan(runs):
    x, masters, indices, shared = _inputs(rows=8)
    grad = lambda scan: jax.jit(jax.value_and_grad(_loss(scan), argnums=(0, 1)))(x, masters, indices, shared)
    loss, grads = grad(lambda *args: remat_scan(_layer, _cast, *args, runs=runs))
    want_loss, want = grad(_checkpointed)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda g: g.dtype, want)
    for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True):
        expected = np.asarray(expected, np.float32)
        np.testing.assert_allclose(np.asarray(ours, np.float32), expected, rtol=1e-5,
                                   atol=1e-6 * np.abs(expected).max(), err_msg=jax.tree_util.keystr(path))


def _h100_temporaries(loss, rows: int) -> int:
    """Temporaries of `grad(loss)` with respect to the per-layer masters, compiled for an H100 (compile-only)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = compile_target.compile_devices(compile_target.DryRunTarget.CUDA_H100, 1)
    placed = NamedSharding(Mesh(np.array(device), ("x",)), PartitionSpec())
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), _inputs(rows))
    return jax.jit(jax.grad(loss, argnums=1)).lower(*inputs).compile().memory_analysis().temp_size_in_bytes


_needs_gpu_compiler = pytest.mark.skipif(
    not compile_target.cuda_plugin_installed() and os.environ.get("RPEGJAX_GPU_AOT") != "required",
    reason="JAX's CUDA plugin is not installed (XLA:CPU upcasts the bfloat16 buffers and drops optimization "
           "barriers, so only XLA's GPU compiler shows the saving; pip install -e '.[gpu-aot]')")
STACKED_BYTES = LAYERS * (D * D * 2 + D * 4)  # the bfloat16 kernels and float32 scales, stacked


@_needs_gpu_compiler
def test_the_backward_holds_one_stacked_buffer_for_parameters_and_gradients():
    """The reference's temporaries less one stacked copy (tiny activations, so the stacked buffers dominate: 0.79 MB
    against 1.58 MB when written)."""
    ours = _h100_temporaries(_loss(lambda *args: remat_scan(_layer, _cast, *args)), rows=2)
    reference = _h100_temporaries(_loss(_checkpointed), rows=2)
    assert ours <= reference - 0.9 * STACKED_BYTES, (ours, reference, STACKED_BYTES)


@_needs_gpu_compiler
def test_no_stacked_copy_is_live_while_the_head_runs():
    """With a head whose working set (a [rows, 8 D] float32 intermediate, its gradient) outweighs the stack, the
    update's peak lies at the head: there no stack is live (the forward loop reads each layer's own arrays, the
    backward's stack is not built yet). Against the checkpointed scan over the stack, whose stack is live from
    before the forward loop to the end of the backward one, as `remat_scan` once held it: one
    stacked copy less (the head's working set is more than both stacked buffers, so the backward loop is not the
    peak)."""
    rows = 512
    wide = jnp.cos(0.01 * jnp.arange(D)[:, None] * jnp.arange(8 * D)[None, :]) / D

    def head(out):
        return jnp.tanh(out @ wide) ** 2

    ours = _h100_temporaries(_loss(lambda *args: remat_scan(_layer, _cast, *args), head), rows)
    reference = _h100_temporaries(_loss(_checkpointed, head), rows)
    head_bytes = rows * 8 * D * 4
    assert head_bytes > 2 * STACKED_BYTES
    assert ours <= reference - 0.9 * STACKED_BYTES, (ours, reference, STACKED_BYTES)


@pytest.mark.parametrize("runs", [0, LAYERS + 1])
def test_runs_outside_one_to_the_layers_are_refused(runs):
    x, masters, indices, shared = _inputs(rows=2)
    with pytest.raises(ValueError, match=f"runs={runs} must be between 1 and the {LAYERS} layers"):
        remat_scan(_layer, _cast, x, masters, indices, shared, runs=runs)


@_needs_gpu_compiler
def test_runs_free_their_kept_inputs_before_the_next_run_stacks():
    """With the kept inputs about as large as the stack (rows x D float32 per layer), three runs of two layers hold
    at the backward's peak the kept inputs and a third of the stack, or two thirds of each, or a third of the kept
    inputs and the stack (the runs done keep their gradients in bfloat16): about 2/3 of the stack less than one run,
    which holds both whole."""
    rows = 128
    kept_bytes = LAYERS * rows * D * 4
    assert 0.9 < kept_bytes / STACKED_BYTES < 1.1
    one = _h100_temporaries(_loss(lambda *args: remat_scan(_layer, _cast, *args, runs=1)), rows)
    three = _h100_temporaries(_loss(lambda *args: remat_scan(_layer, _cast, *args, runs=3)), rows)
    assert three <= one - 0.55 * STACKED_BYTES, (three, one, STACKED_BYTES)
