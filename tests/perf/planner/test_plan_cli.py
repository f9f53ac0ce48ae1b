"""scripts/plan.py end to end: the table, the JSON document, a Hugging Face config.json and the Gantt PNG."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rpegjax.graph.ir import Graph
from rpegjax.models import ModelConfig
from rpegjax.perf import planner
from rpegjax.perf.model import step_model
from rpegjax.perf.model.generation_cost import ResponseLengths
from rpegjax.perf.model.stage_costs import Workload
from rpegjax.perf.planner import explain
from rpegjax.perf.reference import presets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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
    for text in ("step time (s)", "tokens/s", "MFU", "peak memory/GPU (GB)", "generate (s)", "verl-like", "ReaL-like",
                 "generation slots busy", "carried sequences", "token lag mean/max"):
        assert text in done.stdout
    bad = _run("--model", "gpt-5", *SMALL)
    assert bad.returncode != 0 and "neither a preset" in bad.stderr


# ------------------------------------------------------------------------- for people: help, legend, reasons


def _plan_module():
    spec = importlib.util.spec_from_file_location("plan_script", os.path.join(ROOT, "scripts", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_names_every_option_with_its_default_and_the_models():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for option in ("--model", "--hardware", "--gpus", "--algo", "--prompts", "--group-size", "--prompt-tokens",
                   "--response-mean", "--response-max", "--reference", "--top", "--json", "--explain", "--gantt",
                   "--packing"):
        assert option in text
    for default in ("(default: qwen2.5-7b)", "(default: gh200)", "(default: 256)", "(default: 512)", "(default: 8)",
                    "(default: 1024)", "(default: 4096)", "(default: 16384)", "(default: 3)"):
        assert default in text, default
    for model in _plan_module().MODEL_PRESETS:
        assert model in text
    assert "d48xt4" in text and "k=N" in text  # the legend is part of the help


def test_the_published_runs_models_are_presets():
    load = _plan_module().load_model
    assert load("llama3.1-8b") == load("llama3-8b") == ModelConfig.llama3("8b")
    assert load("qwen3-32b") == ModelConfig.qwen3("32b") and load("qwen3-32b").architecture == "qwen3"
    assert load("qwen3-30b-a3b") == ModelConfig.qwen3_moe("30b-a3b")  # NeMo-RL's MoE runs
    assert load("qwen3-235b-a22b") == ModelConfig.qwen3_moe("235b-a22b")


def test_a_capacity_factor_needs_a_model_with_experts():
    done = _run("--model", "qwen2.5-0.5b", "--moe-capacity-factor", "1.25", *SMALL)
    assert done.returncode != 0 and "has no experts" in done.stderr
    # the expert modes to search (the plan's execution.moe_capacity_factor): factors or dropless
    parse = _plan_module().parse_args
    assert parse(["--moe-capacity-factor", "dropless", "1.25"]).moe_capacity_factor == [None, 1.25]
    with pytest.raises(SystemExit):
        parse(["--moe-capacity-factor", "0"])


def test_table_prints_the_legend_and_explain_says_why():
    done = _run("--model", "qwen2.5-0.5b", "--algo", "grpo", "--explain", *SMALL)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Plan notation:" in out and "asynchrony bound" in out and "FSDP" in out
    assert "Why the best plan wins" in out
    why = out[out.index("Why the best plan wins"):]
    assert "is bound by the" in why and "largest stage is" in why
    assert "verl-like:" in why and "ReaL-like:" in why and "x the best plan's" in why
    assert "inf" not in out.split()


def test_nothing_fits_says_what_binds_and_what_would_fit():
    # one asynchrony bound, remat policy and pair of kernels: 4,088 plans in place of 73,584, the same closest ones
    done = _run("--model", "qwen2.5-32b", "--hardware", "h100", "--gpus", "8", "--prompts", "16", "--group-size", "4",
                "--prompt-tokens", "256", "--response-mean", "512", "--response-max", "2048", "--top", "1",
                "--async-bounds", "0", "--remat", "full", "--attention", "blockwise", "--decode-attention", "gather")
    assert done.returncode != 0
    assert "no plan of" in done.stderr and "the closest of each family" in done.stderr
    assert "colocated (gen " in done.stderr and "exceeds the usable 72.0 GB: fits with more GPUs" in done.stderr
    assert "Traceback" not in done.stderr


def _tight_plans():
    """A 7B model on 4 H100 cut to 40 GB: the verl-like plan (FSDP over 4, its own generation copy) does not fit."""
    hw = presets.h100_node(4)
    hw = dataclasses.replace(hw, device=dataclasses.replace(hw.device, memory_bytes=40e9))
    workload = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("7b"), workload, hw)
    verl = planner.verl_like(evaluator, algorithm="grpo", num_devices=4)
    return evaluator, verl


def test_a_plan_that_does_not_fit_says_why_in_table_and_json():
    _, verl = _tight_plans()
    prediction = verl.prediction
    assert not prediction.fits
    reason = prediction.fit_reason
    assert reason.startswith("does not fit: needs ") and "GB per GPU of 36.0 GB usable" in reason
    needed = float(reason.split("needs ")[1].split(" GB")[0])
    assert needed == pytest.approx(prediction.needed_memory_bytes / 1e9, abs=0.05) and needed > 36.0
    table = _plan_module().table([("verl-like", prediction)])
    assert "does not fit" in table and "inf" not in table.split()
    document = json.loads(json.dumps(prediction.to_dict(), allow_nan=False))  # strict JSON: no Infinity
    assert document["step_seconds"] is None and document["reason"] == reason and document["fits"] is False
    assert "does not fit" in explain.compare(verl, verl, "verl-like")


def test_fitted_efficiencies_slow_the_prediction_down():
    """The efficiencies fitted to NeMo RL's runs (0.5, 0.575) are below the presets' assumptions (0.7, 0.8)."""
    args = ["--model", "qwen2.5-0.5b", "--json", *SMALL]
    plain, fitted = _run(*args), _run(*args, "--fitted-efficiencies")
    assert plain.returncode == 0 and fitted.returncode == 0, plain.stderr + fitted.stderr
    step = lambda done: json.loads(done.stdout)["plans"][0]["prediction"]["step_seconds"]
    assert step(fitted) > step(plain)


# ---------------------------------------------------------------------------------- measured hardware profiles
@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """This CPU measured (smoke sizes, bfloat16) over the 8 virtual devices, written to a file."""
    from rpegjax.perf.reference import calibration

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    calibration.measure_profile(dtypes=("bfloat16",), repeats=2, sizes=calibration.Sizes.smoke()).write(str(path))
    return path


def _plan_json(capsys, *args: str) -> dict:
    assert _plan_module().main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _stage_seconds(document: dict, plan: str) -> dict[str, float]:
    found = next(p for p in document["plans"] if p["name"] == plan)
    return {stage["name"]: stage["seconds"] for stage in found["prediction"]["stages"]}


CPU_SMALL = ["--hardware", "cpu", "--gpus", "8", "--prompts", "8", "--group-size", "4", "--prompt-tokens", "64",
             "--response-mean", "64", "--response-max", "256", "--top", "0"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A Qwen2.5-0.5B-shaped config cut to fit this host's RAM split over 8 virtual devices (8 layers, vocab 32k)."""
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(ModelConfig.qwen2p5("0.5b").replace(num_layers=8, vocab_size=32000).to_hf_dict()))
    return ["--model", str(path)]


