"""Bring your own reward: specs, loading with clear errors, the weighted sum, and running it in worker processes."""

import sys
import textwrap
import uuid

import numpy as np
import pytest

from rpegjax.data.example import Example
from rpegjax.rewards.custom import (RewardedTask, RewardSpec, RewardSpecError, RewardTerm, WeightedReward,
                                    load_reward_function,
                                    load_rewards)
from rpegjax.rewards.runner import Isolation, RewardRunner, RewardRunnerConfig
from rpegjax.rewards.tasks import make_task

EXAMPLE = Example(id="e", prompt="2+2?", answer="4", task="math", meta={"bonus": "0.25"})

USER_MODULE = """
import math

def exact(completion, example):
    return float(completion.strip() == example["answer"])

def bonus(completion, example):
    return float(example["bonus"])

def length(completion, example: dict) -> float:
    return len(completion)

def misbehave(completion, example):
    if completion == "raise":
        raise ValueError("no luck")
    if completion == "string":
        return "1"
    if completion == "nan":
        return math.nan
    return 1.0

class Scorer:
    def __call__(self, completion, example):
        return 2.0

scorer = Scorer()
not_a_function = 3
lambda_reward = lambda completion, example: 1.0

def one_argument(completion):
    return 1.0

def three_required(completion, example, extra):
    return 1.0
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of reward functions written to tmp_path (a unique name: modules are cached by name)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"user_rewards_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    return name, tmp_path


def test_specs_parse():
    assert RewardSpec.parse("pkg.mod:fn") == RewardSpec(module="pkg.mod", function="fn", weight=1.0)
    assert RewardSpec.parse(" mod:Obj.method=-0.5 ") == RewardSpec(module="mod", function="Obj.method", weight=-0.5)
    assert str(RewardSpec.parse("m:f=2")) == "m:f=2" and str(RewardSpec.parse("m:f")) == "m:f"
    for bad, message in [("mod", "expected package.module:function"), ("mod:", "expected"), (":fn", "expected"),
                         ("1mod:fn", "expected"), ("m:f=abc", "the weight 'abc' is not a number"),
                         ("m:f=inf", "the weight must be finite")]:
        with pytest.raises(RewardSpecError, match=message):
            RewardSpec.parse(bad)


def test_weighted_sum_of_loaded_functions(user_module):
    name, directory = user_module
    reward = load_rewards([f"{name}:exact", f"{name}:bonus=2", f"{name}:length=-0.5"], search_path=[directory])
    assert [term.name for term in reward.terms] == [f"{name}:exact", f"{name}:bonus=2", f"{name}:length=-0.5"]
    assert reward(" 4", EXAMPLE) == 1.0 + 2 * 0.25 - 0.5 * 2
    assert reward("5", EXAMPLE) == 0.0 + 2 * 0.25 - 0.5 * 1
    assert load_rewards([f"{name}:scorer"], search_path=[directory])("x", EXAMPLE) == 2.0


def test_the_current_directory_is_searched_by_default(user_module, monkeypatch):
    name, directory = user_module
    monkeypatch.chdir(directory)
    assert load_reward_function(RewardSpec.parse(f"{name}:exact"))("4", EXAMPLE) == 1.0


@pytest.mark.parametrize(
    "function, message",
    [
        ("nothing", "has no attribute 'nothing'"),
        ("exac", "did you mean 'exact'?"),
        ("not_a_function", "is int 3, not a function"),
        ("Scorer", "is a class"),
        ("one_argument", "cannot be called as function(completion: str, example: dict) nor as TRL's function(prompts, completions, **columns); its signature is (completion)"),
        ("three_required", "its signature is (completion, example, extra)"),
        ("lambda_reward", "cannot be sent to the reward worker processes"),
    ],
)
def test_unusable_functions_are_named(user_module, function, message):
    name, directory = user_module
    with pytest.raises(RewardSpecError) as error:
        load_rewards([f"{name}:{function}"], search_path=[directory])
    assert str(error.value).startswith(f"reward {name}:{function}: ") and message in str(error.value)


def test_modules_that_do_not_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(RewardSpecError, match=r"reward no_such_module_xyz:f: no module named 'no_such_module_xyz' "
                                              r"\(looked on PYTHONPATH and in"):
        load_rewards(["no_such_module_xyz:f"], search_path=[tmp_path])
    (tmp_path / "broken_reward_mod.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(RewardSpecError, match="importing 'broken_reward_mod' failed: No module named "
                                              "'no_such_dependency_xyz'"):
        load_rewards(["broken_reward_mod:f"], search_path=[tmp_path])
    (tmp_path / "syntax_reward_mod.py").write_text("def f(:\n")
    with pytest.raises(RewardSpecError, match="importing 'syntax_reward_mod' failed: SyntaxError"):
        load_rewards(["syntax_reward_mod:f"], search_path=[tmp_path])
    with pytest.raises(RewardSpecError, match="given more than once"):
        load_rewards(["m:f", "m:f=2"], search_path=[tmp_path])


def test_a_failing_term_names_itself(user_module):
    name, directory = user_module
    reward = load_rewards([f"{name}:exact", f"{name}:misbehave=0.5"], search_path=[directory])
    assert reward("4", EXAMPLE) == 1.5
    with pytest.raises(RuntimeError, match=f"reward {name}:misbehave=0.5: ValueError: no luck"):
        reward("raise", EXAMPLE)
    with pytest.raises(RuntimeError, match=f"reward {name}:misbehave=0.5 returned str '1'; expected a finite float"):
        reward("string", EXAMPLE)
    with pytest.raises(RuntimeError, match=f"reward {name}:misbehave=0.5 returned nan"):
        reward("nan", EXAMPLE)


def test_library_callables_and_weights():
    from reward_fns_for_tests import slow, text_length

    reward = WeightedReward.of(text_length, (lambda_free_constant, 8))
    assert reward("abcd", EXAMPLE) == 5.0
    assert reward.terms[0].name.endswith(":text_length") and reward.term_names[1].endswith(":lambda_free_constant")
    with pytest.raises(RewardSpecError, match="the weight must be a finite number"):
        WeightedReward.of((text_length, float("nan")))
    with pytest.raises(RewardSpecError, match="is a class"):
        WeightedReward.of(Example)
    with pytest.raises(RewardSpecError, match="text_length is given more than once"):  # its metrics would clash
        WeightedReward.of(text_length, (text_length, 0.5), slow)


def test_one_failing_term_costs_only_its_own_score(user_module):
    """The other terms keep their scores; each term's errors and mean are counted (TRL's per-function logs)."""
    name, directory = user_module
    reward = load_rewards([f"{name}:misbehave", f"{name}:bonus=2"], search_path=[directory])
    task = RewardedTask(make_task("arithmetic"), reward)
    assert task.isolation is Isolation.PROCESS
    config = RewardRunnerConfig(timeout_s=30, workers=1, isolation=task.isolation)
    with RewardRunner(task.reward, config) as runner:
        texts = ["ok", "raise", "string", "nan", "fine"]
        rewards, stats = runner.score(texts, [EXAMPLE] * len(texts))
    # misbehave (1 when it works) + 2 x bonus (0.25): a failing misbehave leaves 0.5, not 0
    np.testing.assert_array_equal(rewards, np.array([1.5, 0.5, 0.5, 0.5, 1.5], np.float32))
    assert (stats.errors, stats.nonfinite, stats.timeouts) == (3, 1, 0)
    assert stats.first_error == f"reward {name}:misbehave: ValueError: no luck"
    metrics = stats.metrics()
    assert metrics[f"reward/{name}:misbehave"] == 1.0 and metrics[f"reward/{name}:misbehave/errors"] == 3.0
    assert metrics[f"reward/{name}:bonus"] == 0.25 and metrics[f"reward/{name}:bonus/errors"] == 0.0


def test_a_rewarded_task_keeps_the_task_but_its_reward():
    task = make_task("arithmetic")
    rewarded = RewardedTask(task, WeightedReward.of(lambda_free_constant))
    [example] = rewarded.eval_examples(1, seed=3)
    assert example == task.eval_examples(1, seed=3)[0] and rewarded.train_examples(2, 0) == task.train_examples(2, 0)
    solution = rewarded.reference_solution(example)
    assert solution == task.reference_solution(example)
    assert rewarded.is_correct(solution, example) and rewarded.reward(solution, example) == 0.125
    assert rewarded.name == task.name


def lambda_free_constant(completion, example):
    return 0.125


def _mutates_and_reports_type(completion: str, example: dict) -> float:
    kind = 1.0 if type(example) is dict else -100.0
    example["answer"] = "changed"
    return kind


def _reads_answer(completion: str, example: dict) -> float:
    return 1.0 if example["answer"] != "changed" else -100.0


def test_each_term_receives_its_own_plain_dict():
    example = Example(id="0", prompt="2+2", answer="4", task="arithmetic")
    reward = WeightedReward.of(_mutates_and_reports_type, _reads_answer)
    assert reward("4", example) == 2.0
    assert example.answer == "4"


@pytest.mark.parametrize("body, message", [
    ("import sys\nsys.exit(0)\n", r"called sys.exit\(0\); a reward module must not exit at import"),
    ("import sys\nsys.exit('bye')\n", r"called sys.exit\('bye'\)"),
    ("import os\nos._exit(0)\n", r"ended the interpreter \(exit code 0\); a reward module must not exit at import"),
    ("import time\ntime.sleep(3600)\n", r"did not finish within 3 s \(the import time limit"),
])
def test_a_module_that_exits_or_blocks_at_import_is_an_error_naming_the_spec(tmp_path, monkeypatch, body, message):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"bad_import_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(body + "def f(completion, example):\n    return 1.0\n")
    with pytest.raises(RewardSpecError, match=rf"^reward {name}:f: importing '{name}' " + message):
        load_rewards([f"{name}:f"], search_path=[tmp_path], import_timeout_s=3)


def test_batched_trl_functions_beside_per_completion_ones():
    """TRL's f(prompts, completions, **columns) -> list[float | None], detected by its signature, in a worker
    process: its columns are the examples' fields; a raise fails its term for the chunk, None adds 0 (no error)."""
    from reward_fns_for_tests import batched_length, batched_misbehave, text_length

    reward = WeightedReward.of((batched_length, 0.5), batched_misbehave, (text_length, -1))
    assert [term.kind.value for term in reward.terms] == ["batched", "batched", "per_completion"] and reward.batched
    examples = [EXAMPLE, Example(id="c", prompt="chat", answer="abc", task="math", messages=[("user", "chat")])]
    config = RewardRunnerConfig(timeout_s=30, workers=1, isolation=Isolation.PROCESS)
    with RewardRunner(reward, config) as runner:
        rewards, stats = runner.score(["4", "abc"], examples)
        skipped, skip_stats = runner.score(["skip", "xy"], examples)
        raised, raise_stats = runner.score(["raise", "raise"], examples)  # chunks may hold one completion
    # 0.5 x (len + exact answer) + 2 - len
    np.testing.assert_array_equal(rewards, np.array([0.5 * 2 + 2 - 1, 0.5 * 4 + 2 - 3], np.float32))
    assert stats.errors == 0 and [t.scored for t in stats.terms] == [2, 2, 2]
    np.testing.assert_array_equal(skipped, np.array([0.5 * 4 + 0 - 4, 0.5 * 2 + 2 - 2], np.float32))
    assert skip_stats.errors == 0 and skip_stats.terms[1].scored == 1  # None: no score, no error
    np.testing.assert_array_equal(raised, np.array([0.5 * 5 - 5] * 2, np.float32))
    assert raise_stats.errors == 2 and raise_stats.terms[1].errors == 2
    assert "batched_misbehave: RuntimeError: batched failure" in raise_stats.first_error
    assert reward("4", EXAMPLE) == 0.5 * 2 + 2 - 1


