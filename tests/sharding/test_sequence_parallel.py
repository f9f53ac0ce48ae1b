"""Sequence parallelism within `tensor` (`ShardingRules.fsdp_tp(sequence_parallel=True)`): the residual stream split
on its sequence over the tensor devices computes what no sequence parallelism does, and the compiled program
gathers the sequence before the projections."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.learners.scoring import sequence_logprobs
from rpegjax.models import Decoder, ModelConfig
from rpegjax.sharding import ShardingRules, axes, make_mesh
from rpegjax.sharding.rules import ActivationSharding, param_shardings

ROWS, LENGTH = 4, 32


def _step(model, mesh, rules):
    graphdef, state = nnx.split(model)
    sharding = None if mesh is None else ActivationSharding(mesh, rules)

    def loss(state, tokens, mask):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, state), tokens, mask, chunk_size=8, sharding=sharding))

    if mesh is None:
        return jax.jit(jax.value_and_grad(loss)), state
    shardings = param_shardings(state, mesh, rules)
    return jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, None, None)), jax.device_put(state, shardings)


def test_rules_split_the_residual_sequence_over_tensor():
    rules = ShardingRules.fsdp_tp(sequence_parallel=True)
    assert rules.sequence_parallel and not ShardingRules.fsdp_tp().sequence_parallel
    assert rules.activations[axes.RESIDUAL_SEQ] == (axes.CONTEXT_AXIS, axes.TENSOR_AXIS)
    assert hash(rules) != hash(ShardingRules.fsdp_tp())


@pytest.mark.slow
def test_sequence_parallel_equals_no_sequence_parallelism():
    """fsdp4 x tensor2: loss and gradients with the residual stream split over tensor equal the unsharded dense
    model's (float32, 1e-5), with full remat and scanned layers (remat keeps the split layer inputs); the compiled
    program all-gathers [rows, t, d] activations along the sequence within each tensor pair, which the program
    without sequence parallelism never does."""
    cfg = ModelConfig.tiny()
    tokens = jax.random.randint(jax.random.key(2), (ROWS, LENGTH), 0, cfg.vocab_size)
    mask = jnp.arange(LENGTH)[None, :] < jnp.array([32, 26, 16, 29])[:, None]
    dense = Decoder(cfg, rngs=nnx.Rngs(0))
    step, state = _step(dense, None, None)
    expected_loss, expected = step(state, tokens, mask)
    fast = dense.with_execution(attention="blockwise", attention_block_size=8, remat="full", scan_layers=True)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    gathers = {}
    for sequence_parallel in (True, False):
        step, state = _step(fast, mesh, ShardingRules.fsdp_tp(sequence_parallel=sequence_parallel))
        compiled = step.lower(state, tokens, mask).compile()
        # rows per fsdp shard x the whole sequence x d, gathered along the sequence (dimension 1)
        pattern = rf"= f32\[{ROWS // 4},{LENGTH},{cfg.hidden_size}\]\S* all-gather\(.*dimensions=\{{1\}}"
        gathers[sequence_parallel] = len(re.findall(pattern, compiled.as_text()))
        if sequence_parallel:
            loss, grads = compiled(state, tokens, mask)
    assert gathers[True] >= 2 and gathers[False] == 0, gathers
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for (path, ours), reference in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True):
        scale = max(1.0, float(np.abs(reference).max()))
        np.testing.assert_allclose(ours, reference, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_fsdp_gathers_weights_not_every_rows_activations():
    """fsdp4 x tensor2 with sequence parallelism, one row per fsdp shard: the compiled update all-gathers the layers' weights whole over
    fsdp (`ActivationSharding.gathered_weight`), never a projection's activations of every row ([rows t, ...]).
    Left to itself XLA's SPMD partitioner gathered the rows under sequence parallelism (this model, and 13.5 GiB
    per device of MLP activations for Qwen2.5-32B at 32k tokens on fsdp16 x tensor2)."""
    cfg = ModelConfig.tiny()
    length = 64
    model = Decoder(cfg, rngs=nnx.Rngs(0)).with_execution(attention="blockwise", attention_block_size=8,
                                                          remat="full", scan_layers=True)
    step, state = _step(model, make_mesh({"fsdp": 4, "tensor": 2}),
                        ShardingRules.fsdp_tp(sequence_parallel=True))
    tokens = jnp.zeros((ROWS, length), jnp.int32)
    text = step.lower(state, tokens, tokens > -1).compile().as_text()
    gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", text)
    every_row = [shape for shape in gathered if shape.split(",")[0] == str(ROWS * length)]
    assert not every_row, every_row
    # the MLP's gate and up kernels ([d, f] split over tensor) gathered whole over fsdp
    assert f"{cfg.hidden_size},{cfg.intermediate_size // 2}" in gathered, gathered