def test_a_profile_measured_here_plans_this_cpu_and_a_slower_matmul_slows_the_update(cpu_profile, small_model, tmp_path,
                                                                                    capsys):
    measured = json.loads(cpu_profile.read_text())
    assert measured["platform"] == "cpu" and measured["measured"]["all_reduce"]["devices"] == 8
    fast = _plan_json(capsys, *small_model, *CPU_SMALL, "--hardware-profile", str(cpu_profile))
    assert all(plan["prediction"]["fits"] for plan in fast["plans"])
    slower = json.loads(cpu_profile.read_text())
    for field in ("matmul_flops", "layer_matmul_flops", "attention_flops"):
        slower["measured"]["rates"]["bfloat16"][field] /= 2
    halved = tmp_path / "halved.json"
    halved.write_text(json.dumps(slower))
    slow = _plan_json(capsys, *small_model, *CPU_SMALL, "--hardware-profile", str(halved))
    before, after = _stage_seconds(fast, "verl-like"), _stage_seconds(slow, "verl-like")
    updates = [name for name in before if "update" in name]
    assert updates and all(after[name] > before[name] for name in updates)
    assert all(after[name] >= before[name] for name in before)


def test_a_profile_of_another_device_or_a_bad_file_is_refused(cpu_profile, tmp_path):
    plan = _plan_module()
    with pytest.raises(SystemExit, match=r"--hardware-profile .*cpu.json: the hardware profile was measured on 'cpu' "
                                         r"\(cpu\), not on the H100 of preset 'h100'"):
        plan.main([*SMALL[2:], "--hardware", "h100", "--hardware-profile", str(cpu_profile)])
    with pytest.raises(SystemExit, match="collectives over 8 device\\(s\\); a plan on 16 would extrapolate"):
        plan.main([*CPU_SMALL[:2], "--gpus", "16", "--hardware-profile", str(cpu_profile)])
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads(cpu_profile.read_text()), "format": 7}))
    with pytest.raises(SystemExit, match="broken.json: format 7 is not supported"):
        plan.main([*CPU_SMALL, "--hardware-profile", str(broken)])
    done = _run("--hardware", "cpu", "--gpus", "8")
    assert done.returncode != 0 and "--hardware cpu needs --hardware-profile" in done.stderr


def test_the_asynchrony_and_optimiser_steps_asked_for_are_the_plans():
    done = _run("--model", "qwen2.5-0.5b", "--json", "--async-bounds", "1", "--optimizer-steps", "2", *SMALL)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    for plan in [*document["plans"][:1], *document["alternatives"]]:
        graph = Graph.from_dict(plan["graph"])
        assert graph.async_bound == 1 and "2 optimiser steps" in plan["description"]
        assert graph.execution.decode_slots is not None  # the sampler's slots are the plan's, pinned
    bad = _run("--async-bounds", "x", *SMALL)
    assert bad.returncode == 2 and "--async-bounds" in bad.stderr
