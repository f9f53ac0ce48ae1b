"""Chunked log-probs == log_softmax of the full logits gathered at the targets (numpy references)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.models.logprobs import logprobs_from_hidden, token_logprobs
from rpegjax.sharding import ShardingRules, make_mesh
from rpegjax.sharding.rules import ActivationSharding

CHUNKS = [1, 3, 5, 8, 13, 64]  # 13 = t; 3, 5, 8 do not divide 13; 64 > t


def _numpy_log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    b, t, d, v = 3, 13, 16, 40
    hidden = rng.normal(size=(b, t, d)).astype(np.float32)
    kernel = rng.normal(size=(d, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    return hidden, kernel, targets


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_hidden_matches_numpy(problem, chunk_size, temperature):
    hidden, kernel, targets = problem
    log_probs = _numpy_log_softmax(hidden.astype(np.float64) @ kernel / temperature)
    expected = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    expected_entropy = -(np.exp(log_probs) * log_probs).sum(-1)
    picked, entropy = logprobs_from_hidden(jnp.asarray(hidden), jnp.asarray(kernel), jnp.asarray(targets),
                                           chunk_size=chunk_size, temperature=temperature, with_entropy=True)
    assert picked.shape == targets.shape and entropy.shape == targets.shape
    np.testing.assert_allclose(picked, expected, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(entropy, expected_entropy, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, 13])
def test_chunked_gradient_matches_unchunked(problem, chunk_size):
    hidden, kernel, targets = problem

    def full(h, w):
        log_probs = jax.nn.log_softmax(h @ w, axis=-1)
        return jnp.take_along_axis(log_probs, jnp.asarray(targets)[..., None], -1).sum()

    def chunked(h, w):
        return logprobs_from_hidden(h, w, jnp.asarray(targets), chunk_size=chunk_size)[0].sum()

    expected = jax.grad(full, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(kernel))
    got = jax.grad(chunked, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(kernel))
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [5, 13])
def test_gradient_of_weighted_logprobs_and_entropy_matches_autodiff(problem, chunk_size):
    """The hand-written backward (onehot - p for log p[y], -p (log p + H) for the entropy, / temperature)
    against autodiff of the plain formula, with per-position weights on both outputs."""
    hidden, kernel, targets = problem
    rng = np.random.default_rng(1)
    w_picked, w_entropy = (jnp.asarray(rng.normal(size=targets.shape).astype(np.float32)) for _ in range(2))
    temperature = 0.7

    def full(h, w):
        log_probs = jax.nn.log_softmax(h @ w / temperature, axis=-1)
        picked = jnp.take_along_axis(log_probs, jnp.asarray(targets)[..., None], -1)[..., 0]
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return jnp.sum(picked * w_picked + entropy * w_entropy)

    def chunked(h, w):
        picked, entropy = logprobs_from_hidden(h, w, jnp.asarray(targets), chunk_size=chunk_size,
                                               temperature=temperature, with_entropy=True)
        return jnp.sum(picked * w_picked + entropy * w_entropy)

    expected = jax.grad(full, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(kernel))
    got = jax.grad(chunked, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(kernel))
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("architecture", [Architecture.QWEN2, Architecture.LLAMA])
def test_token_logprobs_match_full_logits(architecture):
    cfg = ModelConfig.tiny(architecture, tie_word_embeddings=architecture == Architecture.LLAMA)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(3, 13))
    mask = np.arange(13)[None, :] >= np.array([0, 2, 5])[:, None]  # left padding
    logits = np.asarray(model(jnp.asarray(tokens), mask=jnp.asarray(mask)))
    expected = np.take_along_axis(_numpy_log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    for chunk_size in (1, 5, 64):  # one per chunk, non-dividing, one chunk
        got = np.asarray(token_logprobs(model, jnp.asarray(tokens), mask=jnp.asarray(mask), chunk_size=chunk_size))
        assert got.shape == tokens.shape and (got[:, -1] == 0).all()
        np.testing.assert_allclose(got[:, :-1][mask[:, 1:]], expected[mask[:, 1:]], atol=1e-4, rtol=1e-5,
                                   err_msg=f"chunk_size={chunk_size}")


def _loop_reductions(hlo: str) -> tuple[int, int]:
    """(all-reduce / reduce-scatter ops inside while-loop bodies, in the whole program) of compiled HLO text."""
    computations = {}
    for block in hlo.split("\n\n"):
        header = block.strip().split(" ", 2)
        name = header[1] if header[0] == "ENTRY" else header[0]
        computations[name.lstrip("%")] = block
    pattern = re.compile(r"(all-reduce|reduce-scatter|all-reduce-start)\(")
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    return sum(len(pattern.findall(computations.get(body, ""))) for body in bodies), len(pattern.findall(hlo))


def _rows_over_8_devices(seed: int):
    """An fsdp-8 mesh, its activation sharding, hidden [8 64 16], an output kernel [16 40], targets and the rng."""
    mesh = make_mesh({"fsdp": 8})
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(8, 64, 16)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, size=(8, 64)))
    return mesh, ActivationSharding(mesh, ShardingRules.fsdp_tp()), hidden, kernel, targets, rng


def test_sharded_chunk_loop_reduces_the_output_gradient_once():
    """Rows over 8 devices: the output-layer gradient is summed across devices once, after the chunk loop."""
    mesh, activations, hidden, kernel, targets, rng = _rows_over_8_devices(seed=1)
    weights = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)

    def gradient(sharding):
        def loss(h, w):
            picked, entropy = logprobs_from_hidden(h, w, targets, chunk_size=8, with_entropy=True, sharding=sharding)
            return jnp.sum(picked * weights) + jnp.sum(entropy * weights[::-1])

        shardings = (NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec("fsdp")))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=shardings)

    inside, total = _loop_reductions(gradient(activations).lower(hidden, kernel).compile().as_text())
    assert (inside, total) == (0, 1)
    # without the per-shard accumulator every chunk iteration all-reduces (what this layout avoids)
    assert _loop_reductions(gradient(None).lower(hidden, kernel).compile().as_text())[0] >= 1
    (value, grads), (expected_value, expected_grads) = gradient(activations)(hidden, kernel), gradient(None)(hidden, kernel)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    for ours, expected in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(ours, expected, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


def _plain_logprobs(h, w, targets, dtype, temperature, weights):
    """The unchunked formula on one device, differentiated by autodiff: the reference of the chunk loop's VJP."""
    logits = (h.astype(dtype) @ w.astype(dtype)).astype(jnp.float32) / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return jnp.sum(picked * weights) + jnp.sum(entropy * weights[::-1])


