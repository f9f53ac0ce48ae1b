"""The Python entry point (`rpegjax.GRPOTrainer`): options, reward functions and where they run, datasets as
lists of rows. The end-to-end run is the documented notebook example (`tests/test_docs.py`)."""

import json

import pytest

import rpegjax
from rpegjax.rewards.custom import RewardSpecError
from rpegjax.rewards.runner import Isolation
from rpegjax.train.api import GRPOTrainer, PPOTrainer, _dataset_path, importable_elsewhere, reward_terms


def length_reward(completion: str, example: dict) -> float:
    return len(completion) / 100


def test_the_package_exports_the_trainers_on_first_use():
    assert rpegjax.GRPOTrainer is GRPOTrainer and rpegjax.PPOTrainer is PPOTrainer
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        rpegjax.Trainer  # noqa: B018


def test_importable_functions_run_in_worker_processes_others_in_this_process_and_it_is_said():
    notebook = lambda completion, example: 1.0  # noqa: E731
    main = type(length_reward)(length_reward.__code__, {}, "defined_in_a_notebook")
    main.__module__ = "__main__"
    assert importable_elsewhere(length_reward) and not importable_elsewhere(notebook) and not importable_elsewhere(main)
    terms, isolation = reward_terms([length_reward, (f"{__name__}:length_reward", 0.5)], None)
    assert isolation is Isolation.PROCESS and [t.weight for t in terms] == [1.0, 0.5]
    terms, isolation = reward_terms([length_reward, (notebook, 2.0)], None)
    assert isolation is Isolation.THREAD and terms[1].fn is notebook and terms[1].weight == 2.0
    assert reward_terms([length_reward], "thread")[1] is Isolation.THREAD
    with pytest.raises(RewardSpecError, match="cannot import it .*reward_isolation='thread'"):
        reward_terms([main], "process")
    with pytest.raises(RewardSpecError, match=r"reward_funcs\[0\].*cannot be called as function\(completion"):
        reward_terms([lambda completion: 0.0], None)


def test_options_are_the_short_flags_and_a_bad_one_is_named(tmp_path):
    with pytest.raises(TypeError, match="unknown option 'group_szie'; did you mean 'group_size'"):
        GRPOTrainer(group_szie=4)
    with pytest.raises(ValueError, match="RolloutSection.group_size must be a positive integer"):
        GRPOTrainer(group_size=0)
    with pytest.raises(TypeError, match="unknown option 'critic'"):
        GRPOTrainer(critic="shared")  # PPO's flag, not GRPO's
    trainer = PPOTrainer(critic="shared", lr=3e-5, overrides={"rollout.temperature": 0.8}, lora_rank=4,
                         lora_targets=["q", "v"])
    assert trainer._changes == {"ppo.critic": "shared", "ppo.optimizer.learning_rate": "3e-05",
                                "rollout.temperature": "0.8", "lora.rank": "4", "lora.targets": "q,v"}
    with pytest.raises(ValueError, match="LoRASection.targets=.* needs LoRA adapters"):
        GRPOTrainer(lora_targets=["q", "v"])  # targets without a rank, as on the command line
    # a dataset turns the warm start off, as on the command line (it has no worked solutions)
    assert GRPOTrainer(train_dataset=[{"prompt": "1+1=", "answer": "2"}])._changes == {"warm_start.steps": "0"}


def test_a_list_dataset_is_written_as_jsonl_and_a_bad_row_is_named(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "2+2=", "answer": "4"}]
    path = _dataset_path(rows, tmp_path / "data" / "dataset.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert _dataset_path("x.jsonl", tmp_path / "unused.jsonl").name == "x.jsonl"
    with pytest.raises(ValueError, match="dataset row 1: expected a dict, got str"):
        _dataset_path([rows[0], "oops"], tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="dataset row 0: not JSON-serialisable"):
        _dataset_path([{"prompt": object()}], tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="a path or a list of row dicts, got dict"):
        _dataset_path(rows[0], tmp_path / "bad.jsonl")


def test_a_run_directory_another_run_holds_is_refused_and_kept(tmp_path):
    """The Python entry point locks its run directory as the command line does: a held one is refused."""
    from rpegjax.train.run_directory import RunDirectoryBusy, RunDirectoryLock

    held = RunDirectoryLock.claim(tmp_path / "run")
    try:
        with pytest.raises(RunDirectoryBusy, match="in use by another run"):
            GRPOTrainer(run_dir=tmp_path / "run", steps=1).train()
    finally:
        held.release()
    assert (tmp_path / "run").is_dir()
