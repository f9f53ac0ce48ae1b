"""Cost formulas of one decoder model: FLOPs, bytes moved and memory, per token, per pass and per decode step.

Conventions (all counts are for the whole model, before any parallel split):
* A matmul of [m, k] x [k, n] costs 2·m·k·n FLOPs; N_mm = matmul parameters per layer (q, k, v, o projections
  and the MLP), so the layer stack costs 2·L·N_mm FLOPs per token forward.
* Attention scores and the weighted sum cost 2·2·h·e FLOPs per (query, key) pair and layer; `AttentionKernel`
  says which pairs are computed: DENSE (rpegjax's XLA attention: every query against every key position,
  masked) or FLASH (causal blocks skipped: t(t+1)/2 pairs for a sequence of t).
* The output projection costs 2·d·v FLOPs per token that needs logits.
* Backward = 2 x forward; full rematerialisation adds one forward. So training is ≈ 6·N·tokens + attention.
* Decode is memory-bound: every step reads all weights once plus the KV cache of the attended keys.
"""

from __future__ import annotations

import dataclasses
import enum

from rpegjax.models.config import ModelConfig
from rpegjax.options import DType, RematPolicy, parse_choice
from rpegjax.perf.model.expert_costs import ExpertShape, expert_params


class AttentionKernel(enum.StrEnum):
    DENSE = "dense"  # every query scored against every key position (masked); scores materialised
    FLASH = "flash"  # causal blocks skipped, scores never stored (FlashAttention-style)


class DecodeKernel(enum.StrEnum):
    STATIC = "static"  # fixed slots x fixed capacity every step (rpegjax's jitted sampler): all slots, whole cache
    PAGED = "paged"  # serving-engine style: only active sequences, only their written keys
    # rpegjax's sampler with live buckets: the active sequences padded to a power of two, each over a window of
    # the longest active sequence rounded up to a power of two
    LIVE = "live"
    # rpegjax's sampler with live buckets and the Pallas paged-attention kernel (`DecodeAttention.PALLAS`): rows as
    # LIVE (the matmuls run the padded bucket), keys as PAGED (each active row reads its own, to the kernel's block)
    LIVE_PAGED = "live-paged"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The dimensions the cost formulas need (l, d, h, k, e, f, v) and how weights/activations are stored.

    `gated_mlp` is SwiGLU (three d x f matrices, Qwen/Llama); False is a GELU MLP with two (GPT-3/Megatron).
    `experts` makes it a mixture-of-experts model (`rpegjax.perf.model.expert_costs`): its sparse layers' MLPs are
    experts (f = `mlp` is the dense layers' width); FLOPs and activations follow the active parameters (k experts per
    token, `token_mlp`), memory all of them (`params`).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    param_dtype: DType = DType.BFLOAT16
    compute_dtype: DType = DType.BFLOAT16
    experts: ExpertShape | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "mlp", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        for name in ("param_dtype", "compute_dtype"):
            object.__setattr__(self, name, parse_choice(DType, getattr(self, name), f"ModelShape.{name}"))
        if self.experts is not None and (not self.gated_mlp or self.experts.sparse_layers > self.layers):
            raise ValueError(f"ModelShape.experts: SwiGLU experts in at most {self.layers} layers, got {self.experts}")

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        experts = None if not cfg.num_experts else ExpertShape(
            experts=cfg.num_experts, top_k=cfg.num_experts_per_token, mlp=cfg.moe_intermediate_size,
            sparse_layers=len(cfg.sparse_layers), capacity_factor=cfg.moe_capacity_factor)
        return cls(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, mlp=cfg.intermediate_size, vocab=cfg.vocab_size, gated_mlp=True,
                   tied_embeddings=cfg.tie_word_embeddings, param_dtype=cfg.param_dtype, compute_dtype=cfg.dtype,
                   experts=experts)

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def param_bytes_each(self) -> int:
        return self.param_dtype.itemsize

    @property
    def compute_bytes_each(self) -> int:
        return self.compute_dtype.itemsize

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v and o projections of one layer."""
        d, h, k, e = self.hidden, self.heads, self.kv_heads, self.head_dim
        return 2 * d * h * e + 2 * d * k * e

    @property
    def token_mlp(self) -> float:
        """MLP width one token computes, averaged over the layers: f, or for a MoE model its sparse layers' k·f_e
        mixed with the dense layers' f (the width of its MLP activations and FLOPs)."""
        e = self.experts
        if e is None:
            return self.mlp
        return (e.sparse_layers * e.top_k * e.mlp + (self.layers - e.sparse_layers) * self.mlp) / self.layers

    @property
    def matmul_params_per_layer(self) -> float:
        """Matmul parameters one token goes through per layer (the active ones, averaged over the layers of a MoE
        model, its router included): q, k, v, o projections and the MLP matrices."""
        router = 0.0 if self.experts is None else self.hidden * self.experts.experts * self.experts.sparse_layers / self.layers
        return self.attention_params_per_layer + (3 if self.gated_mlp else 2) * self.hidden * self.token_mlp + router

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        """All parameters (matmuls, embeddings, norms, every expert and router; biases are ignored, < 0.1% of any
        real model)."""
        e = self.experts
        mlps = self.layers * (3 if self.gated_mlp else 2) * self.hidden * self.mlp
        if e is not None:
            mlps += e.sparse_layers * (self.hidden * e.experts - 3 * self.hidden * self.mlp) + expert_params(self)
        return self.layers * (self.attention_params_per_layer + 2 * self.hidden) + mlps + self.hidden + self.embedding_params

    @property
    def active_params(self) -> float:
        """Parameters one token uses (all of them for a dense model)."""
        return self.layers * (self.matmul_params_per_layer + 2 * self.hidden) + self.hidden + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.params * self.param_bytes_each

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.compute_bytes_each


