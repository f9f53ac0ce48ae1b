"""The job with a user's own reward module, a Parquet training set with its own field names, a Hugging Face
`save_to_disk` held-out set and a local checkpoint whose tokenizer has a chat template, to the final Hugging Face
directory that `transformers` loads."""

import json
import os
import pathlib
import subprocess
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from rpegjax.graph.ir import Algorithm
from rpegjax.train.cli import parse_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
# one term reads a further field of the row (a value no built-in reward gives), the other scores the completion
# (so that groups differ and the policy moves); the samples show that these functions, with their weights, are
# what the run optimised
REWARD_MODULE = """
def bonus(completion, example):
    assert isinstance(completion, str)
    return float(example["bonus"])

def digits(prompts, completions, answer, bonus, **kwargs):  # TRL's batched form, with columns
    assert len(prompts) == len(completions) == len(answer) and bonus == [0.3] * len(completions)
    return [sum(c.isdigit() for c in completion) / 10 for completion in completions]
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
def test_job_trains_on_a_custom_reward_with_parquet_and_saved_datasets(tmp_path):
    model_dir = tmp_path / "model"
    write_checkpoint(model_dir)
    pq.write_table(pa.Table.from_pylist(rows((a, b) for a in range(10) for b in range(5))), tmp_path / "train.parquet")
    datasets.Dataset.from_list(rows((a, b) for a in range(10) for b in range(5, 7))).save_to_disk(str(tmp_path / "test"))
    (tmp_path / "myrewards.py").write_text(REWARD_MODULE)
    run_dir = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "train_grpo.py"), f"--model={model_dir}",
               "--dataset=train.parquet", "--eval-dataset=test", "--prompt-field=q", "--answer-field=a",
               "--reward", "myrewards:bonus=2", "--reward=myrewards:digits", "--steps=2",
               f"--run-dir={run_dir}", "--prompts-per-step=4", "--group-size=2", "--max-new-tokens=3",
               "--data.eval_size=4", "--mesh=data=1", "--train.reward_workers=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    # run from tmp_path: the reward module and the datasets are found in the current directory
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward: myrewards:bonus=2 + myrewards:digits (weighted sum" in result.stderr
    assert "prompts: rendered with the model tokenizer's chat template" in result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(record["reward/errors"] == 0 for record in steps)
    # each function's mean (unweighted) and errors, as TRL logs them
    assert all(record["reward/myrewards:bonus"] == pytest.approx(0.3) for record in steps)
    assert all(record["reward/myrewards:bonus/errors"] == record["reward/myrewards:digits/errors"] == 0 for record in steps)
    assert all(0 <= record["reward/myrewards:digits"] <= 0.3 for record in steps)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    trained = [s for s in samples if s["source"] == "train"]
    assert trained and len({s["reward"] for s in trained}) > 1
    for sample in trained:
        assert abs(sample["reward"] - (0.6 + sum(c.isdigit() for c in sample["response"]) / 10)) < 1e-6
    saved = json.loads((run_dir / "config.json").read_text())["data"]
    assert saved["reward"] == ["myrewards:bonus=2", "myrewards:digits"]
    assert (saved["prompt_field"], saved["answer_field"], saved["chat_template"]) == ("q", "a", "auto")
    # the model at the end: the trained weights (not the checkpoint it started from), with the input's tokenizer
    # and chat template, and transformers' logits equal to the run's last checkpoint
    from hf_parity import assert_final_hf_logit_parity
    from safetensors.numpy import load_file

    start, final = load_file(model_dir / "model.safetensors"), load_file(run_dir / "hf" / "model.safetensors")
    assert start.keys() == final.keys()
    assert any(not np.array_equal(start[name], final[name]) for name in start)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(run_dir / "hf"))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["q"]}], add_generation_prompt=True,
                                           tokenize=False) for r in rows([(3, 4), (9, 1)])]
    assert texts == ["<3+4=>:", "<9+1=>:"]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert_final_hf_logit_parity(run_dir, prompts, step=2)
    # --resume (from any directory: the run's config.json holds absolute data paths) takes the reward and the
    # data mapping from it
    assert saved["dataset"] == str(tmp_path / "train.parquet") and saved["eval_dataset"] == str(tmp_path / "test")
    resumed = parse_command(["--resume", str(run_dir)], Algorithm.GRPO).config.data
    assert resumed.reward == ("myrewards:bonus=2", "myrewards:digits") and resumed.prompt_field == "q"

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
