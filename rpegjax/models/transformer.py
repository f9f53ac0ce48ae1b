"""Decoder-only language model (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama 3) in Flax NNX: an embedding, a stack of
layers of the kinds the config lists (`rpegjax.models.layer_stack`), a final norm and an output head.

Two call paths share every layer:
* full sequence (`Decoder.__call__` without a cache): training and log-probs;
* incremental over a generation state (`KVCache`, or the sampler's paged cache): prefill and decode steps, each
  layer reading and writing the state its kind keeps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rpegjax.models.attention import causal_attention, segment_starts  # noqa: F401  (causal_attention re-exported)
from rpegjax.models.config import ModelConfig
from rpegjax.models.context_attention import from_balanced, to_balanced
from rpegjax.models.kv_cache import KVCache
from rpegjax.models.layer_stack import GATHERED, RESIDUAL, Block, layer_ropes
from rpegjax.models.lora import MLP_TARGETS, LoRAConfig, LoRAParam, split_adapters
from rpegjax.models.moe import Routing
from rpegjax.models.norm import RMSNorm
from rpegjax.models.projections import param
from rpegjax.models.rope import inverse_frequencies, rope_tables
from rpegjax.models.stack_scan import remat_layer, scan_layers
from rpegjax.options import MODEL_EXECUTION_FIELDS
from rpegjax.sharding import axes
from rpegjax.sharding.rules import ActivationSharding, constrain

__all__ = ["Decoder", "KVCache", "default_positions", "packed_positions"]


class Decoder(nnx.Module):
    """The language model; with `cfg.value_head` it also carries a scalar value head on the final hidden state,
    with `lora` low-rank adapters on the projections (`rpegjax.models.lora`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        pdt = cfg.jnp_param_dtype
        self.cfg = cfg
        self.lora = lora
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * 0.02).astype(pdt),
            logical_axes=(axes.VOCAB, axes.EMBED),
        )
        if lora is not None and cfg.num_experts and set(lora.targets) & set(MLP_TARGETS):
            raise ValueError(f"LoRA targets {[t.value for t in lora.targets if t in MLP_TARGETS]} are MLP projections; "
                             "a mixture-of-experts model takes adapters on attention only (targets q, k, v, o)")
        self.layers = nnx.List([Block(cfg, i, rngs=rngs, lora=lora) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), (axes.EMBED, axes.VOCAB), pdt, cfg.hidden_size)
        if cfg.value_head:
            self.value_kernel = nnx.Param(jnp.zeros((cfg.hidden_size,), pdt), logical_axes=(axes.EMBED,))
            self.value_bias = nnx.Param(jnp.zeros((), pdt), logical_axes=())

    def hidden_states(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        *,
        mask: Bool[Array, "b t"] | None = None,
        cache: KVCache | None = None,
        sharding: ActivationSharding | None = None,
        dropout_key: Array | None = None,
        segment_ids: Int[Array, "b t"] | None = None,
    ) -> tuple[Float[Array, "b t d"], KVCache | None]:
        """Final-norm hidden states.

        Without a cache, `mask` marks real (non-padding) tokens: keys at padding are never attended to.
        With a cache, the t tokens are written at each row's `cache.lengths` and the returned cache
        has `lengths + mask.sum(-1)` (all t when `mask` is None).

        `dropout_key`: the training forward's key for LoRA dropout (`rpegjax.models.lora`); layer l draws its
        masks from fold_in(dropout_key, l), scanned or not. Ignored by a model without adapter dropout.

        `segment_ids`: packed rows (full sequence only): a token attends only to earlier tokens of its own segment
        (`rpegjax.models.attention`); the caller gives positions restarting per segment (`packed_positions`).

        With `sharding` that splits `axes.SEQ` (a context axis), the layers run on the rows permuted into the
        load-balanced order (`rpegjax.models.context_attention`); the hidden states come back in row order, split
        on the sequence.
        """
        hidden, new_cache, _ = self.routed_hidden_states(tokens, positions, mask=mask, cache=cache, sharding=sharding,
                                                         dropout_key=dropout_key, segment_ids=segment_ids)
        return hidden, new_cache

    def routed_hidden_states(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        *,
        mask: Bool[Array, "b t"] | None = None,
        cache: KVCache | None = None,
        sharding: ActivationSharding | None = None,
        dropout_key: Array | None = None,
        expert_ids: Int[Array, "b t s k"] | None = None,
        segment_ids: Int[Array, "b t"] | None = None,
    ) -> tuple[Float[Array, "b t d"], KVCache | None, Routing | None]:
        """`hidden_states` and the routing of the s sparse layers (in layer order) stacked on axis 2: `Routing`
        with expert_ids [b t s k] and router_logits [b t s x]; None for a dense model. Given `expert_ids`
        [b t s k] (a recorded routing), every token uses those experts instead of its router's top k (replay)."""
        if dropout_key is not None and cache is not None:
            raise ValueError("Decoder.hidden_states: LoRA dropout (dropout_key) is for the training forward, "
                             "not a cached (generation) forward")
        if segment_ids is not None and cache is not None:
            raise ValueError("Decoder.hidden_states: packed rows (segment_ids) are for the full-sequence forward, "
                             "not a cached (generation) forward")
        if self.lora is None or self.lora.dropout == 0:
            dropout_key = None
        sparse = self.cfg.sparse_layers
        if expert_ids is not None and expert_ids.shape[2:] != (len(sparse), self.cfg.num_experts_per_token):
            raise ValueError(f"Decoder.routed_hidden_states: expert_ids {expert_ids.shape} needs [b, t, "
                             f"{len(sparse)} sparse layers, {self.cfg.num_experts_per_token} experts per token]")
        context = 1 if sharding is None or cache is not None else sharding.shards(axes.SEQ)
        if context > 1:  # context parallelism: the layers run on the rows in the load-balanced order
            if dropout_key is not None:
                raise ValueError("Decoder.hidden_states: LoRA dropout draws its masks in row order, which context "
                                 "parallelism does not keep; train with lora dropout 0 or without a context axis")
            if sparse:
                raise ValueError("Decoder.hidden_states: a mixture-of-experts model does not run with a context axis yet "
                                 "(its routing would come back in the load-balanced order)")
            tokens, positions = to_balanced(tokens, context), to_balanced(positions, context)
            mask = None if mask is None else to_balanced(mask, context)
            segment_ids = None if segment_ids is None else to_balanced(segment_ids, context)
        x = self.embed.get_value()[tokens].astype(self.cfg.jnp_dtype)
        x = constrain(x, sharding, RESIDUAL)
        ropes = self.rope_tables(positions)
        if cache is None and self.cfg.scan_layers:
            hidden, routing = scan_layers(self.layers, x, ropes, mask, self.cfg.remat, sharding, dropout_key,
                                          expert_ids, segment_ids, compute_dtype=self.cfg.jnp_dtype, sparse=sparse)
            return _row_order(self.final_norm(hidden), context, sharding), None, routing
        full_sequence = remat_layer(self.cfg.remat, sharding) if cache is None else None
        written, routings = [], []
        for index, layer in enumerate(self.layers):
            ids = None if expert_ids is None or index not in sparse else expert_ids[:, :, sparse.index(index)]
            if full_sequence is not None:
                layer_key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
                x, routing = full_sequence(layer, x, ropes[index], mask, layer_key, ids, segment_ids)
            else:
                x, new_layer, routing = layer(x, ropes[index], mask, cache.layer(index), cache.lengths, sharding, None,
                                              ids)
                written.append(new_layer)
            routings.append(routing)
        new_cache = None
        if cache is not None:
            added = tokens.shape[1] if mask is None else mask.sum(axis=-1).astype(jnp.int32)
            new_cache = cache.with_layers(written, added)
        routed = [routing for routing in routings if routing is not None]
        stacked = jax.tree.map(lambda *r: jnp.stack(r, axis=2), *routed) if routed else None
        return _row_order(self.final_norm(x), context, sharding), new_cache, stacked

    def rope_tables(self, positions: Int[Array, "b t"]) -> list:
        """Each layer's RoPE tables (None for a kind without RoPE), computed once per distinct setting: layers that
        share a setting share one pair of tables. Computed at trace time from the config: constants, not
        parameters."""
        settings = layer_ropes(self.cfg)
        tables = {rope: rope_tables(positions, inverse_frequencies(rope)) for rope in dict.fromkeys(settings) if rope}
        return [None if rope is None else tables[rope] for rope in settings]

    def with_execution(self, **changes: Any) -> Decoder:
        """This model's parameters under a config whose execution fields (`MODEL_EXECUTION_FIELDS`: attention kernel,
        remat, layer scan) or MoE capacity factor are changed (none changes the parameters); e.g. for a checkpoint
        loaded with the defaults."""
        allowed = (*MODEL_EXECUTION_FIELDS, "moe_capacity_factor")
        unknown = sorted(set(changes) - set(allowed))
        if unknown:
            raise ValueError(f"Decoder.with_execution changes only {list(allowed)}, got {unknown}")
        cfg = self.cfg.replace(**changes)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), lora=self.lora)))
        return nnx.merge(graphdef, nnx.state(self))

    def with_lora(self, lora: LoRAConfig, *, seed: int) -> Decoder:
        """This model's (base) parameters, shared not copied, plus fresh adapters of `lora` drawn from `seed`
        (B = 0: the same function as before)."""
        if self.lora is not None:
            raise ValueError(f"Decoder.with_lora: this model already carries adapters ({self.lora})")
        cfg = self.cfg
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), lora=lora)))
        # only the adapters leave the jitted build: XLA drops the unused initialisation of the base weights
        adapters = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed), lora=lora), LoRAParam))()
        return nnx.merge(graphdef, nnx.state(self), adapters)

    def without_lora(self) -> Decoder:
        """The base model: these parameters with the adapters dropped (shares the base weights' buffers)."""
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(self.cfg, rngs=nnx.Rngs(0))))
        return nnx.merge(graphdef, split_adapters(nnx.state(self))[1])

    def output_kernel(self) -> Float[Array, "d v"]:
        if self.cfg.tie_word_embeddings:
            return self.embed.get_value().T
        return self.lm_head.get_value()

    def logits(self, hidden: Float[Array, "b t d"]) -> Float[Array, "b t v"]:
        """Float32 logits; for long sequences prefer `rpegjax.models.logprobs.token_logprobs`."""
        dt = self.cfg.jnp_dtype
        return (hidden.astype(dt) @ self.output_kernel().astype(dt)).astype(jnp.float32)

    def values(self, hidden: Float[Array, "b t d"]) -> Float[Array, "b t"]:
        """Scalar value per position from the value head."""
        if not self.cfg.value_head:
            raise ValueError("this model has no value head; build it with ModelConfig(value_head=True)")
        kernel = self.value_kernel.get_value().astype(jnp.float32)
        return hidden.astype(jnp.float32) @ kernel + self.value_bias.get_value().astype(jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        *,
        mask: Bool[Array, "b t"] | None = None,
        sharding: ActivationSharding | None = None,
    ) -> Float[Array, "b t v"]:
        """Full-sequence logits. Positions default to the count of real tokens before each one (left padding safe)."""
        if positions is None:
            positions = default_positions(tokens, mask)
        hidden, _ = self.hidden_states(tokens, positions, mask=mask, sharding=sharding)
        return self.logits(hidden)


def _row_order(hidden: Float[Array, "b t d"], context: int, sharding: ActivationSharding | None) -> Float[Array, "b t d"]:
    """The final hidden states back in row order after context parallelism (`context` > 1), still split on the
    sequence; unchanged otherwise."""
    if context == 1:
        return hidden
    return constrain(from_balanced(hidden, context), sharding, GATHERED)


def default_positions(tokens: Int[Array, "b t"], mask: Bool[Array, "b t"] | None) -> Int[Array, "b t"]:
    """RoPE positions: 0, 1, ... over real tokens (padding gets the position of the next real token)."""
    if mask is None:
        return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def packed_positions(segment_ids: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """RoPE positions of packed rows: 0, 1, ... restarting at each segment (as each sequence alone would have them)."""
    return jnp.arange(segment_ids.shape[1])[None, :] - segment_starts(segment_ids)
