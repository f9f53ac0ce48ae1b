"""Packing rollouts into a TrainBatch, and scoring it with token-aligned log-probs, entropies and values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rpegjax.learners.batch import TrainBatch, pack_rollouts
from rpegjax.learners.scoring import score_sequences, sequence_logprobs, sequence_values

PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
RESPONSES = [[20, 21], [22, 23, 24, 25], [26], []]
BEHAVIOUR = [np.array([-1.0, -2.0]), [-3.0, -4.0, -5.0, -6.0], [-7.0], []]


def test_pack_rollouts_layout():
    batch = pack_rollouts(PROMPTS, RESPONSES, BEHAVIOUR, pad_id=0, length=8, rewards=[1.0, 0.0, 0.5, 0.0])
    np.testing.assert_array_equal(
        batch.tokens,
        [[5, 6, 7, 20, 21, 0, 0, 0], [8, 22, 23, 24, 25, 0, 0, 0], [9, 10, 26, 0, 0, 0, 0, 0], [11, 12, 13, 14, 0, 0, 0, 0]],
    )
    np.testing.assert_array_equal(batch.token_mask.sum(1), [5, 5, 3, 4])
    np.testing.assert_array_equal(batch.response_mask[0], [0, 0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.response_mask[3], 0)
    assert not batch.response_mask[:, 0].any()
    np.testing.assert_array_equal(batch.behaviour_logprobs[1], [0, -3, -4, -5, -6, 0, 0, 0])
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.5, 0.0])
    assert batch.old_logprobs is None and batch.ref_logprobs is None and batch.advantages is None
    batch.validate()
    assert pack_rollouts(PROMPTS, RESPONSES, None, pad_id=0).tokens.shape == (4, 5)


def test_pack_rollouts_errors_name_the_row():
    with pytest.raises(ValueError, match="row 0 has 3 prompt \\+ 2 response = 5 tokens, more than length=4"):
        pack_rollouts(PROMPTS, RESPONSES, BEHAVIOUR, pad_id=0, length=4)
    with pytest.raises(ValueError, match="row 2 has 1 response tokens but 2 behaviour log-probs"):
        pack_rollouts(PROMPTS, RESPONSES, BEHAVIOUR[:2] + [[-1.0, -2.0], []], pad_id=0)
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        pack_rollouts([[]] + PROMPTS[1:], RESPONSES, None, pad_id=0)
    with pytest.raises(ValueError, match="4 prompts but 3 responses"):
        pack_rollouts(PROMPTS, RESPONSES[:3], None, pad_id=0)


def test_validate_and_require_report_fields():
    batch = pack_rollouts(PROMPTS, RESPONSES, BEHAVIOUR, pad_id=0)
    with pytest.raises(ValueError, match="TrainBatch.old_logprobs has shape \\(4, 3\\)"):
        batch.replace(old_logprobs=np.zeros((4, 3))).validate()
    with pytest.raises(ValueError, match="learner X needs TrainBatch fields \\['ref_logprobs'\\]"):
        batch.require("learner X", "behaviour_logprobs", "ref_logprobs")


def _numpy_log_softmax(logits):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_scores_are_aligned_with_tokens(tiny_model):
    graphdef, state = nnx.split(tiny_model)
    # non-zero value-head weights (in this copy of the state) so that values are informative
    state["value_kernel"] = state["value_kernel"].replace(jnp.linspace(-1.0, 1.0, tiny_model.cfg.hidden_size))
    batch = pack_rollouts(PROMPTS, RESPONSES, BEHAVIOUR, pad_id=0, length=8)
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.token_mask)
    temperature = 0.7

    @jax.jit
    def scores_of(state, tokens, mask):
        m = nnx.merge(graphdef, state)
        scores = score_sequences(m, tokens, mask, chunk_size=3, temperature=temperature, with_entropy=True, with_values=True)
        return scores, sequence_logprobs(m, tokens, mask, chunk_size=3, temperature=temperature), sequence_values(m, tokens, mask)

    @jax.jit
    def reference_of(state, tokens):
        # right padding after a causal prefix changes nothing before it, so no mask is needed here
        m = nnx.merge(graphdef, state)
        hidden, _ = m.hidden_states(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
        return m.logits(hidden), m.values(hidden)

    scores, logprobs, values = scores_of(state, tokens, mask)
    logits, raw_values = (np.asarray(x) for x in reference_of(state, tokens))
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        n = len(prompt) + len(response)
        row = np.asarray(prompt + response)
        log_p = _numpy_log_softmax(logits[i] / temperature)
        want = np.zeros(8)
        want[1:n] = log_p[np.arange(n - 1), row[1:]]
        np.testing.assert_allclose(scores.logprobs[i], want, atol=1e-5)
        want_entropy = np.zeros(8)
        want_entropy[1:n] = -(np.exp(log_p) * log_p).sum(-1)[: n - 1]
        np.testing.assert_allclose(scores.entropy[i], want_entropy, atol=1e-5)
        want_values = np.zeros(8)
        want_values[1:n] = raw_values[i, : n - 1]
        assert np.abs(want_values).max() > 0.01
        np.testing.assert_allclose(scores.values[i], want_values, atol=1e-5)
    np.testing.assert_allclose(logprobs, scores.logprobs, atol=1e-6)
    np.testing.assert_allclose(values, scores.values, atol=1e-6)


def test_train_batch_is_a_pytree():
    batch = pack_rollouts(PROMPTS, RESPONSES, BEHAVIOUR, pad_id=0)
    leaves = jax.tree.leaves(batch)
    assert len(leaves) == 4  # tokens, two masks, behaviour log-probs; None fields are absent
    assert isinstance(jax.tree.map(lambda x: x, batch), TrainBatch)


# ---- multi-turn rows: tool-output tokens are context, never loss ------------------------------------
def _multi_turn_batch():
    """Two rows: turn, tool output, turn (loss mask 1,1 | 0,0,0 | 1) and a plain row."""
    masks = [np.array([True, True, False, False, False, True]), None]
    batch = pack_rollouts([[3, 4], [5]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]],
                          [np.array([-1.0, -2.0, 0.0, 0.0, 0.0, -3.0]), np.array([-1.0, -1.5, -2.0])],
                          pad_id=0, length=9, loss_masks=masks)
    return batch


def test_pack_rollouts_keeps_tool_tokens_as_context_out_of_the_loss():
    batch = _multi_turn_batch()
    np.testing.assert_array_equal(batch.tokens[0], [3, 4, 10, 11, 12, 13, 14, 15, 0])
    np.testing.assert_array_equal(batch.token_mask[0], [1, 1, 1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.response_mask[0], [0, 0, 1, 1, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(batch.response_mask[1], [0, 1, 1, 1, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="row 0 has 2 response tokens but a loss mask of bool \\(3,\\)"):
        pack_rollouts([[1]], [[2, 3]], pad_id=0, loss_masks=[np.ones(3, bool)])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_tool_tokens_get_no_gradient(aggregation):
    """The whole policy objective (clipped surrogate, decoupled importance weights, KL, entropy bonus): its
    gradient w.r.t. the logits at tool-output positions is exactly 0, and changing those positions' logits or
    old / reference / behaviour log-probs leaves the loss bit-identical."""
    from rpegjax.learners.objective import (
        PolicyConfig,
        policy_denominators,
        policy_objective,
    )

    batch = _multi_turn_batch()
    b, t = batch.tokens.shape
    rng = np.random.default_rng(0)
    vocab = 24
    noisy = lambda: jnp.asarray(rng.normal(-2.0, 0.5, (b, t)), jnp.float32)  # noqa: E731
    batch = batch.replace(old_logprobs=noisy(), ref_logprobs=noisy(), behaviour_logprobs=noisy(),
                          advantages=jnp.asarray([1.5, -0.7], jnp.float32))
    cfg = PolicyConfig(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01, decoupled=True, importance_cap=2.0)
    tool = np.zeros((b, t), bool)
    tool[0, 4:7] = True  # the tool output of row 0 (tokens 12, 13, 14)

    def loss_of(logits, batch):  # logits[:, i] is the distribution of token i
        logp = jax.nn.log_softmax(logits)
        logprobs = jnp.take_along_axis(logp, jnp.asarray(batch.tokens)[..., None], axis=-1)[..., 0]
        entropy = -(jnp.exp(logp) * logp).sum(-1)
        return policy_objective(cfg, logprobs, entropy, batch, policy_denominators(cfg, batch))[0]

    logits = jnp.asarray(rng.normal(size=(b, t, vocab)), jnp.float32)
    loss, grad = jax.value_and_grad(loss_of)(logits, batch)
    grad = np.asarray(grad)
    assert np.all(grad[tool] == 0.0)
    assert np.abs(grad[np.asarray(batch.response_mask)]).sum(-1).min() > 0  # every model token does get gradient

    changed = batch.replace(**{name: jnp.where(tool, getattr(batch, name) - 5.0, getattr(batch, name))
                               for name in ("old_logprobs", "ref_logprobs", "behaviour_logprobs")})
    other_logits = jnp.where(tool[..., None], logits * 3.0 + 1.0, logits)
    assert float(loss_of(other_logits, changed)) == float(loss)
    # the same rows without masks would count the tool tokens: the test can fail
    unmasked = batch.replace(response_mask=np.asarray(batch.response_mask) | tool)
    assert np.any(np.asarray(jax.grad(loss_of)(logits, unmasked))[tool] != 0.0)
