"""The job with a user's own reward module, a Parquet training set with its own field names, a Hugging Face
`save_to_disk` held-out set and a local checkpoint whose tokenizer has a chat template."""

import json
import os
import pathlib
import subprocess
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rpegjax.graph.ir import Algorithm
from rpegjax.train.cli import parse_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the reward reads a further field of the row: a value no built-in reward gives (0.6 is not k/8), so the
# metrics show that this function, with its weight, is what the run optimised
REWARD_MODULE = """
def bonus(completion, example):
    assert isinstance(completion, str)
    return float(example["bonus"])

def zero_if_answered(completion, example):
    return 0.0 if example["answer"] else 1.0
"""
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"


def write_checkpoint(model_dir):
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.models.hf import save_pretrained

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=<>:")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    cfg = ModelConfig.tiny(vocab_size=len(vocab), eos_token_id=1)
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))


def rows(pairs):
    return [{"q": f"{a}+{b}=", "a": str(a + b), "bonus": 0.3} for a, b in pairs]


@pytest.mark.slow  # about 1-2 minutes on 2 loaded cores
def test_job_trains_on_a_custom_reward_with_parquet_and_saved_datasets(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    write_checkpoint(model_dir)
    pq.write_table(pa.Table.from_pylist(rows((a, b) for a in range(10) for b in range(5))), tmp_path / "train.parquet")
    datasets.Dataset.from_list(rows((a, b) for a in range(10) for b in range(5, 7))).save_to_disk(str(tmp_path / "test"))
    (tmp_path / "myrewards.py").write_text(REWARD_MODULE)
    run_dir = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "train_grpo.py"), f"--model={model_dir}",
               "--dataset=train.parquet", "--eval-dataset=test", "--prompt-field=q", "--answer-field=a",
               "--reward", "myrewards:bonus=2", "--reward=myrewards:zero_if_answered", "--steps=2",
               f"--run-dir={run_dir}", "--prompts-per-step=4", "--group-size=2", "--max-new-tokens=3",
               "--data.eval_size=4", "--mesh=data=1", "--train.reward_workers=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    # run from tmp_path: the reward module and the datasets are found in the current directory
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward: myrewards:bonus=2 + myrewards:zero_if_answered (weighted sum" in result.stderr
    assert "prompts: rendered with the model tokenizer's chat template" in result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert abs(record["reward"] - 0.6) < 1e-6 and record["reward/errors"] == 0
    saved = json.loads((run_dir / "config.json").read_text())["data"]
    assert saved["reward"] == ["myrewards:bonus=2", "myrewards:zero_if_answered"]
    assert (saved["prompt_field"], saved["answer_field"], saved["chat_template"]) == ("q", "a", "auto")
    # --resume (from the same directory: the paths are relative) takes the reward and the data mapping from
    # the run's config.json
    monkeypatch.chdir(tmp_path)
    resumed = parse_command(["--resume", str(run_dir)], Algorithm.GRPO).config.data
    assert resumed.reward == ("myrewards:bonus=2", "myrewards:zero_if_answered") and resumed.prompt_field == "q"

    missing = subprocess.run([*command[:-9], "--reward=myrewards:nothing", f"--run-dir={tmp_path / 'bad'}"],
                             env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert missing.returncode == 2
    assert "error: reward myrewards:nothing: " in missing.stderr and "has no attribute 'nothing'" in missing.stderr


def test_reward_and_data_flags_map_onto_the_config(tmp_path):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows([(1, 2)])), data)
    config = parse_command([f"--dataset={data}", "--reward", "m:f=0.5", "--reward=pkg.m:g", "--prompt-field=q",
                            "--answer-field=a", "--chat-template=none", "--system-prompt=Be brief."],
                           Algorithm.GRPO).config.data
    assert config.reward == ("m:f=0.5", "pkg.m:g")
    assert (config.prompt_field, config.answer_field, config.chat_template, config.system_prompt) == \
        ("q", "a", "none", "Be brief.")
    assert parse_command(["--data.reward=m:f,n:g=2"], Algorithm.PPO).config.data.reward == ("m:f", "n:g=2")
    assert parse_command([], Algorithm.GRPO).config.data.reward == ()  # the built-in task's reward by default
    # a run's config.json brings its reward back on --resume
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(parse_command(["--reward=m:f=0.5"], Algorithm.GRPO).config.to_json())
    assert parse_command(["--resume", str(run_dir)], Algorithm.GRPO).config.data.reward == ("m:f=0.5",)


def test_bad_reward_and_data_flags_are_refused(capsys):
    for argv, message in [(["--reward=m:f=x"], "DataSection.reward: reward 'm:f=x': the weight 'x' is not a number"),
                          (["--reward=justamodule"], "expected package.module:function"),
                          (["--prompt-field=q"], "DataSection.prompt_field is set but no dataset is given"),
                          (["--chat-template=always"], "'always' is not one of ['auto', 'none', 'required']")]:
        try:
            parse_command(argv, Algorithm.GRPO)
        except SystemExit as exit:
            assert exit.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert message in capsys.readouterr().err
