"""How many bytes a forward pass of one row needs on one device, estimated before anything compiles.

Inference stages (reference / old log-probs, values) choose their row micro-batch from this estimate and a
per-device memory budget (`rpegjax.learners.inference`). A forward pass keeps no activation across layers
(nothing is saved for a backward), so its peak is the widest point of one layer plus the residual stream
and the log-prob chunk, per row of t tokens, all in float32 bytes:

    residual stream      4 * t * d * 4           (layer input, output, normed copy, float32 norm)
    attention in/out     t * (2h + 2k) * e * 4   (q, k, v, attention output)
    attention scores     dense: 2 * h * t * t * 4;  blockwise: 3 * h * block^2 * 4;
                         cuDNN: 2 * h * t * 4 (its log-sum-exp statistics)
    MLP                  4 * t * f * 4           (gate, up, the activation, their product)
    log-prob chunk       3 * chunk * v * 4       (float32 logits, log-softmax, and its exp)

Beside the rows, a pass holds weights it did not receive as they are (`forward_fixed_bytes`): a layer's
parameters gathered from their FSDP shards (two layers: the next is gathered while one computes) and the
output layer, each in the parameter dtype plus a copy in the compute dtype when that differs (split over
`tensor` shards; the embedding is a lookup, never gathered whole).

Why float32 and whole widths even for bf16 compute under tensor parallelism: measured ahead of time on 8
virtual CPU devices (benchmarks/bench_memory.py), XLA's CPU backend computes bf16 matmuls through float32
copies and kept one row's temporaries near the unsplit figure at fsdp=4 x tensor=2 (Qwen2.5-32B, 32k tokens:
21.2 GiB measured). With these terms the estimate is an upper bound of every measured case (7B at 16k:
12.2 GiB for 8.3 measured with one row, 31.7 for 16.6 with four, fsdp=8; 9.3 for 5.9, fsdp=4 x tensor=2; 32B at
32k: 27.8 for 26.5, fsdp=8; 22.9 for 21.2, fsdp=4 x tensor=2), at most 1.9x above it; on a GPU computing in
bf16 it is looser. A test checks
the bound on small models against `memory_analysis()`.
"""

from __future__ import annotations

import numpy as np

from rpegjax.models.config import ModelConfig
from rpegjax.options import AttentionKind

_FLOAT32 = 4


def forward_bytes_per_row(cfg: ModelConfig, length: int, *, logprob_chunk: int) -> int:
    """Estimated peak activation bytes, on one device, of a forward pass (with log-probs) over one row of
    `length` tokens (see the module docstring)."""
    if length < 1 or logprob_chunk < 1:
        raise ValueError(f"forward_bytes_per_row: length {length} and logprob_chunk {logprob_chunk} must be positive")
    _refuse_experts(cfg, "forward_bytes_per_row")
    t, d, f, v = length, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    residual = 4 * t * d * _FLOAT32
    attention_io = t * (2 * h + 2 * k) * e * _FLOAT32
    if cfg.attention == AttentionKind.DENSE:
        scores = 2 * h * t * t * _FLOAT32
    elif cfg.attention == AttentionKind.BLOCKWISE:
        block = min(cfg.attention_block_size, t)
        scores = 3 * h * block * block * _FLOAT32
    else:
        scores = 2 * h * t * _FLOAT32
    mlp = 4 * t * f * _FLOAT32
    logits = 3 * min(logprob_chunk, t) * v * _FLOAT32
    return int(residual + attention_io + scores + mlp + logits)


def forward_fixed_bytes(cfg: ModelConfig, *, tensor: int = 1) -> int:
    """Estimated bytes, on one device, of the weights a forward pass materialises whatever its rows: two
    gathered layers and the output layer, in the parameter dtype and a compute-dtype copy (module docstring)."""
    _refuse_experts(cfg, "forward_fixed_bytes")
    d, f, h, k, e, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    layer = d * h * e + 2 * d * k * e + h * e * d + 3 * d * f
    stored, compute = np.dtype(cfg.jnp_param_dtype).itemsize, np.dtype(cfg.jnp_dtype).itemsize
    per_weight = stored + (compute if compute != stored else 0)
    return int((2 * layer + d * v) * per_weight / tensor)


def _refuse_experts(cfg: ModelConfig, where: str) -> None:
    """The terms above describe dense layers; a mixture-of-experts layer's (sorted token copies, grouped matmuls,
    which XLA's CPU backend lowers densely over every expert) are not measured yet."""
    if cfg.num_experts:
        raise ValueError(f"{where}: no memory estimate for mixture-of-experts layers yet ({cfg.architecture.value}, "
                         f"{cfg.num_experts} experts); bound inference micro-batches with inference_rows instead of "
                         "inference_memory_gib")
