"""The start-up banner (`rpegjax.train.cli.describe_run`) and `--help`: what a newcomer reads before a run."""

import json

import pytest

from rpegjax.graph.ir import Algorithm
from rpegjax.train.build import build, build_graph
from rpegjax.train.cli import (
    ALGORITHM_ALIASES,
    ALGORITHM_ONLY,
    ALIASES,
    describe_algorithm,
    describe_model,
    describe_placement,
    describe_run,
    parse_args,
)

TINY = ["--model.hidden_size=32", "--model.num_layers=1", "--model.num_heads=2", "--model.num_kv_heads=1",
        "--model.head_dim=16", "--model.intermediate_size=64", "--data.train_size=16", "--data.eval_size=4",
        "--prompts-per-step=4", "--group-size=2", "--max-new-tokens=6", "--rollout.num_slots=8"]


def test_a_dataset_without_a_model_is_announced_as_random_weights_pointing_to_model(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a in range(6)
                            for b in range(6)))
    config, _ = parse_args([*TINY, f"--dataset={data}", f"--run-dir={tmp_path / 'run'}"],
                           Algorithm.GRPO)
    assert config.warm_start.steps == 0
    text = describe_run(build(config, log=lambda _: None))
    model_line = next(line for line in text.splitlines() if line.startswith("model:"))
    assert "RANDOM weights" in model_line and "no warm start" in model_line and "--model DIR" in model_line
    assert "algorithm: GRPO, recipe default" in text and "devices: colocated" in text


def test_the_built_in_task_is_announced_as_warm_started_and_a_checkpoint_by_its_path():
    config, _ = parse_args([], Algorithm.GRPO)
    assert "warm-started with 150 supervised steps" in describe_model(config)
    assert "RANDOM" not in describe_model(config)
    config, _ = parse_args(["--warm-start-steps=0"], Algorithm.GRPO)
    assert "random weights (warm start off" in describe_model(config)


@pytest.mark.parametrize("flags, expected", [
    ([], "GRPO, recipe default, advantage grpo; loss ppo, clip 0.2/0.2, token-mean, KL coefficient 0, lr 0.0001"),
    (["--recipe=dapo"], "GRPO, recipe dapo, advantage grpo, dynamic sampling, overlong penalty over 6 tokens; "
                        "loss ppo, clip 0.2/0.28"),
])
def test_the_banner_names_the_recipe_and_its_settings(flags, expected):
    config, _ = parse_args(["--max-new-tokens=32", *flags], Algorithm.GRPO)
    assert describe_algorithm(config).startswith(expected)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_the_banner_names_ppos_critic_mode(critic):
    config, _ = parse_args([f"--critic={critic}"], Algorithm.PPO)
    assert describe_algorithm(config).startswith(f"PPO, critic {critic} (")


def test_the_banner_names_the_meshes_and_the_device_split():
    config, _ = parse_args(["--mesh=data=2,tensor=4"], Algorithm.GRPO)
    assert describe_placement(build_graph(config, num_devices=8), None) == (
        "colocated: generation (mesh data=2,tensor=4) and training (mesh data=2,tensor=4) time-share "
        "cpu devices 0-7")
    config, _ = parse_args(["--rollout-devices=2", "--rollout-mesh=tensor=2", "--mesh=data=3,fsdp=2"], Algorithm.GRPO)
    text = describe_placement(build_graph(config, num_devices=8), None)
    assert text.startswith("split: generation on cpu devices 0-1 (mesh ") and "tensor=2" in text
    assert text.endswith("training on 2-7 (mesh data=3,fsdp=2)")


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_every_flag_says_what_it_means_with_a_real_metavar(algorithm, capsys):
    from rpegjax.train.cli import parse_command

    with pytest.raises(SystemExit):
        parse_command(["--help"], algorithm)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert " VALUE" not in text
    flags = {**ALIASES, **ALGORITHM_ONLY[algorithm],
             **{flag: (f"{algorithm.value}.{field}",) for flag, field in ALGORITHM_ALIASES.items()}}
    for flag, fields in flags.items():
        start = text.index(f" --{flag} ") + len(f" --{flag} ")
        metavar, _, rest = text[start:].partition(" ")
        assert metavar.split(".")[0].isupper() and metavar != "VALUE", (flag, metavar)
        # a sentence before the field it sets, not only the field's name
        meaning = rest[: rest.index(f"({', '.join(fields)};")]
        assert len(meaning.split()) >= 3, (flag, meaning)
