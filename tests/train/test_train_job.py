"""The main job end to end (as a subprocess, like a user runs it): outputs, resume after SIGKILL,
checkpoints interrupted mid-write, and bad input."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from rpegjax.train.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the jobs' persistent compilation cache, shared by the tests' jobs (never the user's ~/.cache)
JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / "rpegjax-tests-jax-cache"
TINY = [
    "--model.hidden_size=32", "--model.num_layers=1", "--model.num_heads=2", "--model.num_kv_heads=1",
    "--model.head_dim=16", "--model.intermediate_size=64", "--data.train_size=64", "--data.eval_size=4",
    "--prompts-per-step=4", "--group-size=2", "--rollout.max_prompt_len=12", "--max-new-tokens=6",
    "--rollout.num_slots=8", "--warm-start-steps=2", "--train.reward_workers=1", "--mesh=data=1",
]
# timings differ between runs; everything else must be identical for a deterministic configuration
TIMING_KEYS = {"seconds", "tokens_per_second", "reward/seconds", "warm_start/seconds", "warm_start/cached",
               "warm_start/loss"}  # a warm start loaded from the cache reports no loss


# a model that gets non-zero rewards (a warm-started 2-layer model on countdown), so that comparisons of
# losses and gradients are not blind
LEARNING = [
    "--model.hidden_size=64", "--model.num_layers=2", "--model.num_heads=2", "--model.num_kv_heads=1",
    "--model.head_dim=32", "--model.intermediate_size=128", "--task=countdown", "--data.train_size=64",
    "--data.eval_size=4", "--prompts-per-step=4", "--group-size=4", "--rollout.max_prompt_len=12",
    "--max-new-tokens=12", "--rollout.num_slots=16", "--temperature=1.0", "--warm-start-steps=60",
    "--warm_start.learning_rate=3e-3", "--train.reward_workers=1", "--mesh=data=1",
]


def job(run_dir, *flags, script="train_grpo.py", config=TINY, devices=1):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    where = [] if "--resume" in flags else [f"--run-dir={run_dir}"]
    command = [sys.executable, str(ROOT / "scripts" / script), *config, *where,
               f"--warm_start.cache_dir={pathlib.Path(run_dir).parent}/cache",
               f"--train.compilation_cache_dir={JAX_CACHE}", *flags]
    return command, env


def run_job(run_dir, *flags, script="train_grpo.py", config=TINY, timeout=600, devices=1):
    command, env = job(run_dir, *flags, script=script, config=config, devices=devices)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir):
    records = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 3-step run with an evaluation every 2 steps and samples every 2 steps (shared by the tests that read
    its directory)."""
    run_dir = tmp_path_factory.mktemp("job") / "run"
    result = run_job(run_dir, "--steps=3", "--checkpoint-every=2", "--eval-every=2", "--train.sample_every=2",
                     "--train.samples_per_step=3")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_main_job_writes_its_run_directory_and_a_summary(tiny_run):
    run_dir, result = tiny_run
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary) == {"start_accuracy", "end_accuracy", "steps", "wall_seconds", "run_dir"}
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir)
    for name in ("config.json", "graph.json", "metrics.jsonl", "samples.jsonl", "training.png", "trace.json",
                 "gantt.png", "hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "hf/tokenizer_config.json"):
        assert (run_dir / name).stat().st_size > 0, name
    assert not (run_dir / "reward_accuracy.png").exists()  # one dashboard, no duplicate panels
    assert list((run_dir / "tensorboard").iterdir())
    assert Checkpointer(run_dir / "checkpoints").latest_step() == 3
    records = metrics(run_dir)
    # held-out accuracy at the start, every 2 steps, and at the end
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert [step for step, _ in evals] == [0, 2, 3]
    assert evals[0][1] == summary["start_accuracy"] and evals[-1][1] == summary["end_accuracy"]
    training = [r for r in records if "loss" in r]
    assert [r["step"] for r in training] == [1, 2, 3]
    assert all(0 < r["entropy"] <= np.log(104) for r in training)  # nats per token, at most log(vocabulary)
    trace = json.loads((run_dir / "trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= {"generate", "actor_update", "weight_sync"}
    # the newcomer's banner, without the graph dump (that is --verbose's)
    assert "each step: 4 prompts x 2 samples" in result.stderr and "tensorboard --logdir" in result.stderr
    assert "RPEG grpo" not in result.stderr
    # the persistent compilation cache is on, in the directory given
    assert f"compiled programs cached in {JAX_CACHE}" in result.stderr and JAX_CACHE.is_dir()


def test_samples_show_prompts_responses_rewards_and_verdicts(tiny_run):
    run_dir, result = tiny_run
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["source"] for s in samples} == {"train", "eval"}
    # training samples at the first step and every 2 steps; evaluation samples at every evaluation
    assert sorted({s["step"] for s in samples if s["source"] == "train"}) == [1, 2]
    assert sorted({s["step"] for s in samples if s["source"] == "eval"}) == [0, 2, 3]
    by_step = {}
    for s in samples:
        by_step.setdefault((s["source"], s["step"]), []).append(s)
    assert all(len(group) == 3 for group in by_step.values())
    steps = {r["step"]: r for r in metrics(run_dir) if "loss" in r}
    for s in samples:
        assert s["prompt"].startswith("Q:") and s["answer"] and isinstance(s["response"], str)
        if s["source"] == "train":
            assert s["correct"] == (s["reward"] >= 1.0)
            assert 0 <= s["reward"] <= max(1.0, steps[s["step"]]["reward"] * 8)
        else:
            assert s["reward"] is None
    for s in by_step[("train", 2)]:
        assert json.dumps(s["prompt"])[1:-1][:20] in result.stderr  # shown on the console too
    texts = tensorboard_texts(run_dir / "tensorboard")
    assert {tag for tag, _ in texts} == {"samples/train/text_summary", "samples/eval/text_summary"}
    assert all("| verdict | reward | prompt | response | gold |" in text for _, text in texts)


def tensorboard_texts(directory):
    """(tag, text) of every text summary in the TensorBoard event files of `directory` (TFRecord framing:
    length u64, its CRC u32, the Event proto, its CRC u32)."""
    import struct

    from tensorboardX.proto import event_pb2

    found = []
    for path in pathlib.Path(directory).rglob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    found.append((value.tag, value.tensor.string_val[0].decode()))
    return found


def _script(name):
    """scripts/<name>.py as a module, to call its main() in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_final_hugging_face_directory_loads_in_transformers_with_logit_parity(tiny_run):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_parity import assert_final_hf_logit_parity

    from rpegjax.models.tokenizer import builtin_tokenizer

    run_dir, _ = tiny_run
    texts = ["Q:12+30\nA:", "Q:7-5\n"]
    ours_tokenizer = builtin_tokenizer()
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(str(run_dir / "hf"))
    for text in texts:
        ids = ours_tokenizer.encode(text)
        assert theirs_tokenizer.encode(text, add_special_tokens=False) == ids
        assert theirs_tokenizer.decode(ids + [ours_tokenizer.eos_id], skip_special_tokens=True) == text
    assert theirs_tokenizer.eos_token_id == ours_tokenizer.eos_id and theirs_tokenizer.pad_token_id == ours_tokenizer.pad_id
    assert_final_hf_logit_parity(run_dir, [ours_tokenizer.encode(t) for t in texts], step=3)


def test_export_hf_script_writes_the_checkpoint_it_is_asked_for(tiny_run, tmp_path, capsys):
    from rpegjax.models.hf import load_pretrained
    from rpegjax.train.export import load_run

    run_dir, _ = tiny_run
    export = _script("export_hf")
    out = tmp_path / "step2"
    assert export.main([str(run_dir), "--step=2", f"--out={out}"]) == 0
    exported, _ = load_pretrained(out)
    _, params, _ = load_run(run_dir, 2)
    from flax import nnx

    ours = dict(nnx.to_flat_state(params))
    theirs = dict(nnx.to_flat_state(nnx.state(exported)))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(np.asarray(theirs[key].get_value()), np.asarray(ours[key].get_value()), err_msg=str(key))
    assert export.main([str(run_dir), "--step=2", f"--out={out}"]) == 2  # never replaced without --overwrite
    assert "exists" in capsys.readouterr().err
    assert export.main([str(run_dir), "--step=1", f"--out={tmp_path / 'none'}"]) == 2
    assert "no checkpoint of step 1; there are [2, 3]" in capsys.readouterr().err


def test_evaluate_reproduces_the_jobs_final_evaluation_and_generate_samples(tiny_run, tmp_path, capsys):
    run_dir, result = tiny_run
    answers = tmp_path / "answers.jsonl"
    assert _script("evaluate").main([str(run_dir), "--samples=2", f"--out={answers}"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["problems"] == 4 and summary["source"] == f"{run_dir} at step 3"
    assert summary["accuracy"] == json.loads(result.stdout.strip().splitlines()[-1])["end_accuracy"]
    assert 0 <= summary["pass@1"] <= summary["pass@2"] <= 1
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    greedy = [r for r in rows if r["kind"] == "greedy"]
    assert len(greedy) == 4 and len([r for r in rows if r["kind"] == "sampled"]) == 8
    # the job's own final evaluation wrote its first answers to samples.jsonl: the same greedy responses
    final = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    final = [s for s in final if s["source"] == "eval" and s["step"] == 3]
    assert [(s["prompt"], s["response"]) for s in final] == [(r["prompt"], r["response"]) for r in greedy[:3]]
    assert _script("evaluate").main([str(run_dir)]) == 0  # greedy only (one sample: a GRPO run's group is kept)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"] == summary["accuracy"]

    assert _script("generate").main([str(run_dir / "hf"), "--prompt", "Q:1+2\n", "--prompt", "Q:40-2\n",
                                     "--samples=2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(row["prompt"], row["sample"]) for row in lines] == [("Q:1+2\n", 0), ("Q:1+2\n", 1), ("Q:40-2\n", 0),
                                                                  ("Q:40-2\n", 1)]
    assert all(row["finish_reason"] in ("eos", "length") for row in lines)


def test_generate_gives_one_answer_to_one_prompt_without_a_group(tiny_run, capsys):
    """One (greedy) answer to one prompt needs no GRPO group: without --samples, with --samples 1 and --greedy,
    from the run directory and from its Hugging Face export."""
    run_dir, _ = tiny_run
    answers = {}
    calls = [(run_dir, flags) for flags in ([], ["--samples=1"], ["--greedy"], ["--greedy", "--seed=5"])]
    for source, flags in [*calls, (run_dir / "hf", ["--greedy"])]:
        code = _script("generate").main([str(source), "--prompt", "Q:12+30\n", "--max-new-tokens=6", *flags])
        assert code == 0, capsys.readouterr().err
        (line,) = capsys.readouterr().out.strip().splitlines()
        row = json.loads(line)
        assert (row["prompt"], row["sample"]) == ("Q:12+30\n", 0) and row["finish_reason"] in ("eos", "length")
        answers[str(source), tuple(flags)] = row["response"]
    # greedy decoding depends on no seed, and the export is the run's policy
    assert answers[str(run_dir), ("--greedy",)] == answers[str(run_dir), ("--greedy", "--seed=5")]
    assert answers[str(run_dir), ("--greedy",)] == answers[str(run_dir / "hf"), ("--greedy",)]


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_job_runs_with_either_critic(tmp_path, critic):
    result = run_job(tmp_path / "ppo", "--steps=2", f"--critic={critic}", script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 2
    records = metrics(tmp_path / "ppo")
    assert all("value_loss" in r for r in records if "loss" in r)


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    flags = ("--steps=6", "--checkpoint-every=2", "--async-bound=1")
    straight = run_job(tmp_path / "straight", *flags, config=LEARNING)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert any(r.get("grad_norm", 0) > 0 for r in metrics(tmp_path / "straight")), "a blind comparison"

    run_dir = tmp_path / "killed"
    command, env = job(run_dir, *flags, config=LEARNING)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None:
        # opening a Checkpointer creates its directory: look only once the job has made it, or the job would
        # find its fresh run directory non-empty and refuse to start
        if (run_dir / "checkpoints").is_dir() and Checkpointer(
                run_dir / "checkpoints", asynchronous=False).latest_step() in (2, 4):
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (run_dir / "checkpoints").is_dir(), "the job ended before making its checkpoint directory"
    saved = Checkpointer(run_dir / "checkpoints", asynchronous=False).latest_step()
    assert saved in (2, 4), "the job was killed before its first checkpoint"

    resumed = run_job(run_dir, "--resume", str(run_dir), config=LEARNING)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {saved}" in resumed.stderr
    ours, theirs = metrics(run_dir), metrics(tmp_path / "straight")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=f"step {a['step']} {key}")


def test_a_checkpoint_interrupted_mid_write_is_never_picked_up(tmp_path):
    import jax.numpy as jnp

    checkpoints = Checkpointer(tmp_path, asynchronous=False)
    checkpoints.save(2, {"w": jnp.ones(3)}, {"next_step": 2})
    checkpoints.wait()
    # what a process killed while writing step 4 leaves behind: orbax's temporary directory
    partial = tmp_path / "4.orbax-checkpoint-tmp-1234567"
    (partial / "arrays").mkdir(parents=True)
    (partial / "arrays" / "garbage").write_bytes(b"\x00" * 10)
    reopened = Checkpointer(tmp_path, asynchronous=False)
    assert reopened.latest_step() == 2
    arrays, meta = reopened.restore({"w": jnp.zeros(3)})
    assert meta["next_step"] == 2 and float(arrays["w"].sum()) == 3.0


@pytest.mark.slow
def test_job_trains_multi_turn_with_the_calculator(tmp_path):
    """`--env calculator` end to end: the built-in character tokenizer needs one-character tool tags."""
    run_dir = tmp_path / "calculator"
    result = run_job(run_dir, "--steps=2", "--env=calculator", "--max-turns=2", "--rollout.tool_tags=[,],{,}",
                     "--rollout.max_prompt_len=96", "--max-new-tokens=12")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollouts: multi-turn with the calculator tool (2 turns, 12 tokens per episode)" in result.stderr
    training = [r for r in metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in training] == [1, 2] and all(r["tool_tokens"] >= 0 for r in training)


# ---- LoRA (--lora-rank): adapters trained, checkpointed and exported; resume exact ---------------------------
# with LoRA dropout: the resumed run must draw the masks the straight one does
LORA_FLAGS = ("--lora-rank=4", "--lora-targets=q,v,o,down", "--lora-dropout=0.1", "--kl-coef=0.05", "--async-bound=1")


def _checkpoint_arrays(run_dir, step) -> list[str]:
    """The array paths of checkpoint `step`, from orbax's tree metadata."""
    return list(json.loads((run_dir / "checkpoints" / str(step) / "arrays" / "_METADATA").read_text())["tree_metadata"])


@pytest.mark.slow  # three short jobs (~3 min on 2 busy cores)
def test_lora_job_checkpoints_adapters_exports_and_resumes_exactly(tmp_path):
    straight = run_job(tmp_path / "straight", *LORA_FLAGS, "--steps=3", "--checkpoint-every=1", config=LEARNING)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "LoRA: rank 4, alpha 16 on q,v,o,down, dropout 0.1 in the update; trainable" in straight.stdout + straight.stderr
    run = tmp_path / "straight"
    assert json.loads((run / "config.json").read_text())["lora"]["rank"] == 4
    weights = [path for path in _checkpoint_arrays(run, 2) if "'opt_state'" not in path and "'step'" not in path]
    assert any("'history'" in path for path in weights)  # async k=1: version 1 is still read by generation
    assert weights and all("_lora'" in path for path in weights), [p for p in weights if "_lora'" not in p][:3]
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert adapter["lora_dropout"] == 0.1
    assert (run / "hf" / "model.safetensors").is_file()
    assert any(r.get("grad_norm", 0) > 0 for r in metrics(run)), "a blind comparison"

    run_dir = tmp_path / "resumed"
    first = run_job(run_dir, *LORA_FLAGS, "--steps=2", "--checkpoint-every=1", config=LEARNING)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_job(run_dir, "--resume", str(run_dir), "--steps=3", config=LEARNING)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stderr + resumed.stdout
    ours, theirs = metrics(run_dir), metrics(run)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs):
        for key in a.keys() & b.keys():
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=f"step {a['step']} {key}")
