"""Sample completions as people read them: which ones are chosen, their verdicts, the files they go to."""

import json

import numpy as np

from rpegjax.data.example import Example
from rpegjax.generate.completion import Completion, FinishReason
from rpegjax.train.evaluation import Answer
from rpegjax.train.samples import SampleLog, console_lines, evaluation_samples, markdown, training_samples


def _completion(prompt_index, sample_index, ids):
    ids = np.array(ids, np.int32)
    return Completion(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=np.array([5], np.int32),
                      response_ids=ids, behaviour_logprobs=np.zeros(len(ids), np.float32),
                      finish_reason=FinishReason.EOS)


def test_training_samples_take_one_completion_per_prompt_with_its_reward():
    examples = [Example(id=str(i), prompt=f"Q{i}|\n", answer=str(i), task="t") for i in range(3)]
    completions = [_completion(p, s, [p, s]) for p in range(3) for s in range(2)]
    rewards = np.array([1.0, 0.0, 0.2, 1.0, 1.1, 0.0], np.float32)
    decode = lambda ids: "".join(f"<{i}>" for i in ids)
    chosen = training_samples(7, completions, examples, rewards, decode, count=2)
    assert [(s.prompt, s.response, s.reward, s.correct) for s in chosen] == [
        ("Q0|\n", "<0><0>", 1.0, True), ("Q1|\n", "<1><0>", np.float32(0.2), False)]
    assert all(s.step == 7 and s.source == "train" and s.finish_reason == "eos" for s in chosen)
    table = markdown(chosen)
    assert table.splitlines()[2] == "| correct | 1.000 | Q0\\|\\n | <0><0> | 0 |"  # one row per sample, escaped
    line = console_lines(chosen, width=5)[1]
    assert "✗ reward 0.20" in line and "| Q1|\\n -> <1..." in line


def test_sample_log_appends_json_lines_and_drops_steps_a_resume_redoes(tmp_path):
    example = Example(id="0", prompt="p", answer="a", task="t")
    log = SampleLog(tmp_path)
    for step in (0, 2, 4):
        log.write(evaluation_samples(step, [Answer(example, f"r{step}", step == 2, "length")], count=4))
    log.write(training_samples(4, [_completion(0, 0, [1])], [example], np.array([0.5]), str, count=1))
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["source"], r["step"], r["correct"], r["reward"]) for r in rows] == [
        ("eval", 0, False, None), ("eval", 2, True, None), ("eval", 4, False, None), ("train", 4, False, 0.5)]
    log.truncate(4)  # resumed from the checkpoint of step 4: its training samples stay, its final evaluation goes
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["source"], r["step"]) for r in rows] == [("eval", 0), ("eval", 2), ("train", 4)]
    SampleLog(tmp_path / "other", enabled=False).write(evaluation_samples(0, [Answer(example, "r", True, "eos")], 1))
    assert not (tmp_path / "other").exists()