def test_a_batched_function_receives_trl_arguments():
    seen = {}

    def record(prompts, completions, answer, bonus, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, bonus=bonus, **kwargs)
        return [1.0] * len(completions)

    chat = Example(id="c", prompt="hi", answer="7", task="math", messages=[("system", "be brief"), ("user", "hi")],
                   meta={"bonus": "0.5", "extra": '{"level": 3}'}, json_fields=["extra"])
    WeightedReward((RewardTerm(record, 1.0, "record"),)).score_terms(["a", "b"], [EXAMPLE, chat])
    assert seen["prompts"] == ["2+2?", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    assert seen["completions"] == ["a", "b"] and seen["answer"] == ["4", "7"] and seen["bonus"] == ["0.25", "0.5"]
    assert seen["extra"] == [None, {"level": 3}] and seen["id"] == ["e", "c"] and "prompt" not in seen


def _huge(completion, example):
    return 3e38


def test_a_weighted_sum_past_float32_is_a_nonfinite_error_not_inf():
    reward = WeightedReward.of(_huge, (lambda_free_constant, 1.0), (_huge_too, 1.0))
    with RewardRunner(reward, RewardRunnerConfig(timeout_s=30, workers=1, isolation=Isolation.THREAD)) as runner:
        rewards, stats = runner.score(["x"], [EXAMPLE])
    assert rewards.tolist() == [0.0] and stats.errors == stats.nonfinite == 1 and "weighted sum" in stats.first_error


def _huge_too(completion, example):
    return 3e38
