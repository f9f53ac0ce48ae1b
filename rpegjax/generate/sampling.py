"""Sampling rules: temperature, top-k, top-p, min-p, greedy; behaviour log-probs; per-row PRNG keys.

`SamplingConfig` is what callers write. Inside jitted code it travels as `SamplingArrays`: the knobs
that may change between calls without recompiling (temperature, top-p and min-p values, EOS id, the
stop-token table) are arrays, the ones that change the program (greedy, top-k, whether top-p and
min-p filters run at all) are static fields of the pytree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How tokens are drawn and when a sequence ends.

    * `max_new_tokens`: most response tokens per sequence (finish reason `length` when reached).
    * `temperature`: logits are divided by it before filtering and sampling (ignored when `greedy`).
    * `top_k` (0 = off), `top_p` (1 = off), `min_p` (0 = off): filters applied in that order to the
      temperature-scaled distribution, see `filter_logits`.
    * `greedy`: argmax instead of sampling; behaviour log-probs are then those of temperature 1.
    * `stop_ids`: tokens that end a sequence (finish reason `stop`); the stop token is kept in the response.
    * `stop_sequences`: token sequences that end a sequence when its response ends with one (finish reason
      `stop`, the sequence kept), e.g. a closing tag the tokenizer splits into several tokens. Matched on token
      ids: the tag must be generated as the tokenizer encodes it alone.
    * `eos_id`: end-of-sequence token (finish reason `eos`); None takes the model config's `eos_token_id`.
    * `ignore_eos`: never stop on EOS (benchmarks that need exact lengths).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    eos_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.greedy and not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                                    and self.temperature > 0):
            raise ValueError(
                f"SamplingConfig.temperature must be a finite number > 0 (or set greedy=True), got {self.temperature!r}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingConfig.top_p must lie in (0, 1] (1 disables it), got {self.top_p!r}")
        if not (isinstance(self.min_p, int | float) and 0.0 <= self.min_p < 1.0):
            raise ValueError(f"SamplingConfig.min_p must lie in [0, 1) (0 disables it), got {self.min_p!r}")
        if isinstance(self.stop_ids, int) or not isinstance(self.stop_ids, Sequence):
            raise ValueError(f"SamplingConfig.stop_ids must be a sequence of token ids, got {self.stop_ids!r}")
        stop_ids = tuple(self.stop_ids)
        for token in stop_ids:
            if isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0:
                raise ValueError(f"SamplingConfig.stop_ids must hold token ids >= 0, got {token!r} in {stop_ids}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in stop_ids))
        if isinstance(self.stop_sequences, str | int) or not isinstance(self.stop_sequences, Sequence):
            raise ValueError(f"SamplingConfig.stop_sequences must be a sequence of token-id sequences, got "
                             f"{self.stop_sequences!r}")
        sequences = []
        for sequence in self.stop_sequences:
            if (isinstance(sequence, str | int) or not isinstance(sequence, Sequence) or not sequence
                    or any(isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 0 for t in sequence)):
                raise ValueError(f"SamplingConfig.stop_sequences must hold non-empty sequences of token ids >= 0, got "
                                 f"{sequence!r} in {self.stop_sequences!r}")
            sequences.append(tuple(int(t) for t in sequence))
        object.__setattr__(self, "stop_sequences", tuple(sequences))
        if self.eos_id is not None and (isinstance(self.eos_id, bool) or not isinstance(self.eos_id, int) or self.eos_id < 0):
            raise ValueError(f"SamplingConfig.eos_id must be None or a token id >= 0, got {self.eos_id!r}")

    def replace(self, **changes) -> SamplingConfig:
        return dataclasses.replace(self, **changes)


@flax.struct.dataclass
class SamplingArrays:
    """`SamplingConfig` as jit sees it: traced knobs plus static program switches."""

    temperature: Float[Array, ""]
    top_p: Float[Array, ""]
    min_p: Float[Array, ""]
    eos_id: Int[Array, ""]  # -1 when no token ends a sequence as EOS
    is_stop: Bool[Array, " v"]
    # multi-token stop sequences, right-aligned and left-padded with -1: [n, longest] (None without any)
    stop_table: Int[Array, "n l"] | None
    greedy: bool = flax.struct.field(pytree_node=False)
    top_k: int = flax.struct.field(pytree_node=False)
    filter_top_p: bool = flax.struct.field(pytree_node=False)
    filter_min_p: bool = flax.struct.field(pytree_node=False)


def sampling_arrays(sampling: SamplingConfig, *, vocab_size: int, default_eos_id: int | None) -> SamplingArrays:
    """Checks the token ids of `sampling` against the vocabulary and builds its jit form."""
    eos = sampling.eos_id if sampling.eos_id is not None else default_eos_id
    if sampling.ignore_eos:
        eos = None
    if eos is not None and not 0 <= eos < vocab_size:
        raise ValueError(f"EOS id {eos} is outside the vocabulary [0, {vocab_size})")
    is_stop = np.zeros((vocab_size,), bool)
    for token in sampling.stop_ids:
        if token >= vocab_size:
            raise ValueError(f"SamplingConfig.stop_ids: {token} is outside the vocabulary [0, {vocab_size})")
        is_stop[token] = True
    stop_table = None
    longer = [sequence for sequence in sampling.stop_sequences if len(sequence) > 1]
    for sequence in sampling.stop_sequences:
        if max(sequence) >= vocab_size:
            raise ValueError(f"SamplingConfig.stop_sequences: {sequence} holds a token outside the vocabulary "
                             f"[0, {vocab_size})")
        if len(sequence) == 1:  # one token: the same as a stop id
            is_stop[sequence[0]] = True
    if longer:
        stop_table = np.full((len(longer), max(map(len, longer))), -1, np.int32)
        for row, sequence in enumerate(longer):
            stop_table[row, stop_table.shape[1] - len(sequence):] = sequence
    return SamplingArrays(
        temperature=np.float32(1.0 if sampling.greedy else sampling.temperature),
        top_p=np.float32(sampling.top_p),
        min_p=np.float32(sampling.min_p),
        eos_id=np.int32(-1 if eos is None else eos),
        is_stop=is_stop,
        stop_table=stop_table,
        greedy=sampling.greedy,
        top_k=0 if sampling.top_k >= vocab_size else sampling.top_k,
        filter_top_p=sampling.top_p < 1.0,
        filter_min_p=sampling.min_p > 0.0,
    )


def filter_logits(
    logits: Float[Array, "b v"],
    *,
    top_k: int = 0,
    top_p: Float[Array, ""] | float | None = None,
    min_p: Float[Array, ""] | float | None = None,
) -> Float[Array, "b v"]:
    """Sets to -inf every logit that top-k, then top-p, then min-p remove (None / 0 = filter off).

    On the tokens sorted by decreasing logit, with p the softmax of what earlier filters kept:
    * top-k keeps ranks < k;
    * top-p keeps token i when the mass strictly before it, sum_{j<i} p_j, is < top_p (the smallest
      prefix whose mass reaches top_p; the most likely token always stays);
    * min-p keeps p_i >= min_p * p_0, i.e. logit_i - logit_0 >= log(min_p) (renormalising after
      top-k/top-p does not change that ratio).
    Each filter keeps a prefix of the sorted order, so the result is a threshold on the logit; tokens
    tied with the last kept one are kept too. This is the order and maths of `transformers`' warpers.
    """
    threshold = kept_threshold(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    return logits if threshold is None else jnp.where(logits >= threshold, logits, _NEG_INF)


def kept_threshold(
    logits: Float[Array, "b v"],
    *,
    top_k: int = 0,
    top_p: Float[Array, ""] | float | None = None,
    min_p: Float[Array, ""] | float | None = None,
) -> Float[Array, "b 1"] | None:
    """The smallest logit `filter_logits` keeps in each row (None when no filter is on): it keeps exactly the
    logits >= this threshold."""
    if not top_k and top_p is None and min_p is None:
        return None
    # every filter keeps a prefix of the top-k ranks: only those are sorted (the whole vocabulary without top-k)
    ranked = top_k if top_k and top_k < logits.shape[-1] else logits.shape[-1]
    sorted_logits = jax.lax.top_k(logits, ranked)[0]  # b ranked, descending
    kept = jnp.full(logits.shape[:-1], ranked, jnp.int32)  # length of the kept prefix per row
    if top_p is not None:
        probs = jax.nn.softmax(sorted_logits, axis=-1)  # renormalised over the top-k
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.minimum(kept, jnp.maximum(jnp.sum(mass_before < top_p, axis=-1), 1))
    if min_p is not None:
        relative = sorted_logits - sorted_logits[:, :1]
        kept = jnp.minimum(kept, jnp.maximum(jnp.sum(relative >= jnp.log(min_p), axis=-1), 1))
    return jnp.take_along_axis(sorted_logits, (kept - 1)[:, None], axis=-1)


def row_step_keys(
    key: Array, prompt_index: Int[Array, " b"], sample_index: Int[Array, " b"], step: Int[Array, " b"]
) -> Array:
    """One PRNG key per row, a function of (key, prompt_index, sample_index, step) only.

    Whatever slot or batch a sequence lands in, the randomness of its step-th token is the same, so
    continuous batching, static batching and any sharding draw identical samples for one key.
    """
    def one(p, s, n):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, p), s), n)

    return jax.vmap(one)(prompt_index, sample_index, step)


def sample_tokens(
    logits: Float[Array, "b v"], keys: Array, sampling: SamplingArrays
) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """Draws one token per row and returns it with its behaviour log-prob.

    Token: argmax(logits) when greedy, else a draw from softmax(filter_logits(logits / T)), by inverse CDF
    (`draw_from_weights`) on w = exp(logits / T - max) zeroed outside the filter: the same exponentials
    the log-prob's normaliser sums, and two uniforms per row (no per-vocabulary noise or logarithm).
    Behaviour log-prob: log softmax(logits / T)[token], i.e. BEFORE top-k/top-p/min-p filtering
    (T = 1 when greedy). Why: the learner scores the same tokens with a teacher-forced forward at
    temperature T and no truncation, and the off-policy ratio exp(logp_learner - logp_behaviour) must
    be exactly 1 when the weights are the same, so that it measures only weight staleness (bounded
    asynchrony) and numerics. Recording the renormalised truncated probability instead would bias
    that ratio below 1 on every step even fully on-policy. The price: with filters on, tokens are drawn
    from the truncated distribution, which the recorded log-probs describe up to its renormalisation.
    """
    logits = logits.astype(jnp.float32)
    scaled = logits / sampling.temperature
    shifted = scaled - jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.exp(shifted)
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        threshold = kept_threshold(
            scaled,
            top_k=sampling.top_k,
            top_p=sampling.top_p if sampling.filter_top_p else None,
            min_p=sampling.min_p if sampling.filter_min_p else None,
        )
        kept = weights if threshold is None else jnp.where(scaled >= threshold, weights, 0.0)
        uniforms = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)
        tokens = draw_from_weights(kept, uniforms)
    log_normaliser = jnp.log(jnp.sum(weights, axis=-1))
    return tokens, jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_normaliser


def draw_from_weights(weights: Float[Array, "b v"], uniforms: Float[Array, "b 2"]) -> Int[Array, " b"]:
    """Index i of each row with probability weights_i / sum(weights) (weights >= 0, some > 0), by inverse CDF
    in two levels: the vocabulary is cut into n blocks of m (n m >= v, zero-padded), uniforms[:, 0] picks block
    j with probability W_j / sum(W) (W_j its summed weight), uniforms[:, 1] picks i in it with probability
    weights_i / W_j; the product is weights_i / sum(weights). Each level quantises a probability to its own
    uniform's 2^-23 steps of the level's mass, so a token is resolved relative to its block's mass, not only to
    the row's (Gumbel-max's float32 noise has a like floor: its noise spans about -4.5 to 15.9, so no token more
    than ~20 nats below the best can win).
    Cost: two prefix sums of about sqrt(v) values and a gather of one block per row, instead of v uniforms and
    2 v logarithms."""
    rows, vocab = weights.shape
    size = _block_size(vocab)
    blocks = -(-vocab // size)
    padded = jnp.pad(weights, ((0, 0), (0, blocks * size - vocab))).reshape(rows, blocks, size)
    block = _inverse_cdf(jnp.sum(padded, axis=-1), uniforms[:, 0])
    inside = jnp.take_along_axis(padded, block[:, None, None], axis=1)[:, 0]  # b m
    return block * size + _inverse_cdf(inside, uniforms[:, 1])


def _block_size(vocab: int) -> int:
    """Block length m for `draw_from_weights`: the divisor of `vocab` closest to sqrt(vocab) from above when
    the blocks' count and length then add up to at most 1.5 x the best possible (2 sqrt(v)); else ceil(sqrt(v))
    (padded)."""
    root = math.isqrt(vocab - 1) + 1  # ceil(sqrt(vocab))
    divisor = next(m for m in range(root, vocab + 1) if vocab % m == 0)
    return divisor if divisor + vocab // divisor <= 3 * root else root


def _inverse_cdf(weights: Float[Array, "b n"], uniforms: Float[Array, " b"]) -> Int[Array, " b"]:
    """First i with weights_i > 0 and prefix sum c_i > u c_{n-1}: i with probability weights_i / c_{n-1}.

    Only a positive weight can be drawn, even where float rounding makes the prefix sums non-monotone; when
    rounding leaves no prefix sum above the target (u within an ulp of 1), the last positive weight is taken.
    The prefix sum is `associative_scan` (log n passes): `jnp.cumsum` lowers to an O(n^2) reduce window on
    XLA:CPU."""
    cumulative = jax.lax.associative_scan(jnp.add, weights, axis=-1)
    positive = weights > 0
    hit = (cumulative > uniforms[:, None] * cumulative[:, -1:]) & positive
    last = weights.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last).astype(jnp.int32)
