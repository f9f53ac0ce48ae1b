"""Supervised warm start: a few steps of next-token training on a task's reference solutions, so that
RL starts from a policy that sometimes succeeds. The result is cached as a Hugging Face checkpoint
keyed by everything that determines it."""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from rpegjax.data.example import Example
from rpegjax.envs.calculator import worked_calculator_episode
from rpegjax.models.config import ModelConfig
from rpegjax.models.hf import load_pretrained, save_pretrained
from rpegjax.models.logprobs import token_logprobs
from rpegjax.models.transformer import Decoder


SupervisedTarget = tuple[list[int], list[bool]]
"""A warm-start target: its token ids and, for each, whether it is trained (a tool's output is context only)."""


def pack_supervised(
    prompts: Sequence[Sequence[int]], targets: Sequence[SupervisedTarget], *, length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [b, t], token mask [b, t], loss mask [b, t] (on the trained target tokens only, aligned with tokens)."""
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    loss_mask = np.zeros((len(prompts), length), np.float32)
    for row, (prompt, (target, trained)) in enumerate(zip(prompts, targets)):
        ids = list(prompt) + list(target)
        if len(ids) > length:
            raise ValueError(f"warm start: example {row} has {len(ids)} tokens, more than the sequence length {length}")
        if len(trained) != len(target):
            raise ValueError(f"warm start: example {row} has {len(target)} target tokens but {len(trained)} flags")
        tokens[row, : len(ids)] = ids
        mask[row, : len(ids)] = True
        loss_mask[row, len(prompt) : len(ids)] = np.asarray(trained, np.float32)
    return tokens, mask, loss_mask


def worked_targets(task: Any, environment: Any, encode: Callable[[str], list[int]],
                   eos_id: int) -> tuple[Callable[[Example], SupervisedTarget], str]:
    """What a warm start trains on, and a phrase saying so: the task's reference solution then EOS; with the
    calculator environment, the worked episode that calls it (`worked_calculator_episode`: the call and the answer
    line trained, the calculator's output context), so that a short RL run starts from a policy that uses the tool.
    Another environment has no worked tool calls: its warm start is the plain solution (said in the phrase)."""

    def plain(example: Example) -> SupervisedTarget:
        ids = encode(task.reference_solution(example)) + [eos_id]
        return ids, [True] * len(ids)

    if environment is None:
        return plain, "on the task's worked solutions"
    if environment.name != "calculator":
        return plain, f"on the task's worked solutions, without tool calls (the {environment.name} tool has no worked calls)"

    def episode(example: Example) -> SupervisedTarget:
        worked = worked_calculator_episode(environment, example, task.reference_solution(example))
        if worked is None:
            raise ValueError(f"warm start: the calculator has no worked call for task {example.task!r} "
                             "(arithmetic, countdown); set --warm-start-steps 0")
        ids, trained = [], []
        for text, is_model in worked:
            piece = encode(text)
            ids += piece
            trained += [is_model] * len(piece)
        return ids + [eos_id], trained + [True]

    return episode, "on worked episodes that call the calculator"


def supervised_train(
    model: Decoder,
    batches: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    steps: int,
    learning_rate: float,
) -> tuple[Decoder, list[float]]:
    """`steps` AdamW steps of mean token cross-entropy on the loss mask; returns the model and the losses."""
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(learning_rate)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask, loss_mask):
        def loss_fn(p):
            logprobs = token_logprobs(nnx.merge(graphdef, p), tokens, mask=mask)  # [:, i] scores tokens[:, i+1]
            return -(logprobs[:, :-1] * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for index in range(steps):
        params, opt_state, loss = step(params, opt_state, *batches(index))
        losses.append(loss)
    return nnx.merge(graphdef, params), [float(x) for x in jax.device_get(losses)]


def warm_start(
    model: Decoder,
    cfg: ModelConfig,
    examples: Sequence[Example],
    encode_prompt: Callable[[Example], list[int]],
    encode_target: Callable[[Example], SupervisedTarget],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    pad_id: int,
    seed: int,
    cache_dir: str | None,
    cache_key: dict,
    agree: Callable[[bool], bool] | None = None,
) -> tuple[Decoder, dict]:
    """The warm-started model (from the cache when the same warm start was done before) and a summary.

    The cache is written whole or not at all (`save_pretrained` renames a complete directory into place);
    of several writers of one entry (processes sharing a file system) one wins, all equal. With several
    processes, `agree(found)` must return whether every process found the cache (a collective), so that
    all of them load it or all train: no process decides alone from what its file system shows.
    """
    key = hashlib.sha256(json.dumps(cache_key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cache = None if cache_dir is None else pathlib.Path(cache_dir).expanduser() / key
    found = cache is not None and (cache / "config.json").exists()
    if agree is not None:
        found = agree(found)
    if found:
        # as saved: with the value head a shared critic needs (save_pretrained writes it), in the run's dtypes
        loaded, _ = load_pretrained(cache, param_dtype=cfg.param_dtype, dtype=cfg.dtype, value_head=cfg.value_head)
        return loaded, {"warm_start/cached": 1.0, "warm_start/steps": float(steps)}
    rng = random.Random(seed)
    encoded = [(encode_prompt(e), encode_target(e)) for e in examples]
    length = max(len(p) + len(t) for p, (t, _) in encoded)  # one shape for every batch: one compilation

    def batches(_: int):
        chosen = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        return pack_supervised([c[0] for c in chosen], [c[1] for c in chosen], length=length, pad_id=pad_id)

    model, losses = supervised_train(model, batches, steps=steps, learning_rate=learning_rate)
    if cache is not None:
        try:
            save_pretrained(model, cfg, cache)
        except OSError:  # another process renamed the same entry into place first: theirs is as good
            if not (cache / "config.json").exists():
                raise
    tail = losses[-10:] or [float("nan")]
    return model, {"warm_start/cached": 0.0, "warm_start/steps": float(steps), "warm_start/loss": float(np.mean(tail))}