def attention_pairs(length, kernel: AttentionKernel | str):
    """(query, key) pairs computed for a sequence of `length` tokens in a full-sequence pass (int or array)."""
    if AttentionKernel(kernel) is AttentionKernel.DENSE:
        return length * length
    return length * (length + 1) // 2


def forward_flops(shape: ModelShape, *, tokens: float, pairs: float, logit_tokens: float) -> float:
    """One forward pass: 2·L·N_mm·tokens + 4·L·h·e·pairs + 2·d·v·logit_tokens."""
    return (2 * shape.layers * shape.matmul_params_per_layer * tokens
            + 4 * shape.layers * shape.heads * shape.head_dim * pairs
            + 2 * shape.hidden * shape.vocab * logit_tokens)


def training_flops(shape: ModelShape, *, tokens: float, pairs: float, remat: RematPolicy | str) -> float:
    """Forward + backward (2x forward) + one extra forward of the layer stack under full rematerialisation."""
    forward = forward_flops(shape, tokens=tokens, pairs=pairs, logit_tokens=tokens)
    layers_forward = forward_flops(shape, tokens=tokens, pairs=pairs, logit_tokens=0)
    return 3 * forward + (layers_forward if RematPolicy(remat) is RematPolicy.FULL else 0.0)


def model_flops(shape: ModelShape, *, tokens: float, pairs: float, backward: bool) -> float:
    """Useful work for MFU: forward (and backward) without rematerialisation."""
    forward = forward_flops(shape, tokens=tokens, pairs=pairs, logit_tokens=tokens)
    return 3 * forward if backward else forward


def decode_step_flops(shape: ModelShape, *, sequences: float, keys: float) -> float:
    """One decode step for `sequences` rows attending to `keys` cached keys in total (summed over rows)."""
    return forward_flops(shape, tokens=sequences, pairs=keys, logit_tokens=sequences)


def decode_step_bytes(shape: ModelShape, *, keys: float, sequences: float, tensor: int = 1) -> float:
    """HBM bytes one device reads and writes in one decode step with `tensor`-way tensor parallelism.

    Weights are split over tensor ranks; KV heads too, but never below one head per rank (they replicate).
    """
    kv_split = min(tensor, shape.kv_heads)
    weights = shape.weight_bytes / tensor
    cache = (keys + sequences) * shape.kv_bytes_per_token / kv_split  # read attended keys, write the new ones
    activations = sequences * shape.layers * (6 * shape.hidden + 3 * shape.token_mlp / tensor) * shape.compute_bytes_each
    return weights + cache + activations


def layer_activation_bytes_per_token(shape: ModelShape, *, keys_per_query: float, kernel: AttentionKernel | str,
                                     tensor: int = 1) -> float:
    """Bytes one layer keeps for the backward pass, per token, on one tensor rank.

    Counted tensors, as XLA's GPU compiler keeps them for the Llama 3.1 8B update without remat (its buffer assignment,
    `docs/benchmarks.md`, "Memory model against XLA's GPU compiler"): each RMSNorm's input and normalised output in
    float32 (the norms compute in float32: 4 d-wide float32 tensors per layer); in the compute dtype the normalised
    inputs of the attention and MLP projections, the attention output (for the output projection), q and the attention
    output blocked for the attention kernel's backward, k and v, and the MLP's gate, up and their product (one fewer for
    a GELU MLP); DENSE attention also keeps float32 scores and compute-dtype probabilities for every (query, key) pair,
    FLASH its float32 softmax statistics.
    """
    d, h, k, e, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.token_mlp
    b = shape.compute_bytes_each
    kv_split = min(tensor, k)
    elements = 2 * d + (3 * h * e) / tensor + (2 * k * e) / kv_split + (3 if shape.gated_mlp else 2) * f / tensor
    attention = (h / tensor) * keys_per_query * (4 + b) if AttentionKernel(kernel) is AttentionKernel.DENSE else 4 * h / tensor
    return elements * b + 4 * d * 4 + attention


