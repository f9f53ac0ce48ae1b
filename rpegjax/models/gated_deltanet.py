"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (Yang et al., "Gated Delta Networks").

Per token t and value head h (key head kh = h // (H / K) serves H / K consecutive value heads):

    [q, k, v]_t = silu(causal_conv(x W_qkv))_t          short depthwise causal convolution of w taps
    q_t = l2norm(q_t) / sqrt(dk),  k_t = l2norm(k_t)     l2norm(x) = x / sqrt(sum x^2 + 1e-6)
    beta_t = sigmoid(x_t W_b),  g_t = -exp(log_rate) softplus(x_t W_a + time_step_bias)     (per head, float32)
    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T                     S [dk, dv], float32
    o_t = S_t^T q_t
    y_t = W_out (rmsnorm(o_t) * norm_scale * silu(x_t W_z))                                  per head over dv

The state S is a fixed [H, dk, dv] per sequence: a layer's cost is linear in the length and its generation state
does not grow. Training runs the chunked form (`chunked_gated_delta_rule`: the WY/UT transform inside chunks of C
tokens, a `lax.scan` carrying S between chunks: O(t C (dk + dv) + t dk dv) work per head); generation steps the
recurrence (`recurrent_gated_delta_rule`) from a per-sequence state (`DeltaNetState`: S and the convolution's last
w - 1 inputs). Both equal transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`.

Packed rows (`segment_ids`, contiguous runs of one id) restart S and the convolution at every segment start: inside
a chunk, token i sees token j only when they share a segment, and reads the state carried into the chunk only when
its segment began before it. Padding (`mask` False) is inert: its convolution input is zero (as transformers zeroes
padded hidden states) and it neither decays nor writes the state (g = 0, beta = 0), so a right-padded prefill ends
with the state after each row's last real token.

Parameters (ours; the Hugging Face tensors are in `hf_layout`). The q/k/v channels are grouped by key head, so that a
split of the key heads over `tensor` keeps each device's q, k and v (and its value heads) together:

    qkv_proj        [d, K, 2 dk + (H/K) dv]   per key head: its q, its k, its group's v
    conv            [K, 2 dk + (H/K) dv, w]   depthwise kernel, tap w-1 on the current token
    z_proj          [d, H, dv]                the output gate
    b_proj, a_proj  [d, H]                    beta's and the decay's inputs
    log_rate        [H]                       A_log in Hugging Face's checkpoints
    time_step_bias  [H]                       dt_bias
    norm_scale      [dv]                      the gated RMSNorm's weight (a plain scale, not 1 + w)
    out_proj        [H, dv, d]
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.config import ModelConfig
from rpegjax.models.hf_maps import Maps, Window, identity, in_projection, out_projection, transposed
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain

L2_NORM_EPS = 1e-6  # transformers' and flash-linear-attention's l2norm epsilon (not the config's rms_norm_eps)
DEFAULT_CHUNK = 64


@flax.struct.dataclass
class DeltaNetState:
    """What one Gated DeltaNet layer keeps per sequence between generation calls: the recurrent state and the
    convolution's window (its last w - 1 inputs, oldest first; zeros before a sequence's first token)."""

    recurrent: Float[Array, "b h dk dv"]  # float32
    conv: Float[Array, "b w c"]  # w = kernel - 1 positions of the K * (2 dk + (H/K) dv) grouped channels

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, dtype=None) -> DeltaNetState:
        return cls(recurrent=jnp.zeros(recurrent_shape(cfg, batch), jnp.float32),
                   conv=jnp.zeros(conv_window_shape(cfg, batch), cfg.jnp_dtype if dtype is None else dtype))

    @staticmethod
    def recurrent_logical_axes() -> tuple[str | None, ...]:
        return (axes.BATCH, axes.HEADS, None, None)

    @staticmethod
    def conv_logical_axes() -> tuple[str | None, ...]:
        # the channels are grouped by key head: split over `tensor` as the key heads are
        return (axes.BATCH, None, axes.KV_HEADS)


def channels_per_key_head(cfg: ModelConfig) -> int:
    """2 dk + (H / K) dv: one key head's q and k and its value heads' v."""
    group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return 2 * cfg.linear_key_head_dim + group * cfg.linear_value_head_dim


def recurrent_shape(cfg: ModelConfig, batch: int) -> tuple[int, int, int, int]:
    return (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def conv_window_shape(cfg: ModelConfig, batch: int) -> tuple[int, int, int]:
    return (batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_num_key_heads * channels_per_key_head(cfg))


# ---- the short convolution ---------------------------------------------------------------------------------
def causal_conv(
    x: Float[Array, "b t c"],
    kernel: Float[Array, "c w"],
    window: Float[Array, "b v c"] | None = None,
    segment_ids: Int[Array, "b t"] | None = None,
    lengths: Int[Array, " b"] | None = None,
) -> tuple[Float[Array, "b t c"], Float[Array, "b v c"]]:
    """silu(y) with y_t = sum_j kernel[:, j] x_{t - (w-1) + j} (depthwise, causal, v = w - 1 earlier inputs), and the
    window that continues the sequence after each row's `lengths` tokens (default t).

    Inputs before the sequence come from `window` (zeros when None); with `segment_ids`, inputs of an earlier
    segment read as zero (each packed sequence convolves alone). Computed in float32, returned in x's dtype.
    """
    b, t, c = x.shape
    taps = kernel.shape[1]
    before = jnp.zeros((b, taps - 1, c), x.dtype) if window is None else window.astype(x.dtype)
    padded = jnp.concatenate([before, x], axis=1)  # b (v + t) c: padded[v + i] is x_i
    kernel32 = kernel.astype(jnp.float32)
    y = jnp.zeros((b, t, c), jnp.float32)
    for j in range(taps):
        shift = taps - 1 - j  # this tap reads x_{i - shift}
        term = padded[:, j:j + t].astype(jnp.float32) * kernel32[:, j]
        if segment_ids is not None and shift:
            earlier = jnp.concatenate([jnp.full((b, shift), -1, segment_ids.dtype), segment_ids[:, :t - shift]], 1)
            term = jnp.where((earlier == segment_ids)[..., None], term, 0.0)
        y = y + term
    ends = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    # the window after a row's n tokens is padded[n .. n + v - 1] (its last v inputs, earlier window included)
    index = ends[:, None] + jnp.arange(taps - 1)[None, :]
    new_window = jnp.take_along_axis(padded, index[..., None], axis=1)
    return jax.nn.silu(y).astype(x.dtype), new_window


# ---- the delta rule ----------------------------------------------------------------------------------------
def l2_normalize(x: Float[Array, "... e"]) -> Float[Array, "... e"]:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def recurrent_gated_delta_rule(
    q: Float[Array, "b t h dk"],
    k: Float[Array, "b t h dk"],
    v: Float[Array, "b t h dv"],
    g: Float[Array, "b t h"],
    beta: Float[Array, "b t h"],
    state: Float[Array, "b h dk dv"] | None = None,
) -> tuple[Float[Array, "b t h dv"], Float[Array, "b h dk dv"]]:
    """The recurrence token by token (the module docstring's S_t and o_t), float32; q and k already normalised and
    q scaled. The decode step (t = 1) and the reference the chunked form is tested against."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs  # b h dk, b h dk, b h dv, b h, b h
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + k_t[..., :, None] * (beta_t[..., None] * (v_t - predicted))[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    inputs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, inputs)
    return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta_rule(
    q: Float[Array, "b t h dk"],
    k: Float[Array, "b t h dk"],
    v: Float[Array, "b t h dv"],
    g: Float[Array, "b t h"],
    beta: Float[Array, "b t h"],
    state: Float[Array, "b h dk dv"] | None = None,
    segment_ids: Int[Array, "b t"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Float[Array, "b t h dv"], Float[Array, "b h dk dv"]]:
    """The recurrence of `recurrent_gated_delta_rule` over chunks of C tokens, float32.

    With G_i the cumulative log-decay inside a chunk, M_ij = [j <= i, same segment] and c_i = [token i's segment
    began before the chunk] (the carried-in state S_0 reaches it), the chunk's new values u solve the unit
    lower-triangular system (UT transform)

        u_i + sum_{j<i} beta_i (k_i . k_j) e^{G_i - G_j} M_ij u_j = beta_i v_i - beta_i c_i e^{G_i} S_0^T k_i,
        o_i = c_i e^{G_i} S_0^T q_i + sum_{j<=i} (q_i . k_j) e^{G_i - G_j} M_ij u_j,
        S_C = c_C e^{G_C} S_0 + sum_j e^{G_C - G_j} M_Cj k_j u_j^T,

    one `lax.scan` over chunks carrying S whose body computes its chunk's [C, C] products and triangular solve and is
    rematerialised: what the backward keeps is each chunk's S (an [h, dk, dv] float32 per C tokens) and the inputs,
    not the [C, C] and [C, dk + dv] intermediates of every chunk at once. `state` belongs to the first segment of
    each row; returns the outputs and the state after each row's last token.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    size = min(chunk_size, t)
    pad = -t % size
    n = (t + pad) // size
    segments = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    def chunks(a: Array) -> Array:  # b t ... -> n b C ...
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, n, size, *a.shape[2:]), 1, 0)

    # padding tokens continue the last segment and are inert (k = v = 0, beta = 0, no decay)
    segments = jnp.pad(segments, [(0, 0), (0, pad)], mode="edge").reshape(b, n, size)
    previous = jnp.concatenate([segments[:, :1, :1], segments[:, :-1, -1:]], axis=1)  # segment before each chunk
    xs = (*(chunks(a.astype(jnp.float32)) for a in (q, k, v, g, beta)), jnp.moveaxis(segments, 1, 0),
          jnp.moveaxis(previous, 1, 0))
    lower = jnp.tril(jnp.ones((size, size), bool))
    strictly_lower = jnp.tril(jnp.ones((size, size), bool), -1)

    def step(s, chunk):
        q, k, v, g, beta, segments, previous = chunk  # b C h e, b C h, b C, b 1
        q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # b h C e
        g, beta = jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2)  # b h C
        carried = (segments == previous)[:, None]  # b 1 C: c_i
        same = ((segments[:, :, None] == segments[:, None, :]) & lower)[:, None]  # b 1 C C: M_ij
        decay = jnp.cumsum(g, axis=-1)  # b h C: G_i
        # masked in log space before exp: e^{G_i - G_j} for i < j would overflow
        pairwise = jnp.exp(jnp.where(same, decay[..., :, None] - decay[..., None, :], -jnp.inf))
        k_beta = k * beta[..., None]
        system = jnp.where(strictly_lower, (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise, 0.0) + jnp.eye(size)
        gathered = jnp.exp(decay) * carried  # c_i e^{G_i}
        rhs = jnp.concatenate([v * beta[..., None], k_beta * gathered[..., None]], axis=-1)
        solved = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
        u = solved[..., :dv] - solved[..., dv:] @ s  # the new values, S_0's part taken out
        out = (q * gathered[..., None]) @ s + ((q @ jnp.swapaxes(k, -1, -2)) * pairwise) @ u
        last = (segments == segments[:, -1:])[:, None]  # b 1 C: tokens of the chunk's last segment (M_Cj)
        to_end = jnp.exp(jnp.where(last, decay[..., -1:] - decay, -jnp.inf))  # e^{G_C - G_j} M_Cj
        chunk_decay = (jnp.exp(decay[..., -1]) * carried[..., -1])[..., None, None]  # b h 1 1
        return chunk_decay * s + jnp.swapaxes(k * to_end[..., None], -1, -2) @ u, jnp.swapaxes(out, 1, 2)

    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    state, out = jax.lax.scan(jax.checkpoint(step), state, xs)  # out: n b C h dv
    return jnp.moveaxis(out, 0, 1).reshape(b, n * size, h, dv)[:, :t], state


def gated_rms_norm(o: Float[Array, "... e"], gate: Float[Array, "... e"], scale: Float[Array, " e"],
                   eps: float) -> Float[Array, "... e"]:
    """rmsnorm(o) * scale * silu(gate) in float32 (transformers' RMSNormGated: the norm before the gate)."""
    o = o.astype(jnp.float32)
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    return normed * scale.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))


# ---- the layer ---------------------------------------------------------------------------------------------
def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, fan_in: int) -> nnx.Param:
    value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(value.astype(dtype), logical_axes=logical)


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet mixer (the module docstring's maths and parameters); `cfg.linear_*` give its shapes."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, pdt = cfg.hidden_size, cfg.jnp_param_dtype
        kh, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, taps = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        if not kh:
            raise ValueError("GatedDeltaNet: the config has no Gated DeltaNet shapes (linear_num_key_heads=0)")
        c = channels_per_key_head(cfg)
        self.qkv_proj = _normal(rngs, (d, kh, c), (axes.EMBED, axes.KV_HEADS, None), pdt, d)
        self.conv = _normal(rngs, (kh, c, taps), (axes.KV_HEADS, None, None), pdt, taps)
        self.z_proj = _normal(rngs, (d, h, dv), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), pdt, d)
        self.b_proj = _normal(rngs, (d, h), (axes.EMBED, axes.HEADS), pdt, d)
        self.a_proj = _normal(rngs, (d, h), (axes.EMBED, axes.HEADS), pdt, d)
        # transformers' initialisation: A ~ U(1, 16) (log stored), dt_bias = 1
        rate = jax.random.uniform(rngs.params(), (h,), jnp.float32, 1.0, 16.0)
        self.log_rate = nnx.Param(jnp.log(rate).astype(pdt), logical_axes=(axes.HEADS,))
        self.time_step_bias = nnx.Param(jnp.ones((h,), pdt), logical_axes=(axes.HEADS,))
        self.norm_scale = nnx.Param(jnp.ones((dv,), pdt), logical_axes=(axes.HEAD_DIM,))
        self.out_proj = _normal(rngs, (h, dv, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), pdt, h * dv)
        self.shape = (kh, h, dk, dv)
        self.eps = cfg.rms_norm_eps
        self.dtype = cfg.jnp_dtype

    def _matmul(self, name: str, x: Float[Array, "n i"], sharding: ActivationSharding | None) -> Array:
        variable = getattr(self, name)
        w = variable.get_value().astype(self.dtype)
        if sharding is not None:  # FSDP's gather made explicit, as for the attention projections
            w = sharding.gathered_weight(w, tuple(variable.get_metadata()["logical_axes"]), name=name)
        return x @ w.reshape(x.shape[-1], -1)

    def __call__(
        self,
        x: Float[Array, "b t d"],
        mask: Bool[Array, "b t"] | None,
        sharding: ActivationSharding | None,
        *,
        segment_ids: Int[Array, "b t"] | None = None,
        state: DeltaNetState | None = None,
        chunk_size: int = DEFAULT_CHUNK,
    ) -> tuple[Float[Array, "b t d"], DeltaNetState | None]:
        """The layer's output; with `state` (generation) also the state after each row's real tokens (`mask`: real
        tokens, right-padded in a prefill; None: all). Without, the full-sequence (training) forward from a zero
        state, `segment_ids` restarting it per packed sequence. One token with a state steps the recurrence; more
        run the chunked form from it."""
        if state is not None and segment_ids is not None:
            raise ValueError("GatedDeltaNet: packed rows (segment_ids) are for the full-sequence forward, not a "
                             "generation call with a state")
        if sharding is not None and sharding.shards(axes.SEQ) > 1:
            raise ValueError("GatedDeltaNet: a linear-attention layer does not run with a context axis (its state "
                             "passes along the sequence); plan without context parallelism")
        b, t, d = x.shape
        kh, h, dk, dv = self.shape
        flat = x.reshape(b * t, d).astype(self.dtype)
        mixed = self._matmul("qkv_proj", flat, sharding).reshape(b, t, -1)  # b t (K c), grouped by key head
        if mask is not None:  # padding convolves as zeros (transformers zeroes padded hidden states)
            mixed = jnp.where(mask[..., None], mixed, 0)
        lengths = None if mask is None else jnp.sum(mask, axis=-1).astype(jnp.int32)
        kernel = self.conv.get_value().reshape(-1, self.conv.get_value().shape[-1])
        window = None if state is None else state.conv
        mixed, new_window = causal_conv(mixed, kernel, window, segment_ids, lengths)
        mixed = constrain(mixed.reshape(b, t, kh, -1), sharding, (axes.BATCH, axes.SEQ, axes.KV_HEADS, None))
        group = h // kh
        q, k = l2_normalize(mixed[..., :dk]) / math.sqrt(dk), l2_normalize(mixed[..., dk:2 * dk])
        q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)  # key head i serves value heads i g ...
        v = mixed[..., 2 * dk:].reshape(b, t, h, dv)
        beta = jax.nn.sigmoid(self._matmul("b_proj", flat, sharding).astype(jnp.float32)).reshape(b, t, h)
        a = self._matmul("a_proj", flat, sharding).astype(jnp.float32).reshape(b, t, h)
        rate = jnp.exp(self.log_rate.get_value().astype(jnp.float32))
        g = -rate * jax.nn.softplus(a + self.time_step_bias.get_value().astype(jnp.float32))
        if mask is not None:  # padding neither decays nor writes the state
            beta, g = jnp.where(mask[..., None], beta, 0.0), jnp.where(mask[..., None], g, 0.0)
        initial = None if state is None else state.recurrent
        if state is not None and t == 1:
            out, recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
        else:
            out, recurrent = chunked_gated_delta_rule(q, k, v, g, beta, initial, segment_ids, chunk_size)
        out = constrain(out, sharding, (axes.BATCH, axes.SEQ, axes.HEADS, None))
        z = self._matmul("z_proj", flat, sharding).reshape(b, t, h, dv)
        normed = gated_rms_norm(out, z, self.norm_scale.get_value(), self.eps).astype(self.dtype)
        y = self._matmul("out_proj", normed.reshape(b * t, h * dv), sharding).reshape(b, t, d)
        return y, None if state is None else DeltaNetState(recurrent=recurrent, conv=new_window)


# ---- Hugging Face tensors ----------------------------------------------------------------------------------
# Hugging Face orders the convolved channels [q (K dk) | k (K dk) | v (H dv)]; ours group them by key head
# (`channels_per_key_head`). Maps as in `hf_maps`.
def _grouped(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """x [..., C] in Hugging Face's channel order -> [..., K, c] grouped by key head."""
    kh, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    lead = x.shape[:-1]
    q, k, v = x[..., :kh * dk], x[..., kh * dk:2 * kh * dk], x[..., 2 * kh * dk:]
    return np.concatenate([q.reshape(*lead, kh, dk), k.reshape(*lead, kh, dk), v.reshape(*lead, kh, -1)], axis=-1)


def _ungrouped(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """x [..., K, c] grouped by key head -> [..., C] in Hugging Face's channel order."""
    kh, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    lead = x.shape[:-2]
    parts = (x[..., :dk], x[..., dk:2 * dk], x[..., 2 * dk:])
    return np.concatenate([part.reshape(*lead, kh * part.shape[-1]) for part in parts], axis=-1)


def _qkv_maps(cfg: ModelConfig) -> Maps:
    """in_proj_qkv.weight [C, d] <-> qkv_proj [d, K, c]. A window reads every channel of its embedding columns (the
    q, k and v rows of a key head are three separate runs of HF rows) and keeps its heads."""

    def window(ours: Window):
        dims, heads, inner = ours
        return (slice(0, to_hf_rows(cfg)), dims), lambda w: _grouped(w.T, cfg)[:, heads, inner]

    return (lambda w: _grouped(w.T, cfg)), (lambda w: _ungrouped(w, cfg).T), window


def _conv_maps(cfg: ModelConfig) -> Maps:
    """conv1d.weight [C, 1, w] <-> conv [K, c, w]."""

    def to_ours(w):  # [C, 1, w] -> [w, K, c] -> [K, c, w]
        return _grouped(w[:, 0, :].T, cfg).transpose(1, 2, 0)

    def to_hf(w):  # [K, c, w] -> [w, C] -> [C, 1, w]
        return _ungrouped(w.transpose(2, 0, 1), cfg).T[:, None, :]

    def window(ours: Window):
        heads, inner, taps = ours
        return (slice(0, to_hf_rows(cfg)), slice(0, 1), slice(0, cfg.linear_conv_kernel_dim)), \
            lambda w: to_ours(w)[heads, inner, taps]

    return to_ours, to_hf, window


def to_hf_rows(cfg: ModelConfig) -> int:
    """C, the convolved channels: 2 K dk + H dv."""
    return cfg.linear_num_key_heads * channels_per_key_head(cfg)


def hf_tensors(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...], Maps]]:
    """(HF name under `linear_attn.`, our parameter, HF shape, (to_ours, to_hf, window)) of one layer (Qwen3.5)."""
    d, h, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    rows = to_hf_rows(cfg)
    return [
        ("in_proj_qkv.weight", "qkv_proj", (rows, d), _qkv_maps(cfg)),
        ("in_proj_z.weight", "z_proj", (h * dv, d), in_projection(d, h, dv)),
        ("in_proj_b.weight", "b_proj", (h, d), transposed()),
        ("in_proj_a.weight", "a_proj", (h, d), transposed()),
        ("conv1d.weight", "conv", (rows, 1, cfg.linear_conv_kernel_dim), _conv_maps(cfg)),
        ("dt_bias", "time_step_bias", (h,), identity()),
        ("A_log", "log_rate", (h,), identity()),
        ("norm.weight", "norm_scale", (dv,), identity()),
        ("out_proj.weight", "out_proj", (d, h * dv), out_projection(h, dv, d)),
    ]
