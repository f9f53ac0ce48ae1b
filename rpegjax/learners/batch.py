"""The training batch: sampler output packed into fixed-shape arrays that learners consume.

Layout (rows group-contiguous: the G samples of prompt i are rows i*G .. i*G+G-1):

    tokens          [b, t]  prompt then response, left-aligned, right-padded with `pad_id`
    token_mask      [b, t]  prompt or response token (False at padding)
    response_mask   [b, t]  sampled (response) token; the tokens the losses count (a multi-turn row's
                            tool-output tokens are response context, not in this mask)

Per-token float arrays are aligned with `tokens`: index i refers to token tokens[:, i], e.g.
`old_logprobs[:, i] = log pi_old(tokens[:, i] | tokens[:, :i])` and `values[:, i]` is the value of
the state that emits token i. Position 0 is never a response token (every row has a prompt token).
Fields not known yet are None; each learner says which fields its `update` needs.

A packed batch (`rpegjax.learners.packing`) holds several sequences per row, each a contiguous run of
`segment_ids` (1, 2, ... per row; 0 at padding); position 0 of each segment is then a prompt token, and
advantages are per token. None: one sequence per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@flax.struct.dataclass
class TrainBatch:
    """One training batch (a pytree; `None` fields are absent leaves)."""

    tokens: Int[Array, "b t"]
    token_mask: Bool[Array, "b t"]
    response_mask: Bool[Array, "b t"]
    behaviour_logprobs: Float[Array, "b t"] | None = None  # sampler's log-probs (policy that generated)
    old_logprobs: Float[Array, "b t"] | None = None  # proximal / old policy log-probs, recomputed
    ref_logprobs: Float[Array, "b t"] | None = None  # reference policy (KL)
    advantages: Float[Array, " b"] | Float[Array, "b t"] | None = None
    values: Float[Array, "b t"] | None = None  # critic values at generation (PPO)
    returns: Float[Array, "b t"] | None = None  # value targets (PPO)
    rewards: Float[Array, " b"] | None = None  # one scalar reward per sequence
    # a mixture-of-experts rollout's routing of every token (s sparse layers, k experts; -1: none recorded),
    # replayed by the training forward under `router_replay` (`Decoder.routed_hidden_states`)
    expert_ids: Int[Array, "b t s k"] | None = None
    segment_ids: Int[Array, "b t"] | None = None  # packed rows' sequences (None: one per row)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def validate(self) -> None:
        """Raises ValueError naming the field whose shape breaks the layout above."""
        b, t = self.tokens.shape
        for name in ("token_mask", "response_mask", "behaviour_logprobs", "old_logprobs", "ref_logprobs", "values", "returns",
                     "segment_ids"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(value.shape)}, expected {(b, t)} like tokens")
        if self.advantages is not None and tuple(self.advantages.shape) not in ((b,), (b, t)):
            raise ValueError(f"TrainBatch.advantages has shape {tuple(self.advantages.shape)}, expected {(b,)} or {(b, t)}")
        if self.rewards is not None and tuple(self.rewards.shape) != (b,):
            raise ValueError(f"TrainBatch.rewards has shape {tuple(self.rewards.shape)}, expected {(b,)}")
        if self.expert_ids is not None and (self.expert_ids.ndim != 4 or tuple(self.expert_ids.shape[:2]) != (b, t)):
            raise ValueError(f"TrainBatch.expert_ids has shape {tuple(self.expert_ids.shape)}, expected {(b, t)} + "
                             "(sparse layers, experts per token)")

    def require(self, where: str, *names: str) -> None:
        """Raises ValueError if any of `names` is None, saying which component needs it."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{where} needs TrainBatch fields {missing}, which are None; fill them first")


