"""`--recipe dapo` (Yu et al. 2025, arXiv:2503.14476) and the GRPO section's DAPO options: preset values,
precedence of explicit flags, what config.json keeps for `--resume`, and the overlong penalty's numbers."""

import dataclasses
import json

import numpy as np
import pytest

from rpegjax.graph.ir import Algorithm
from rpegjax.learners.group_filter import SamplingCapAction
from rpegjax.learners.grpo import GRPOConfig
from rpegjax.train.cli import parse_args
from rpegjax.train.config import RECIPE_FIELDS, GRPOSection, Recipe, RolloutSection, RunConfig, recipe_overrides

DAPO = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean", "kl_coef": 0.0, "dynamic_sampling": True}


def _grpo(config: RunConfig) -> dict:
    return {name: getattr(config.grpo, name) for name in (*DAPO, "overlong_buffer", "overlong_penalty")}


def test_the_dapo_preset_has_the_papers_values():
    config = RunConfig().with_recipe("dapo")
    assert config.recipe == Recipe.DAPO
    # clip-higher 0.2 / 0.28, token-level loss, no KL, dynamic sampling; overlong buffer 20% of the budget (32)
    assert _grpo(config) == {**DAPO, "overlong_buffer": 6, "overlong_penalty": 1.0}
    # everything else is the job's default
    assert config.replace(recipe=Recipe.DEFAULT, grpo=RunConfig().grpo) == RunConfig()


def test_the_default_preset_restores_the_jobs_grpo_values():
    dapo = RunConfig().with_recipe("dapo")
    assert dapo.with_recipe("default") == RunConfig()
    # both presets set the same fields, the ones RECIPE_FIELDS names
    for recipe in Recipe:
        assert sorted(recipe_overrides(recipe, max_new_tokens=32)) == sorted(["recipe", *RECIPE_FIELDS])


def test_explicit_flags_override_the_preset_in_either_order():
    for argv in (["--recipe", "dapo", "--clip-high", "0.3", "--grpo.dynamic_sampling=false"],
                 ["--clip-high=0.3", "--grpo.dynamic_sampling", "false", "--recipe=dapo"]):
        config, _ = parse_args(argv, Algorithm.GRPO)
        assert config.recipe == Recipe.DAPO
        assert _grpo(config) == {**DAPO, "clip_high": 0.3, "dynamic_sampling": False, "overlong_buffer": 6,
                                 "overlong_penalty": 1.0}


def test_the_overlong_buffer_follows_the_response_budget_the_flags_set():
    config, _ = parse_args(["--recipe", "dapo", "--max-new-tokens", "40"], Algorithm.GRPO)
    assert config.grpo.overlong_buffer == 8
    config, _ = parse_args(["--recipe", "dapo", "--max-new-tokens", "40", "--overlong-buffer", "3"], Algorithm.GRPO)
    assert config.grpo.overlong_buffer == 3


def test_config_json_keeps_the_preset_and_resume_honours_it(tmp_path):
    config, _ = parse_args(["--recipe", "dapo", "--grpo.max_extra_rounds=2", "--grpo.on_sampling_cap=error"],
                           Algorithm.GRPO)
    (tmp_path / "config.json").write_text(config.to_json())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["recipe"] == "dapo" and saved["grpo"]["dynamic_sampling"] is True
    resumed, run_dir = parse_args(["--resume", str(tmp_path)], Algorithm.GRPO)
    assert run_dir == str(tmp_path)
    assert resumed.replace(train=config.train) == config
    assert resumed.grpo.on_sampling_cap == SamplingCapAction.ERROR and resumed.grpo.max_extra_rounds == 2
    # flags still override a resumed run's values
    changed, _ = parse_args(["--resume", str(tmp_path), "--overlong-buffer", "0"], Algorithm.GRPO)
    assert changed.grpo.overlong_buffer == 0 and changed.grpo.dynamic_sampling


def test_dapo_is_refused_for_ppo_and_bad_values_name_the_field(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--recipe", "dapo"], Algorithm.PPO)
    assert "recipe 'dapo' is a GRPO recipe; this run uses ppo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--recipe", "dapo2"], Algorithm.GRPO)
    assert "invalid choice: 'dapo2'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="GRPOSection.max_extra_rounds must be an integer >= 0"):
        GRPOSection(group_size=2, max_extra_rounds=-1)
    with pytest.raises(ValueError, match="GRPOSection.on_sampling_cap must be one of \\['train', 'error'\\]"):
        GRPOSection(group_size=2, on_sampling_cap="ignore")
    with pytest.raises(ValueError, match="GRPOSection.overlong_buffer must be an integer >= 0"):
        GRPOSection(group_size=2, overlong_buffer=-1)
    with pytest.raises(ValueError, match="GRPOSection.overlong_penalty must be >= 0"):
        GRPOSection(group_size=2, overlong_penalty=float("nan"))
    with pytest.raises(ValueError, match="needs a group baseline; advantage 'reinforce\\+\\+' has none"):
        GRPOSection(group_size=2, advantage="reinforce++", dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"grpo.overlong_buffer \(40\) must not exceed .* rollout.max_new_tokens \(32\)"):
        RunConfig().replace(grpo=dataclasses.replace(RunConfig().grpo, overlong_buffer=40))


def test_a_library_grpo_config_becomes_the_jobs_section_with_its_options_off():
    config = RunConfig(grpo=GRPOConfig(group_size=8, clip_high=0.28))
    assert isinstance(config.grpo, GRPOSection)
    assert config.grpo.clip_high == 0.28 and not config.grpo.dynamic_sampling and config.grpo.overlong_buffer == 0
    assert RunConfig.from_json(config.to_json()) == config


def _paper_overlong(length: int, max_length: int, cache: int) -> float:
    """DAPO eq. 13, written out from the paper."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return ((max_length - cache) - length) / cache
    return -1.0


def test_overlong_shaping_matches_the_papers_formula_times_the_factor():
    section = GRPOSection(group_size=2, overlong_buffer=5, overlong_penalty=0.7)
    shaping = section.overlong_shaping(20)
    lengths = np.arange(0, 23)
    expected = np.array([0.7 * _paper_overlong(int(n), 20, 5) for n in lengths], np.float32)
    got = shaping(lengths)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert got[15] == 0.0 and got[16] == pytest.approx(-0.14) and got[20] == pytest.approx(-0.7)
    assert GRPOSection(group_size=2).overlong_shaping(20) is None  # off by default


def test_rollout_budget_and_recipe_round_trip():
    config = RunConfig(rollout=RolloutSection(max_new_tokens=50)).with_recipe(Recipe.DAPO)
    assert config.grpo.overlong_buffer == 10
    assert RunConfig.from_json(config.to_json()) == config