@pytest.mark.parametrize("axis_sizes", [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"fsdp": 2, "context": 2, "tensor": 2},
                                        {"context": 8}])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sharded_gradients_equal_one_device(axis_sizes, dtype):
    """Rows over fsdp, each row's sequence over context, the vocabulary over tensor: the chunk loop's values and
    gradients (float32 W, its compute-dtype cast gathered, dW summed over the chunks in float32) equal the plain
    formula's autodiff on one device; 1e-5 in float32, bfloat16's rounding of each chunk's dW otherwise."""
    mesh = make_mesh(axis_sizes)
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(8, 64, 16)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(16, 40)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, size=(8, 64)))
    weights = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    activations, temperature = ActivationSharding(mesh, ShardingRules.fsdp_tp()), 0.7

    def loss(h, w):
        picked, entropy = logprobs_from_hidden(h, w, targets, chunk_size=8, temperature=temperature,
                                               with_entropy=True, dtype=dtype, sharding=activations)
        return jnp.sum(picked * weights) + jnp.sum(entropy * weights[::-1])

    rows = NamedSharding(mesh, PartitionSpec(("fsdp",) if "fsdp" in axis_sizes else None))
    model = NamedSharding(mesh, PartitionSpec(tuple(a for a in ("fsdp", "context") if a in axis_sizes) or None,
                                              "tensor" if "tensor" in axis_sizes else None))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=(rows, model))(hidden, kernel)
    reference = jax.value_and_grad(_plain_logprobs, argnums=(0, 1))(hidden, kernel, targets, dtype, temperature,
                                                                     weights)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    assert grads[1].dtype == jnp.float32
    for ours, expected in zip((value, *grads), (reference[0], *reference[1]), strict=True):
        np.testing.assert_allclose(ours, expected, rtol=tolerance, atol=tolerance * float(np.abs(expected).max()))


def test_the_update_gathers_the_compute_dtype_kernel():
    """Rows over 8 devices, float32 W, bfloat16 compute: the differentiated pass makes its per-shard copies of W
    [r, c, d, v] from W's bfloat16 cast (forward and the backward's recompute), so FSDP gathers bfloat16, not the
    float32 masters beside their cast (7B at 16k on fsdp8: 2.18 GiB per device; docs/benchmarks.md,
    "W-long"); W's gradient is float32."""
    mesh, activations, hidden, kernel, targets, rng = _rows_over_8_devices(seed=2)
    weights = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)

    def loss(h, w):
        picked, _ = logprobs_from_hidden(h, w, targets, chunk_size=8, dtype=jnp.bfloat16, sharding=activations)
        return jnp.sum(picked * weights)

    rows, model = NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec("fsdp", None))
    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=(rows, model))
    # the per-shard copies before partitioning, forward and backward: broadcasts of the [d, v] matrix to
    # [r, c, d, v] (XLA:CPU then gathers bfloat16 through float32, which a GPU does not)
    lowered = program.lower(hidden, kernel).as_text()
    assert re.findall(r"broadcast_in_dim.*\(tensor<16x40x(\w+)>\) -> tensor<8x1x16x40x", lowered) == ["bf16"] * 2
    assert program(hidden, kernel)[1][1].dtype == jnp.float32
