"""The command line's refusals, checked in-process before anything is built: run directories, config files."""


import pytest

from rpegjax.graph.ir import Algorithm
from rpegjax.train.cli import claim_new_run_dir, main, parse_args
from rpegjax.train.config import RunConfig


def test_a_new_run_into_a_non_empty_run_directory_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "A"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main([f"--run-dir={run_dir}", "--steps=1"], Algorithm.GRPO) == 2
    assert f"run directory {run_dir} is not empty" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_default_run_names_are_unique_within_one_second(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = [claim_new_run_dir(Algorithm.GRPO) for _ in range(3)]
    assert len(set(names)) == 3


@pytest.mark.parametrize("text, message", [
    ('{"train": {"steps": 3', "not valid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('{"train": {"stpes": 3}}', "unknown field train.stpes; did you mean train.steps?"),
    ('{"graph": {"fuse": "no"}}', "graph.fuse: expected true or false, got str 'no'"),
    ('{"train": {"steps": "3"}}', "train.steps: expected an integer, got str '3'"),
])
def test_a_bad_config_json_on_resume_names_file_and_field(tmp_path, capsys, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["--resume", str(tmp_path)], Algorithm.GRPO)
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and message in err


def test_mesh_axis_names_are_checked_and_flags_suggest_corrections(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--mesh=dta=2"], Algorithm.GRPO)
    assert "unknown mesh axis 'dta'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--stpes=3"], Algorithm.GRPO)
    assert "did you mean --steps?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--dataset-format=gsm8k"], Algorithm.GRPO)
    assert "dataset_format is set but no dataset" in capsys.readouterr().err


def test_print_config_and_config_file_with_overrides(tmp_path, capsys):
    assert main(["--print-config", "--steps=7"], Algorithm.GRPO) == 0
    printed = capsys.readouterr().out
    assert RunConfig.from_json(printed).train.steps == 7
    path = tmp_path / "run.json"
    path.write_text(printed)
    config, _ = parse_args([f"--config={path}", "--seed=4"], Algorithm.GRPO)
    assert config.train.steps == 7 and config.train.seed == 4


def test_a_yaml_config_file_sets_what_it_names_and_keeps_the_other_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 7\n  eval_every: 5\ngrpo:\n  optimizer:\n    learning_rate: 3e-5\n"
                    "graph:\n  fuse: false\n")
    config, _ = parse_args([f"--config={path}", "--seed=4"], Algorithm.GRPO)
    defaults = RunConfig()
    assert (config.train.steps, config.train.eval_every, config.train.seed) == (7, 5, 4)
    assert config.grpo.optimizer.learning_rate == 3e-5 and config.graph.fuse is False
    # everything the file leaves out is the job's default, not the library's
    assert config.grpo.optimizer.b2 == defaults.grpo.optimizer.b2 == 0.99
    assert config.grpo.decoupled is defaults.grpo.decoupled is True
    assert config.replace(train=defaults.train, grpo=defaults.grpo, graph=defaults.graph) == defaults
    json_path = tmp_path / "run.json"  # the same partial file as JSON means the same
    json_path.write_text('{"train": {"steps": 7, "eval_every": 5}, "grpo": {"optimizer": {"learning_rate": 3e-5}},'
                         ' "graph": {"fuse": false}}')
    assert parse_args([f"--config={json_path}", "--seed=4"], Algorithm.GRPO)[0] == config


@pytest.mark.parametrize("text, message", [
    ("train:\n  stpes: 3\n", "unknown field train.stpes; did you mean train.steps?"),
    ("train:\n  steps: three\n", "train.steps: expected an integer, got str 'three'"),
    ("train:\n  steps: [3\n", "not valid YAML"),
    ("- 1\n- 2\n", "must be a JSON object, got list"),
    ("algorithm: ppo\n", "used ppo, not grpo"),
])
def test_a_bad_yaml_config_names_file_and_field(tmp_path, capsys, text, message):
    path = tmp_path / "run.yml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        parse_args([f"--config={path}"], Algorithm.GRPO)
    err = capsys.readouterr().err
    assert message in err and (str(path) in err or "used ppo" in message)


def test_verbose_is_a_flag_and_ppo_flags_are_only_in_train_ppo(capsys):
    from rpegjax.train.cli import parse_command

    assert parse_command(["--verbose"], Algorithm.GRPO).verbose
    assert not parse_command([], Algorithm.GRPO).verbose
    for algorithm, present, absent in ((Algorithm.GRPO, "--advantage", "--critic"), (Algorithm.PPO, "--critic", "--advantage")):
        with pytest.raises(SystemExit):
            parse_command(["--help"], algorithm)
        text = capsys.readouterr().out
        assert present in text and absent not in text and "--verbose" in text and "YAML" in text


def test_a_python_sandbox_without_bubblewrap_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    assert main([f"--run-dir={tmp_path / 'run'}", "--env=python-sandbox"], Algorithm.GRPO) == 2
    assert "error: SandboxConfig.isolation=bubblewrap needs the bubblewrap program ('bwrap'), which is not found: " \
           "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_wandb_without_the_package_is_one_clear_error_before_anything_is_built(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main([f"--run-dir={tmp_path / 'run'}", "--train.wandb=true"], Algorithm.GRPO) == 2
    assert "pip install 'rpegjax[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
