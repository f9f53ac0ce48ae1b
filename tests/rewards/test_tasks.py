"""Properties every built-in task must have: held-out split, determinism, verifiable references, safety,
and the short-string budget of the default CPU run."""

import string

import pytest

from rpegjax.rewards.runner import Isolation, RewardRunner
from rpegjax.rewards.task import Difficulty, Task, in_eval_split
from rpegjax.rewards.tasks import TASKS, make_task

ALLOWED = set(string.printable) - set("\t\r\x0b\x0c") | {"\n"}
MALICIOUS = [
    "A:__import__('os').system('echo pwned')",
    "A:9**9**9",
    "A:9^9^9",
    "A:" + "9" * 5000,
    "A:" + "(" * 5000,
    "__import__('os')",
    "A:",
    "",
    "\x00\x01A:\ud800",
]


@pytest.fixture(params=[(name, difficulty) for name in TASKS for difficulty in Difficulty], ids=str)
def task(request):
    return make_task(*request.param)


def test_tasks_satisfy_the_protocol(task):
    assert isinstance(task, Task)
    assert task.isolation is Isolation.THREAD


def test_train_and_eval_are_disjoint_and_deterministic(task):
    train, held_out = task.train_examples(200, seed=0), task.eval_examples(50, seed=0)
    assert len({e.id for e in train}) == 200 and len({e.id for e in held_out}) == 50
    assert not {e.id for e in train} & {e.id for e in held_out}
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert task.train_examples(200, seed=0) == train and task.eval_examples(50, seed=0) == held_out
    assert task.train_examples(200, seed=1) != train
    # Another seed draws other held-out problems, but never a training one.
    assert not {e.id for e in task.eval_examples(50, seed=7)} & {e.id for e in task.train_examples(300, seed=3)}


def test_reference_solutions_verify(task):
    for example in task.train_examples(100, seed=1) + task.eval_examples(30, seed=1):
        solution = task.reference_solution(example)
        assert task.is_correct(solution, example), (example, solution)
        assert task.reward(solution, example) == 1.0
        assert set(example.prompt) <= ALLOWED and set(solution) <= ALLOWED


def test_easy_strings_fit_the_tiny_model_budget():
    for name in TASKS:
        task = make_task(name, "easy")
        examples = task.train_examples(500, seed=0)
        assert max(len(e.prompt) for e in examples) <= 32, name
        assert max(len(task.reference_solution(e)) for e in examples) <= 48, name


def test_builtin_tokenizer_encodes_every_task_string():
    tokenizer_module = pytest.importorskip("rpegjax.models.tokenizer")
    tokenizer = tokenizer_module.builtin_tokenizer()
    for name in TASKS:
        task = make_task(name, "hard")
        for example in task.train_examples(50, seed=0):
            for text in (example.prompt, task.reference_solution(example)):
                assert tokenizer.decode(tokenizer.encode(text)) == text


def test_wrong_and_malicious_answers_score_zero(task):
    example = task.eval_examples(1, seed=0)[0]
    wrong = f"A:{int(example.answer) + 1}"
    for text in [wrong, *MALICIOUS]:
        assert task.reward(text, example) == 0.0, text
        assert not task.is_correct(text, example), text
    # Through the runner too: all score 0 and nothing errors or times out.
    with RewardRunner.for_task(task, timeout_s=5.0, workers=2) as runner:
        rewards, stats = runner.score(MALICIOUS, [example] * len(MALICIOUS))
    assert rewards.tolist() == [0.0] * len(MALICIOUS)
    assert stats.errors == 0 and stats.timeouts == 0


def test_format_bonus_rewards_a_well_formed_wrong_answer():
    for name in TASKS:
        task = make_task(name, "easy", format_bonus=0.1)
        example = task.eval_examples(1, seed=0)[0]
        wrong = f"A:{int(example.answer) + 1}"
        assert task.reward(wrong, example) == pytest.approx(0.1)
        assert task.reward("no answer line", example) == 0.0
        assert task.reward(task.reference_solution(example), example) == 1.0


def test_held_out_split_is_a_stable_hash():
    keys = [f"problem {i}" for i in range(4000)]
    held_out = [in_eval_split(key, 0.1) for key in keys]
    assert 0.08 < sum(held_out) / len(keys) < 0.12
    assert held_out == [in_eval_split(key, 0.1) for key in keys]


def test_make_task_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown built-in task 'sudoku'"):
        make_task("sudoku")
    with pytest.raises(ValueError, match="unknown difficulty 'brutal'"):
        make_task("arithmetic", "brutal")
    with pytest.raises(ValueError, match="found only"):
        make_task("arithmetic", digits=1).eval_examples(100, seed=0)  # 1-digit problems are few
