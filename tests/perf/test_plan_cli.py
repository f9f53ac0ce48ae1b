"""scripts/plan.py end to end: the table, the JSON document, a Hugging Face config.json and the Gantt PNG."""

import json
import os
import subprocess
import sys

from rpegjax.graph.ir import Graph
from rpegjax.models import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--hardware", "gh200", "--gpus", "8", "--prompts", "16", "--group-size", "4", "--prompt-tokens", "256",
         "--response-mean", "512", "--response-max", "2048", "--top", "1"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_json_output_parses_and_holds_executable_graphs(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ModelConfig.qwen2p5("0.5b").to_hf_dict()))
    gantt = tmp_path / "plan.png"
    done = _run("--model", str(config), "--algo", "ppo", "--json", "--gantt", str(gantt), *SMALL)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    names = [plan["name"] for plan in document["plans"]]
    assert names == ["best", "verl-like", "ReaL-like"]
    steps = {plan["name"]: plan["prediction"]["step_seconds"] for plan in document["plans"]}
    assert steps["best"] <= min(steps["verl-like"], steps["ReaL-like"])
    for plan in document["plans"]:
        assert plan["prediction"]["fits"] and plan["prediction"]["stages"]
        assert Graph.from_dict(plan["graph"]).validate().num_devices == 8
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output_and_bad_model():
    done = _run("--model", "qwen2.5-0.5b", "--algo", "grpo", *SMALL)
    assert done.returncode == 0, done.stderr
    for text in ("step time (s)", "tokens/s", "MFU", "peak memory/GPU (GB)", "generate (s)", "verl-like", "ReaL-like"):
        assert text in done.stdout
    bad = _run("--model", "gpt-5", *SMALL)
    assert bad.returncode != 0 and "neither a preset" in bad.stderr
