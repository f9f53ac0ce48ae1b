"""Non-finite guard, prompt-length checks at load, and the warm-start cache keeping a value head."""

import re

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
    kwargs = dict(encode_prompt=lambda e: [2, 3], encode_target=lambda e: ([4, 1], [True, True]), steps=2, batch_size=2,
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


def test_a_pretrained_checkpoint_is_loaded_straight_into_the_training_layout(tmp_path):
    """`build` loads `--model.path` onto the training mesh (data=2 x fsdp=2 x tensor=2): the learner's parameters
    and a separate critic's trunk are the checkpoint's values, already split as the learner wants them."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from rpegjax.graph.ir import Algorithm
    from rpegjax.models import ModelConfig
    from rpegjax.models.hf import save_pretrained
    from rpegjax.models.hf_layout import abstract_split
    from rpegjax.train.build import build
    from rpegjax.train.cli import parse_args

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    cfg = ModelConfig.tiny(vocab_size=16, eos_token_id=1)
    graphdef, abstract = abstract_split(cfg)  # random values without running the initialisers (seconds saved)
    rng = np.random.default_rng(7)
    model = nnx.merge(graphdef, nnx.from_flat_state([
        (path, variable.replace(jax.numpy.asarray(rng.normal(size=variable.get_value().shape), np.float32)))
        for path, variable in nnx.to_flat_state(abstract)]))
    save_pretrained(model, cfg, tmp_path / "model")
    tokenizer.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(5)
                            for b in range(5)))
    config, _ = parse_args([f"--model={tmp_path / 'model'}", f"--dataset={data}", "--critic=separate",
                            "--mesh=data=2,fsdp=2,tensor=2", "--prompts-per-step=4", "--group-size=2",
                            "--data.eval_size=4", f"--run-dir={tmp_path / 'run'}"], Algorithm.PPO)
    components = build(config, log=lambda _: None)
    expected = dict(nnx.to_flat_state(nnx.state(model)))
    params = components.learner.params
    for name in ("actor", "critic"):
        gate = params[name]["layers"][0]["mlp"]["gate_proj"].get_value()
        assert gate.sharding.shard_shape(gate.shape) == (32, 64)  # d over fsdp, mlp over tensor
        for path, variable in nnx.to_flat_state(params[name]):
            if path in expected:
                np.testing.assert_array_equal(np.asarray(variable.get_value()), np.asarray(expected[path].get_value()),
                                              err_msg=f"{name} {path}")
    assert not np.any(np.asarray(params["critic"]["value_kernel"].get_value()))


@pytest.mark.parametrize("flags, message", [
    ([], "a conversational prompt (a list of messages) needs a tokenizer with a chat template"),
    (["--env=calculator"], "a conversational prompt (a list of messages) cannot open a multi-turn calculator episode"),
])
def test_conversational_prompts_the_run_cannot_render_are_refused_at_build(tmp_path, flags, message):
    """TRL's conversational rows need the model's chat template, and cannot open a tool episode: a clear error
    naming the row at start, never messages flattened silently."""
    import json

    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.build import build
    from rpegjax.train.cli import parse_args

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)})
                            + "\n" for a in range(30)))
    config, _ = parse_args([f"--dataset={data}", "--prompts-per-step=4", "--group-size=2", "--data.eval_size=2",
                            f"--run-dir={tmp_path / 'run'}", *flags], Algorithm.GRPO)
    with pytest.raises(ValueError) as error:
        build(config, log=lambda _: None)
    assert re.search(r"chat\.jsonl:\d+: ", str(error.value)) and message in str(error.value)  # the row (shuffled)
