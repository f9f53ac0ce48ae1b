"""Non-finite guard, prompt-length checks at load, and the warm-start cache keeping a value head."""

import jax
import numpy as np
import pytest
from flax import nnx

from rpegjax.data.example import DatasetError, Example
from rpegjax.train.build import check_prompt_lengths
from rpegjax.train.health import NonFiniteGuard, TrainingError, nonfinite_leaves


def test_nonfinite_steps_are_counted_then_stop_the_run():
    guard = NonFiniteGuard(1)
    assert guard.observe(1, {"loss": 0.5, "reward": 1.0}) == []
    assert guard.observe(2, {"loss": float("nan"), "reward": 1.0}) == ["loss"]
    with pytest.raises(TrainingError, match="step 3: non-finite grad_norm, reward/nonfinite; 2 steps"):
        guard.observe(3, {"grad_norm": float("inf"), "reward/nonfinite": 1.0})
    assert nonfinite_leaves({"a": np.ones(2), "b": np.array([1.0, np.nan])}) == ["['b']"]


def test_prompt_lengths_checked_at_load_naming_the_row():
    examples = [Example(id=str(i), prompt="q" * (i + 1), answer="1", task="t", source=f"d.jsonl:{i + 1}")
                for i in range(3)]
    ids = [[0] * (i + 1) for i in range(3)]
    assert check_prompt_lengths(examples, ids, None) == 3  # sized from the data
    with pytest.raises(DatasetError, match=r"d.jsonl:3: the prompt has 3 tokens, more than rollout.max_prompt_len=2"):
        check_prompt_lengths(examples, ids, 2)


def test_a_cached_warm_start_keeps_the_value_head_of_a_shared_critic(tmp_path):
    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.train.warmstart import warm_start

    cfg = ModelConfig.tiny(vocab_size=16, eos_token_id=1).replace(value_head=True)
    examples = [Example(id=str(i), prompt="12", answer="3", task="t") for i in range(4)]
    kwargs = dict(encode_prompt=lambda e: [2, 3], encode_target=lambda e: [4, 1], steps=2, batch_size=2,
                  learning_rate=1e-3, pad_id=0, seed=0, cache_dir=str(tmp_path), cache_key={"k": 1})
    trained, first = warm_start(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, examples, **kwargs)
    cached, second = warm_start(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, examples, **kwargs)
    assert first["warm_start/cached"] == 0.0 and second["warm_start/cached"] == 1.0
    assert cached.cfg.value_head
    for a, b in zip(jax.tree.leaves(nnx.state(trained)), jax.tree.leaves(nnx.state(cached))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_separate_critic_starts_from_the_actors_placed_trunk_with_a_zero_value_head():
    """The critic shares the actor's (sharded) trunk arrays, without initialising a model on one device, and
    equals the earlier construction: a freshly initialised critic updated with the actor's state."""
    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.sharding import ShardingRules, make_mesh, shard_state
    from rpegjax.train.build import critic_from_actor

    cfg = ModelConfig.tiny()
    actor = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(actor)
    actor = nnx.merge(graphdef, shard_state(state, make_mesh({"fsdp": 4, "tensor": 2}), ShardingRules.fsdp_tp()))
    critic = critic_from_actor(actor, cfg)
    expected = Decoder(cfg.replace(value_head=True), rngs=nnx.Rngs(1))
    nnx.update(expected, nnx.state(actor))
    assert critic.cfg.value_head
    assert critic.layers[0].mlp.up_proj.get_value() is actor.layers[0].mlp.up_proj.get_value()
    ours, theirs = nnx.to_flat_state(nnx.state(critic)), nnx.to_flat_state(nnx.state(expected))
    assert [path for path, _ in ours] == [path for path, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
