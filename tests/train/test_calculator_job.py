"""The README's calculator job: its warm start teaches the call format, so a short run calls the tool and held-out
accuracy does not collapse (before that warm start the run never called it and held-out accuracy fell to 0)."""

import json

import pytest
from test_train_job import run_job

# the README's command (`--env calculator --max-turns 3 --rollout.tool_tags='[,],{,}' --rollout.max_prompt_len=96`),
# its model and warm start, with fewer prompts per step, 32 held-out problems and 4 RL steps (a 1-layer model of
# width 64 warm-started for 100 steps learns the call but not to copy the calculator's answer)
CALCULATOR = [
    "--env=calculator", "--max-turns=3", "--rollout.tool_tags=[,],{,}", "--rollout.max_prompt_len=96",
    "--data.eval_size=32", "--prompts-per-step=4", "--group-size=4", "--rollout.num_slots=16",
    "--train.reward_workers=1", "--mesh=data=1", "--eval-every=0", "--train.export_hf=false",
]


@pytest.mark.slow  # 5-10 minutes on 2 loaded cores: mostly the warm start (150 steps)
def test_a_short_calculator_run_calls_the_tool_and_keeps_its_accuracy(tmp_path):
    result = run_job(tmp_path / "run", "--steps=4", config=CALCULATOR, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "supervised steps on worked episodes that call the calculator" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    # every episode called the calculator: its answer `{n}` is 3-5 tool tokens
    assert all(r["tool_tokens"] >= 3 for r in steps), [r["tool_tokens"] for r in steps]
    evaluations = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert evaluations[0] >= 0.5 and evaluations[-1] >= 0.5, evaluations
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any(s["response"].startswith("[") and "]{" in s["response"] for s in samples if s["source"] == "eval")
