"""Train/rollout log-prob mismatch of a random Qwen3-MoE with and without router replay, float32 and bfloat16.

    python benchmarks/bench_moe_replay.py [--prompts 8] [--prompt-len 16] [--new 32] [--seeds 3]

The rollout is the sampler's computation: a KV-cache prefill of the prompts, then one cached decode step per
token, sampling at temperature 1 and recording each token's log-prob and the experts every sparse layer chose for
it (`Decoder.routed_hidden_states` with a cache, as the sampler calls it). The trainer's pass is the learner's
full-sequence forward over prompt + response, once routing freely and once replaying the recorded experts.
Printed per dtype: the `mismatch/*` metrics of `rpegjax.learners.corrections.mismatch_metrics` (the job logs
them every step) and the fraction of (token, sparse layer) routing decisions where the trainer's router picks
another expert set than the rollout did.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rpegjax.learners.corrections import mismatch_metrics
from rpegjax.models import Architecture, Decoder, KVCache, ModelConfig


def rollout(model: Decoder, prompts: jax.Array, new_tokens: int, key: jax.Array):
    """Tokens [b, s+n], behaviour log-probs [b, s+n] (0 on the prompt) and recorded expert ids [b, s+n, l, k]
    (-1 for the last token, which no step feeds)."""
    b, s = prompts.shape
    cache = KVCache.zeros(model.cfg, b, s + new_tokens)
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))

    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, prompts, cache):
        model = nnx.merge(graphdef, state)
        hidden, cache, routing = model.routed_hidden_states(prompts, positions, cache=cache)
        return model.logits(hidden[:, -1:])[:, 0], cache, routing.expert_ids

    @jax.jit
    def step(state, token, cache):
        model = nnx.merge(graphdef, state)
        hidden, cache, routing = model.routed_hidden_states(token[:, None], cache.lengths[:, None], cache=cache)
        return model.logits(hidden)[:, 0], cache, routing.expert_ids[:, 0]

    logits, cache, experts = prefill(state, prompts, cache)
    tokens, logprobs, recorded = [prompts], [jnp.zeros((b, s))], [experts]
    for i in range(new_tokens):
        log_softmax = jax.nn.log_softmax(logits.astype(jnp.float32))
        token = jax.random.categorical(jax.random.fold_in(key, i), log_softmax)
        tokens.append(token[:, None])
        logprobs.append(jnp.take_along_axis(log_softmax, token[:, None], axis=1))
        if i < new_tokens - 1:
            logits, cache, experts = step(state, token, cache)
            recorded.append(experts[:, None])
    recorded.append(jnp.full_like(recorded[-1][:, :1], -1))
    return jnp.concatenate(tokens, 1), jnp.concatenate(logprobs, 1), jnp.concatenate(recorded, 1)


def train_pass(model: Decoder, tokens: jax.Array, expert_ids: jax.Array | None):
    """Log-probs [b, t] of every token after the first from one full-sequence forward, and the experts it used."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _, routing = model.routed_hidden_states(tokens, positions, expert_ids=expert_ids)
    log_softmax = jax.nn.log_softmax(model.logits(hidden[:, :-1]).astype(jnp.float32))
    picked = jnp.take_along_axis(log_softmax, tokens[:, 1:, None], axis=2)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0))), routing.expert_ids


def measure(dtype: str, args) -> dict[str, float]:
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, vocab_size=512, hidden_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32, num_experts=16, num_experts_per_token=4,
                           moe_intermediate_size=64, param_dtype=dtype, dtype=dtype)
    totals: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        model = Decoder(cfg, rngs=nnx.Rngs(seed))
        prompts = jax.random.randint(jax.random.key(100 + seed), (args.prompts, args.prompt_len), 0, cfg.vocab_size)
        tokens, behaviour, recorded = rollout(model, prompts, args.new, jax.random.key(seed))
        mask = jnp.arange(tokens.shape[1])[None, :] >= args.prompt_len
        mask = jnp.broadcast_to(mask, tokens.shape)
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda state, tokens, replay: train_pass(nnx.merge(graphdef, state), tokens, replay))
        for name, replay in (("free", None), ("replay", recorded)):
            train, used = forward(state, tokens, replay)
            metrics = mismatch_metrics(train, behaviour, mask)
            fed = recorded[:, :-1] >= 0  # every token but the last was routed in the rollout
            differ = jnp.any(jnp.sort(used[:, :-1], -1) != jnp.sort(recorded[:, :-1], -1), axis=-1) & fed[..., 0]
            metrics["routing_differs"] = jnp.mean(differ.astype(jnp.float32))
            for key, value in metrics.items():
                totals.setdefault(f"{name} {key.removeprefix('mismatch/')}", []).append(float(value))
    return {key: float(np.mean(values)) for key, values in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"random Qwen3-MoE (d=128, 4 sparse layers, 16 experts, top-4), {args.prompts} prompts x {args.prompt_len} "
          f"tokens + {args.new} sampled, mean over {args.seeds} seeds")
    for dtype in ("float32", "bfloat16"):
        result = measure(dtype, args)
        print(f"{dtype}:")
        for key in sorted(result):
            print(f"  {key:34s} {result[key]:.3e}")


if __name__ == "__main__":
    main()
