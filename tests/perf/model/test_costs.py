"""Cost formulas against hand-computed values and against XLA's own cost and memory analysis of the real model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.logprobs import token_logprobs
from rpegjax.options import RematPolicy
from rpegjax.perf.model import costs
from rpegjax.perf.model.costs import AttentionKernel, ModelShape

SHAPE = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=128,
                   param_dtype="float32", compute_dtype="float32")


def test_training_flops_are_six_n_tokens_plus_attention():
    tokens, length = 4 * 32, 32
    pairs = 4 * costs.attention_pairs(length, AttentionKernel.FLASH)
    n_matmul = SHAPE.layers * SHAPE.matmul_params_per_layer + SHAPE.hidden * SHAPE.vocab  # weights used per token
    attention = 3 * 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * pairs
    assert costs.training_flops(SHAPE, tokens=tokens, pairs=pairs, remat=RematPolicy.NONE) == 6 * n_matmul * tokens + attention
    forward_layers = 2 * SHAPE.layers * SHAPE.matmul_params_per_layer * tokens + attention / 3
    assert costs.training_flops(SHAPE, tokens=tokens, pairs=pairs, remat=RematPolicy.FULL) == pytest.approx(
        6 * n_matmul * tokens + attention + forward_layers)
    assert costs.attention_pairs(10, AttentionKernel.DENSE) == 100 and costs.attention_pairs(10, "flash") == 55


def test_parameter_count_matches_the_model_config():
    for cfg in (ModelConfig.qwen2p5("7b"), ModelConfig.llama3("8b"), ModelConfig.w_small()):
        assert ModelShape.from_config(cfg).params == pytest.approx(cfg.num_params(), rel=1e-3)  # biases left out


def test_decode_bytes_read_weights_once_and_the_attended_cache():
    shape = ModelShape.from_config(ModelConfig.qwen2p5("7b"))
    keys, rows, tensor = 1_000_000, 256, 4
    kv_token = 2 * 28 * 4 * 128 * 2  # K and V, layers, kv heads, head dim, bfloat16
    assert shape.kv_bytes_per_token == kv_token
    activations = rows * 28 * (6 * 3584 + 3 * 18944 / tensor) * 2
    expected = shape.weight_bytes / tensor + (keys + rows) * kv_token / tensor + activations
    assert costs.decode_step_bytes(shape, keys=keys, sequences=rows, tensor=tensor) == pytest.approx(expected)
    # tensor parallelism beyond the 4 KV heads replicates the cache instead of splitting it further
    eight = costs.decode_step_bytes(shape, keys=keys, sequences=0, tensor=8)
    assert eight == pytest.approx(shape.weight_bytes / 8 + keys * kv_token / 4)


def test_activation_memory_hand_count():
    # the normalised inputs of two projections, the attention output, q and the output blocked, k, v, gate, up and
    # their product; the two norms' inputs and outputs in float32; dense scores and probabilities
    kept = (2 * 64 + 3 * 4 * 16 + 2 * 2 * 16 + 3 * 128) * 4 + 4 * 64 * 4
    per_token = kept + 4 * 32 * (4 + 4)
    assert costs.layer_activation_bytes_per_token(SHAPE, keys_per_query=32, kernel="dense") == per_token
    assert costs.training_activation_bytes(SHAPE, tokens=100, keys_per_query=32, kernel="dense", remat="none") == 100 * 2 * per_token
    remat = costs.training_activation_bytes(SHAPE, tokens=100, keys_per_query=32, kernel="dense", remat="full")
    assert remat == 100 * (2 * 64 * 4 + per_token)
    flash = costs.layer_activation_bytes_per_token(SHAPE, keys_per_query=32, kernel="flash")
    assert flash == kept + 4 * 4


@pytest.fixture(scope="module")
def tiny_programs():
    b, t = 4, 32
    cfg = ModelConfig.tiny()
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((b, t), jnp.int32)

    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    def loss(state, tokens):
        return token_logprobs(nnx.merge(graphdef, state), tokens, chunk_size=256).mean()

    return (cfg, jax.jit(forward).lower(state, tokens).compile(),
            jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile())


def test_flop_formulas_match_xla_cost_analysis(tiny_programs):
    b, t = 4, 32
    cfg, forward, train = tiny_programs
    shape = ModelShape.from_config(cfg)
    pairs = b * costs.attention_pairs(t, AttentionKernel.DENSE)  # rpegjax's attention scores every position
    predicted_forward = costs.forward_flops(shape, tokens=b * t, pairs=pairs, logit_tokens=b * t)
    # XLA also counts elementwise work (norms, softmax, RoPE): the matmul formula must be within 5% of it
    assert forward.cost_analysis()["flops"] == pytest.approx(predicted_forward, rel=0.05)
    predicted_train = costs.training_flops(shape, tokens=b * t, pairs=pairs, remat="none") + 2 * 64 * 128 * b * t
    assert train.cost_analysis()["flops"] == pytest.approx(predicted_train, rel=0.05)


def test_memory_formulas_match_xla_memory_analysis(tiny_programs):
    b, t = 4, 32
    cfg, forward, train = tiny_programs
    shape = ModelShape.from_config(cfg)
    arguments = forward.memory_analysis().argument_size_in_bytes
    assert arguments == pytest.approx(shape.weight_bytes + b * t * 4, rel=0.01)  # weights + tokens (biases left out)
    temp = train.memory_analysis().temp_size_in_bytes
    predicted = (costs.training_activation_bytes(shape, tokens=b * t, keys_per_query=t, kernel="dense", remat="none")
                 + costs.logprob_chunk_bytes(shape, rows=b, chunk=t))
    # XLA's buffer assignment reuses and pads buffers, so the activation count is an estimate: within 30%
    assert temp == pytest.approx(predicted, rel=0.3)


def test_optimizer_formulas():
    assert costs.optimizer_state_bytes(SHAPE, bytes_per_param=8) == 8 * SHAPE.params
    assert costs.optimizer_step_bytes(SHAPE, state_bytes_per_param=8, grad_bytes_per_param=4) == SHAPE.params * (2 * 4 + 16 + 4)
    with pytest.raises(ValueError, match="ModelShape.heads"):
        ModelShape(layers=1, hidden=8, heads=3, kv_heads=2, head_dim=4, mlp=8, vocab=8)
    assert np.array_equal(costs.attention_pairs(np.array([2, 3]), "flash"), [3, 6])


def test_backward_traffic_ratio_of_the_xla_options_matches_the_compiled_programs(tiny_programs):
    from rpegjax.perf.model.stage_costs import ExecutionOptions

    _, forward, train = tiny_programs
    ratio = train.cost_analysis()["bytes accessed"] / forward.cost_analysis()["bytes accessed"]
    assert ratio == pytest.approx(1 + ExecutionOptions.rpegjax_xla().backward_traffic_ratio, rel=0.1)
