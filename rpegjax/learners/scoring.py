"""Scores a packed batch with a model: per-token log-probs, entropies and values aligned with the tokens.

One forward pass gives the final hidden states h; the token at index i is scored from h[:, i-1]:
    logprobs[:, i] = log softmax(h[:, i-1] W / temperature)[tokens[:, i]]
    entropy[:, i]  = -sum_v p log p of that same distribution
    values[:, i]   = value head(h[:, i-1])   (the value of the state that emits token i)
Index 0 and padding get 0. This is the alignment of `TrainBatch` (see `rpegjax.learners.batch`).
Packed rows (`segment_ids`): each segment is scored as its sequence alone (attention within the segment,
positions from 0 at its start), and each segment's first token gets 0 as index 0 does.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rpegjax.learners.batch import shift_to_tokens
from rpegjax.models.logprobs import logprobs_from_hidden
from rpegjax.models.moe import Routing
from rpegjax.models.transformer import Decoder, default_positions, packed_positions
from rpegjax.sharding.rules import ActivationSharding


@flax.struct.dataclass
class SequenceScores:
    logprobs: Float[Array, "b t"] | None
    entropy: Float[Array, "b t"] | None
    values: Float[Array, "b t"] | None
    routing: Routing | None = None  # a mixture-of-experts model's routing of every token (`Decoder.routed_hidden_states`)


def score_sequences(
    model: Decoder,
    tokens: Int[Array, "b t"],
    token_mask: Bool[Array, "b t"],
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    with_logprobs: bool = True,
    with_entropy: bool = False,
    with_values: bool = False,
    sharding: ActivationSharding | None = None,
    dropout_key: Array | None = None,
    expert_ids: Int[Array, "b t s k"] | None = None,
    segment_ids: Int[Array, "b t"] | None = None,
) -> SequenceScores:
    """Log-probs (and optionally entropies and values) of every token from one forward pass.

    The log-softmax is computed `chunk_size` positions at a time so that [b, t, v] float32 logits
    are never materialised (`rpegjax.models.logprobs.logprobs_from_hidden`). `dropout_key`: the training
    forward's LoRA dropout key (`Decoder.hidden_states`); None everywhere else. `expert_ids`: a mixture-of-experts
    model routes every token to these experts (the rollout's routing, replayed). `segment_ids`: packed rows
    (`rpegjax.learners.packing`); None: one sequence per row.
    """
    if tokens.shape != token_mask.shape:
        raise ValueError(f"score_sequences: tokens {tokens.shape} and token_mask {token_mask.shape} differ in shape")
    if with_entropy and not with_logprobs:
        raise ValueError("score_sequences: with_entropy needs with_logprobs")
    token_mask = token_mask.astype(bool)
    if segment_ids is None:
        positions = default_positions(tokens, token_mask)
        # the first token is never scored (nothing precedes it), so index 0 is masked out too
        scored = token_mask.at[:, 0].set(False)
    else:
        positions = packed_positions(segment_ids)
        scored = token_mask & (positions > 0)  # nor is each segment's first token
    hidden, _, routing = model.routed_hidden_states(tokens, positions, mask=token_mask, sharding=sharding,
                                                    dropout_key=dropout_key, expert_ids=expert_ids,
                                                    segment_ids=segment_ids)

    def aligned(next_token_values: Float[Array, "b t"]) -> Float[Array, "b t"]:
        return jnp.where(scored, shift_to_tokens(next_token_values), 0.0)

    logprobs = entropy = values = None
    if with_logprobs:
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        picked, raw_entropy = logprobs_from_hidden(
            hidden, model.output_kernel(), targets, chunk_size=chunk_size, temperature=temperature,
            with_entropy=with_entropy, dtype=model.cfg.jnp_dtype, sharding=sharding,
        )
        logprobs = aligned(picked)
        entropy = None if raw_entropy is None else aligned(raw_entropy)
    if with_values:
        values = aligned(model.values(hidden))
    return SequenceScores(logprobs=logprobs, entropy=entropy, values=values, routing=routing)


def sequence_logprobs(
    model: Decoder,
    tokens: Int[Array, "b t"],
    token_mask: Bool[Array, "b t"],
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    sharding: ActivationSharding | None = None,
) -> Float[Array, "b t"]:
    """out[:, i] = log p(tokens[:, i] | tokens[:, :i]) for real tokens i >= 1; 0 at index 0 and padding."""
    return score_sequences(
        model, tokens, token_mask, chunk_size=chunk_size, temperature=temperature, sharding=sharding
    ).logprobs


def sequence_values(
    model: Decoder,
    tokens: Int[Array, "b t"],
    token_mask: Bool[Array, "b t"],
    *,
    sharding: ActivationSharding | None = None,
) -> Float[Array, "b t"]:
    """out[:, i] = value head at the state before token i, for real tokens i >= 1; 0 elsewhere."""
    return score_sequences(model, tokens, token_mask, with_logprobs=False, with_values=True, sharding=sharding).values
