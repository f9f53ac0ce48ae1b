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
