"""How many bytes of activations a forward pass of one row needs on one device, before anything compiles.

Inference stages (reference / old log-probs, values) choose their row micro-batch from this estimate and a
per-device memory budget (`rpegjax.learners.inference`). A forward pass keeps no activation across layers
(nothing is saved for a backward), so its peak is the widest point of one layer plus the residual stream
and the log-prob chunk, per row of t tokens (c: compute-dtype bytes, widths split over `tensor` shards):

    residual stream      4 * t * d * 4                 (layer input, output, normed copy, float32 norm)
    attention in/out     t * (2h + 2k) * e * c / tensor (q, k, v, attention output)
    attention scores     dense: 2 * h * t * t * 4 / tensor;  blockwise: 3 * h * block^2 * 4 / tensor;
                         cuDNN: 2 * h * t * 4 / tensor (its log-sum-exp statistics)
    MLP                  3 * t * f * c / tensor         (gate, up, their product)
    log-prob chunk       3 * chunk * v * 4 / tensor     (float32 logits, log-softmax, and its exp)

Beside the rows, a pass holds weights it did not receive as they are: a layer's parameters gathered from
their FSDP shards (two layers: the next is gathered while one computes) and the output layer, each in the
parameter dtype plus a copy in the compute dtype when that differs (`forward_fixed_bytes`; the embedding is
a lookup, never gathered whole). On 8 virtual devices, Qwen2.5-7B at fsdp=8, 16k tokens, bf16 compute, XLA
needs 5.6 GiB + 2.8 GiB per row per device; these formulas give 5.6 GiB + 3.4 GiB.

The sum of the terms (not the max) makes it an upper bound of what XLA schedules, which a test checks
against `memory_analysis()` of compiled programs.
"""

from __future__ import annotations

import numpy as np

from rpegjax.models.config import AttentionKind, ModelConfig

_FLOAT32 = 4


def forward_bytes_per_row(cfg: ModelConfig, length: int, *, logprob_chunk: int, tensor: int = 1) -> int:
    """Estimated peak activation bytes, on one device, of a forward pass (with log-probs) over one row of
    `length` tokens, the model's widths split over `tensor` shards (see the module docstring)."""
    if length < 1 or logprob_chunk < 1 or tensor < 1:
        raise ValueError(f"forward_bytes_per_row: length {length}, logprob_chunk {logprob_chunk} and tensor {tensor} "
                         "must be positive")
    t, d, f, v = length, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    c = np.dtype(cfg.jnp_dtype).itemsize
    residual = 4 * t * d * _FLOAT32
    attention_io = t * (2 * h + 2 * k) * e * c / tensor
    if cfg.attention == AttentionKind.DENSE:
        scores = 2 * h * t * t * _FLOAT32 / tensor
    elif cfg.attention == AttentionKind.BLOCKWISE:
        block = min(cfg.attention_block_size, t)
        scores = 3 * h * block * block * _FLOAT32 / tensor
    else:
        scores = 2 * h * t * _FLOAT32 / tensor
    mlp = 3 * t * f * c / tensor
    logits = 3 * min(logprob_chunk, t) * v * _FLOAT32 / tensor
    return int(residual + attention_io + scores + mlp + logits)


def forward_fixed_bytes(cfg: ModelConfig, *, tensor: int = 1) -> int:
    """Estimated bytes, on one device, of the weights a forward pass materialises whatever its rows: two
    gathered layers and the output layer, in the parameter dtype and a compute-dtype copy (module docstring)."""
    d, f, h, k, e, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    layer = d * h * e + 2 * d * k * e + h * e * d + 3 * d * f
    stored, compute = np.dtype(cfg.jnp_param_dtype).itemsize, np.dtype(cfg.jnp_dtype).itemsize
    per_weight = stored + (compute if compute != stored else 0)
    return int((2 * layer + d * v) * per_weight / tensor)