def pack_rollouts(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    behaviour_logprobs: Sequence[Sequence[float] | np.ndarray] | None = None,
    *,
    pad_id: int,
    length: int | None = None,
    rewards: Sequence[float] | np.ndarray | None = None,
    loss_masks: Sequence[np.ndarray | None] | None = None,
    expert_ids: Sequence[np.ndarray | None] | None = None,
) -> TrainBatch:
    """Packs per-row prompts, responses and the sampler's per-response-token log-probs into a TrainBatch.

    Row i is prompt_ids[i] + response_ids[i], right-padded with `pad_id` to `length` (default: the
    longest row) so that jitted learners see one shape. `behaviour_logprobs[i][j]` is the log-prob of
    `response_ids[i][j]` and lands at index `len(prompt_ids[i]) + j`. Arrays are numpy (host); jit moves them.
    `loss_masks[i]` (bool [len(response_ids[i])], optional) marks the response tokens the model sampled: a
    multi-turn row's tool-output tokens (False) stay in `tokens` and `token_mask`, as context, but not in
    `response_mask`, so no loss, KL or entropy term counts them and they get no gradient.
    `expert_ids[i]` ([p + r, sparse layers, k], the sampler's recorded routing, `Completion.expert_ids`) fills
    `TrainBatch.expert_ids` [rows, length, sparse layers, k] (int16, -1 at padding and where none was recorded).
    Raises ValueError naming the row when lengths disagree, a prompt is empty or a row does not fit.
    """
    rows = len(prompt_ids)
    if len(response_ids) != rows:
        raise ValueError(f"pack_rollouts: {rows} prompts but {len(response_ids)} responses")
    if behaviour_logprobs is not None and len(behaviour_logprobs) != rows:
        raise ValueError(f"pack_rollouts: {rows} rows but {len(behaviour_logprobs)} behaviour log-prob rows")
    if loss_masks is not None and len(loss_masks) != rows:
        raise ValueError(f"pack_rollouts: {rows} rows but {len(loss_masks)} loss masks")
    if expert_ids is not None and len(expert_ids) != rows:
        raise ValueError(f"pack_rollouts: {rows} rows but {len(expert_ids)} routing rows")
    if rewards is not None and len(rewards) != rows:
        raise ValueError(f"pack_rollouts: {rows} rows but {len(rewards)} rewards")
    if rows == 0:
        raise ValueError("pack_rollouts: no rows")
    longest = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    length = longest if length is None else length
    if length < 1:
        raise ValueError(f"pack_rollouts: length must be positive, got {length}")
    tokens = np.full((rows, length), pad_id, np.int32)
    token_mask = np.zeros((rows, length), bool)
    response_mask = np.zeros((rows, length), bool)
    logprobs = np.zeros((rows, length), np.float32)
    routing = None if expert_ids is None else _pack_routing(expert_ids, [len(p) + len(r) for p, r in
                                                                         zip(prompt_ids, response_ids)], length)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        p, r = len(prompt), len(response)
        if p == 0:
            raise ValueError(f"pack_rollouts: row {i} has an empty prompt (position 0 must be a prompt token)")
        if p + r > length:
            raise ValueError(f"pack_rollouts: row {i} has {p} prompt + {r} response = {p + r} tokens, more than length={length}")
        tokens[i, :p] = prompt
        tokens[i, p : p + r] = response
        token_mask[i, : p + r] = True
        mask = None if loss_masks is None else loss_masks[i]
        if mask is None:
            response_mask[i, p : p + r] = True
        else:
            mask = np.asarray(mask)
            if mask.shape != (r,) or mask.dtype != bool:
                raise ValueError(f"pack_rollouts: row {i} has {r} response tokens but a loss mask of {mask.dtype} "
                                 f"{mask.shape} (expected bool ({r},))")
            response_mask[i, p : p + r] = mask
        if behaviour_logprobs is not None:
            row = np.asarray(behaviour_logprobs[i], np.float32).reshape(-1)
            if row.shape[0] != r:
                raise ValueError(f"pack_rollouts: row {i} has {r} response tokens but {row.shape[0]} behaviour log-probs")
            logprobs[i, p : p + r] = row
    return TrainBatch(
        tokens=tokens,
        token_mask=token_mask,
        response_mask=response_mask,
        behaviour_logprobs=logprobs if behaviour_logprobs is not None else None,
        rewards=None if rewards is None else np.asarray(rewards, np.float32),
        expert_ids=routing,
    )


def _pack_routing(expert_ids: Sequence[np.ndarray | None], sizes: list[int], length: int) -> np.ndarray:
    """Rows' recorded routing [n, s, k] right-padded with -1 into [rows, length, s, k] int16."""
    missing = [i for i, ids in enumerate(expert_ids) if ids is None]
    if missing:
        raise ValueError(f"pack_rollouts: rows {missing[:8]} carry no recorded routing (router replay needs the "
                         "sampler's routing of every row: Sampler(record_routing=True))")
    shape = np.shape(expert_ids[0])[1:]
    packed = np.full((len(sizes), length, *shape), -1, np.int16)
    for i, (ids, size) in enumerate(zip(expert_ids, sizes, strict=True)):
        if np.shape(ids) != (size, *shape):
            raise ValueError(f"pack_rollouts: row {i} has {size} tokens but routing of shape {np.shape(ids)} "
                             f"(expected {(size, *shape)})")
        packed[i, :size] = ids
    return packed


def shift_to_tokens(next_token_values: Float[Array, "b t"]) -> Float[Array, "b t"]:
    """Turns values indexed by the position that *predicts* a token (out[:, i] scores tokens[:, i+1],
    as `rpegjax.models.logprobs` returns them) into values indexed by the token itself (0 at index 0)."""
    return jnp.concatenate([jnp.zeros_like(next_token_values[:, :1]), next_token_values[:, :-1]], axis=1)