def layer_matmul_output_bytes_per_token(shape: ModelShape, *, keys_per_query: float, kernel: AttentionKernel | str,
                                        tensor: int = 1) -> float:
    """Bytes of one layer's matmul outputs per token on one tensor rank that DOTS remat keeps for the backward
    pass: q, k, v, the attention output, gate and up (one for a GELU MLP). The output and down projections feed
    only residual additions, whose backward needs neither, so they are not kept (XLA's GPU compiler keeps three
    d-wide tensors per 7B layer: the input, q and the attention output).
    DENSE attention adds its float32 scores, FLASH the float32 softmax statistics the backward kernel needs."""
    h, k, e, f = shape.heads, shape.kv_heads, shape.head_dim, shape.token_mlp
    kv_split = min(tensor, k)
    elements = 2 * h * e / tensor + 2 * k * e / kv_split + (2 if shape.gated_mlp else 1) * f / tensor
    attention = (h / tensor) * keys_per_query * 4 if AttentionKernel(kernel) is AttentionKernel.DENSE else 4 * h / tensor
    return elements * shape.compute_bytes_each + attention


def training_activation_bytes(shape: ModelShape, *, tokens: float, keys_per_query: float, kernel: AttentionKernel | str,
                              remat: RematPolicy | str, tensor: int = 1) -> float:
    """Activation memory of one forward/backward over `tokens` tokens on one device.

    NONE keeps every layer's activations; DOTS each layer's input and matmul outputs; FULL each layer's input
    (d per token). DOTS and FULL add one layer's worth, live while a layer is recomputed and differentiated.
    """
    per_layer = layer_activation_bytes_per_token(shape, keys_per_query=keys_per_query, kernel=kernel, tensor=tensor)
    remat = RematPolicy(remat)
    if remat is RematPolicy.NONE:
        return tokens * shape.layers * per_layer
    kept = shape.hidden * shape.compute_bytes_each
    if remat is RematPolicy.DOTS:
        kept += layer_matmul_output_bytes_per_token(shape, keys_per_query=keys_per_query, kernel=kernel, tensor=tensor)
    return tokens * (shape.layers * kept + per_layer)


def forward_layer_bytes_per_token(shape: ModelShape, *, keys_per_query: float, kernel: AttentionKernel | str,
                                  tensor: int = 1) -> float:
    """Peak working set of one layer of a forward pass that keeps nothing for a backward pass (an inference
    stage), per token on one tensor rank, besides the residual stream: the larger of the MLP phase (the
    normalised input, gate and up; their product is written in place; one intermediate for a GELU MLP) and the
    attention phase (the normalised input, q, k, v and the output in the compute dtype, with a float32 output
    accumulator for FLASH kernels, float32 scores and compute-dtype probabilities per (query, key) for DENSE).
    Checked against XLA's GPU compiler (`docs/benchmarks.md`, "Memory model against XLA's GPU compiler")."""
    d, h, k, e, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.token_mlp
    b = shape.compute_bytes_each
    mlp = (d + (2 if shape.gated_mlp else 1) * f / tensor) * b
    attention = (d + 2 * h * e / tensor + 2 * k * e / min(tensor, k)) * b
    if AttentionKernel(kernel) is AttentionKernel.DENSE:
        attention += (h / tensor) * keys_per_query * (4 + b)
    else:
        attention += 4 * h * e / tensor
    return max(mlp, attention)


def logprob_chunk_bytes(shape: ModelShape, *, rows: float, chunk: int, tensor: int = 1, copies: int = 3) -> float:
    """Peak of chunked log-probs: `copies` float32 chunks of logits (XLA:CPU keeps the logits, their log-softmax
    and its gradient: 3; XLA's GPU compiler fuses them into one)."""
    return copies * rows * chunk * (shape.vocab / tensor) * 4


def optimizer_state_bytes(shape: ModelShape, *, bytes_per_param: float) -> float:
    """AdamW state: two moments (and a float32 master copy under mixed precision), `bytes_per_param` in all."""
    return shape.params * bytes_per_param


def optimizer_step_bytes(shape: ModelShape, *, state_bytes_per_param: float, grad_bytes_per_param: float) -> float:
    """Memory traffic of one AdamW step over all parameters: read and write weights and state, read gradients."""
    per_param = 2 * shape.param_bytes_each + 2 * state_bytes_per_param + grad_bytes_per_param
    return shape.params * per_param
