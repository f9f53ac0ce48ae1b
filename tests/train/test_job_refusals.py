"""The main job refusing bad input, and the runs that need a fresh directory of their own: bad flags and plans
(in this process, leaving JAX's settings as they were), a malformed dataset, generation on its own device, a local
Hugging Face checkpoint on a JSONL dataset, a refused resume, an unwritable run directory. Split from
test_train_job.py (whose runs share one job) so that the two files run on two test workers."""

import json
import os
import subprocess
import sys

import pytest
from test_train_job import ROOT, TINY, metrics, run_job

from rpegjax.train.checkpoint import Checkpointer


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--mesh=data=9",), "9 devices but 8 are available"),
        (("--rollout-devices=8",), "graph.rollout_devices=8 leaves no device for training (8 devices)"),
        (("--plan=/nonexistent.json",), "graph.plan /nonexistent.json: cannot read it"),
        (("--plan={ppo_plan}",), "graph.plan {ppo_plan}: the plan has algorithm = ppo, this run grpo"),
    ],
)
def test_bad_input_is_refused_before_the_compilation_cache_goes_on(tmp_path, capsys, flags, message):
    """Input the job checks once it runs (the mesh, the devices, the plan file), refused through its entry point in
    this process (8 virtual devices; a script start costs ~8 s): exit code 2 with the reason, and JAX's
    compilation cache setting as it was, its directory never made (the cache goes on only after the checks)."""
    import jax

    from rpegjax.graph import builders
    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.cli import main

    assert jax.device_count() == 8
    ppo_plan = tmp_path / "ppo.json"
    ppo_plan.write_text(builders.ppo_graph(use_reference=True).to_json())
    setting, cache = jax.config.jax_compilation_cache_dir, tmp_path / "jax-cache"
    flags = [flag.format(ppo_plan=ppo_plan) for flag in flags]
    code = main([*TINY, f"--run-dir={tmp_path / 'bad'}", "--steps=1", f"--train.compilation_cache_dir={cache}", *flags],
                Algorithm.GRPO)
    assert code == 2 and message.format(ppo_plan=ppo_plan) in capsys.readouterr().err
    assert jax.config.jax_compilation_cache_dir == setting and not cache.exists()
    assert not (tmp_path / "bad").exists()


def test_build_checks_the_input_before_it_compiles_anything(tmp_path):
    """`build` calls `before_compiling` (where the job turns its compilation cache on) after its checks and before
    any program compiles (JAX reports every backend compilation)."""
    import jax

    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.build import build
    from rpegjax.train.cli import parse_command

    class Reached(Exception):
        pass

    compiled = []

    def before_compiling():
        raise Reached(list(compiled))

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    config = parse_command([*TINY, f"--run-dir={tmp_path / 'run'}", "--steps=1", "--mesh=data=8"], Algorithm.GRPO).config
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with pytest.raises(Reached) as reached:
            build(config, log=lambda _: None, before_compiling=before_compiling)
        assert reached.value.args[0] == []
        jax.jit(lambda x: x + 1)(jax.numpy.arange(3))  # the listener hears a compilation
        assert compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--async-bound=-1",), "async_bound must be an integer >= 0"),
        (("--rollout.bogus=1",), "unknown field 'bogus'"),
        (("--dataset=/nonexistent.jsonl",), "no such file or directory"),
    ],
)
def test_bad_flags_are_refused_as_they_are_parsed(tmp_path, capsys, flags, message):
    """As above, for flags refused while they are parsed (before a device, directory or cache is touched):
    through the job's entry point in this process, as a script start costs ~8 s each."""
    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.cli import main

    with pytest.raises(SystemExit) as exit:
        main([*TINY, f"--run-dir={tmp_path / 'bad'}", "--steps=1", *flags], Algorithm.GRPO)
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_generation_on_its_own_device(tmp_path):
    run_dir = tmp_path / "split"
    result = run_job(run_dir, "--steps=2", "--rollout-devices=1", "--async-bound=1", "--verbose", devices=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RPEG grpo" in result.stderr and "placements:" in result.stderr  # --verbose: the executed graph
    graph = json.loads((run_dir / "graph.json").read_text())
    assert {p["name"]: p["devices"] for p in graph["placements"]} == {"rollout": [0], "train": [1]}
    trace = json.loads((run_dir / "trace.json").read_text())
    threads = {e["args"]["devices"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "generate"}
    assert threads == {"rollout"}


def test_malformed_dataset_row_names_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    result = run_job(tmp_path / "bad", "--steps=1", f"--dataset={data}")
    assert result.returncode != 0
    assert f"{data}:2" in result.stderr


def test_job_trains_a_local_hugging_face_checkpoint_on_a_jsonl_dataset(tmp_path):
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.models.hf import save_pretrained

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    model_dir = tmp_path / "model"
    cfg = ModelConfig.tiny(vocab_size=len(vocab), eos_token_id=1)
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, model_dir)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    command = [sys.executable, str(ROOT / "scripts" / "train_grpo.py"), f"--model={model_dir}", f"--dataset={data}",
               "--steps=2", f"--run-dir={tmp_path / 'run'}", "--prompts-per-step=4", "--group-size=2",
               "--max-new-tokens=4", "--data.eval_size=8", "--mesh=data=1", "--train.reward_workers=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2]
    exported = tmp_path / "run" / "hf"  # the final policy, with the checkpoint's own tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (model_dir / name).read_bytes()
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == cfg.vocab_size


def test_a_refused_resume_leaves_the_run_and_a_damaged_checkpoint_falls_back(tmp_path, capsys):
    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.cli import main

    run_dir = tmp_path / "run"
    first = run_job(run_dir, "--steps=2", "--checkpoint-every=1")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (run_dir / "config.json").read_bytes()
    refused = run_job(run_dir, "--resume", str(run_dir), "--model.seed=5")
    assert refused.returncode == 2 and "other initial weights" in refused.stderr
    assert (run_dir / "config.json").read_bytes() == saved
    # a new run into it is refused too, as the directory is claimed (in this process: nothing is built)
    assert main([*TINY, f"--run-dir={run_dir}", "--steps=1"], Algorithm.GRPO) == 2
    assert "is not empty" in capsys.readouterr().err
    for file in (run_dir / "checkpoints" / "2" / "arrays").rglob("*"):
        if file.is_file():
            file.write_bytes(b"damaged")
    resumed = run_job(run_dir, "--resume", str(run_dir), "--steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "falling back to checkpoint 1" in resumed.stderr
    assert Checkpointer(run_dir / "checkpoints").latest_step() == 3


def test_a_run_directory_that_cannot_be_written_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_job(blocker / "run", "--steps=1")
    assert result.returncode == 1
    assert "error: cannot write the run:" in result.stderr and "Traceback" not in result.stderr
