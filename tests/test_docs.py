"""Every fenced block of README.md and of the pages under docs/ is run as written, shrunk where a full run would
take too long, or carries a mark right above its opening fence that says why it is not run
(`<!-- not run: REASON -->`: a GPU, a cluster, a fragment of one's own loop, a listing), so that the
documentation cannot rot.

Blocks are found by a distinctive piece of their text (`BLOCKS`' keys; a key may match several blocks only if they
are the same text, which one test then runs); a block that is neither matched by an entry nor marked, or an entry
that matches no block, fails `test_every_block_is_run_or_marked_with_a_reason`. Commands run with bash in a scratch
directory holding `scripts/` and `benchmarks/` (links to the repository's), with this checkout first on
`PYTHONPATH`, `python` this interpreter, no virtual devices unless the block sets them, and every cache in the
scratch directory. How a block is shrunk is written beside it in `BLOCKS` and done by `Shrink`: flags inserted right
after each `scripts/train_grpo.py` (the document's own flags come later and win) and text replacements, each of
which must find its text (so the documents and this table cannot drift apart silently).

The default run executes the set-up command (the main job at test size) and a look at its run directory, the test
command's options, the config file, the notebook example (at test size), the library imports, the published runs'
predictions and the SLURM and SSH recipes' flags; the rest (the other jobs, the planner, every benchmark at test
size) run with `-m slow`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted(path for path in (ROOT / "docs").rglob("*.md") if "_hooks" not in path.parts)]
# the jobs' persistent compilation cache, shared with tests/train/test_train_job.py (never the user's ~/.cache)
JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / "rpegjax-tests-jax-cache"
# the main job's model and rollout at test size (tests/train/test_train_job.py's TINY); --steps 2
# the model's heads split over tensor=2 (the multi-process blocks' meshes)
SPLITTABLE = "--model.num_heads=4 --model.num_kv_heads=2"
TINY = ("--model.hidden_size=32 --model.num_layers=1 --model.num_heads=2 --model.num_kv_heads=1 --model.head_dim=16 "
        "--model.intermediate_size=64 --data.train_size=64 --data.eval_size=4 --prompts-per-step=4 --group-size=2 "
        "--max-new-tokens=6 --rollout.num_slots=8 --warm-start-steps=2 --train.reward_workers=1 --steps=2 "
        "--checkpoint-every=2 --eval-every=0")
CACHES = f"--warm_start.cache_dir=warmstart --train.compilation_cache_dir={JAX_CACHE}"
MARK = re.compile(r"^<!-- not run: (?P<reason>.*\S.*) -->$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence
    language: str
    text: str
    not_run: str | None  # the reason of the mark above the fence, if any

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def document_blocks(path: pathlib.Path) -> list[Block]:
    blocks, lines, index = [], path.read_text().splitlines(), 0
    while index < len(lines):
        assert not re.match(r"^\s+```", lines[index]), \
            f"{path.relative_to(ROOT)}:{index + 1}: an indented fence (start fenced blocks at the line's start)"
        fence = re.match(r"^```(\w*)\s*$", lines[index])
        if fence is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        above = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        mark = MARK.match(above)
        blocks.append(Block(path, index + 1, fence.group(1), "\n".join(lines[index + 1: end]) + "\n",
                            mark.group("reason") if mark else None))
        index = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in DOCUMENTS for block in document_blocks(path)]


@dataclasses.dataclass(frozen=True)
class Shrink:
    """How a block is made small: `flags` inserted after every `scripts/train_grpo.py`, then `replace` (old, new)."""

    flags: str = ""
    replace: tuple[tuple[str, str], ...] = ()

    def apply(self, text: str) -> str:
        if self.flags:
            text = text.replace("scripts/train_grpo.py", f"scripts/train_grpo.py {self.flags}")
        for old, new in self.replace:
            assert old in text, f"the block no longer holds {old!r}: update tests/test_docs.py"
            text = text.replace(old, new)
        return text


@dataclasses.dataclass(frozen=True)
class Entry:
    """`run`: the test that runs the block, made small by `shrink`; `note`: what the test stands in for."""

    run: str
    shrink: Shrink = Shrink()
    note: str | None = None


BLOCKS: dict[str, Entry] = {
    # set-up (README, docs/index.md, docs/development.md)
    "pip install -e . && python scripts/train_grpo.py": Entry(
        run="test_setup_command_trains_the_main_job",
        shrink=Shrink(flags=f"{TINY} {CACHES}", replace=(("pip install -e . && ", ""),)),
        note="`pip install -e .` is checked against pyproject.toml and the installed distribution (no network)"),
    'pip install -e ".[test]" && python -m pytest': Entry(
        run="test_test_command_is_valid",
        note="the whole suite is not run inside itself: its options are checked by collecting one file with them"),
    # the README's tour
    "ls runs/grpo-*/": Entry(run="test_setup_command_trains_the_main_job"),
    "# accuracy and pass@1..8": Entry(
        run="test_the_tour_generates_from_the_run",
        shrink=Shrink(replace=(("runs/grpo-<time>", "run"),))),
    # the main job
    "train:\n  steps: 500": Entry(run="test_the_config_file_is_read"),
    # your own data and reward
    "def correct(completion: str, example: dict) -> float:\n    match": Entry(
        run="test_custom_reward_command", note="myreward.py: written to a file and used by the command below"),
    "--reward myreward:correct --reward myreward:concise=0.2": Entry(
        run="test_custom_reward_command",
        shrink=Shrink(flags=f"{TINY} {CACHES}",
                      replace=(("Qwen2.5-0.5B-Instruct/", "tiny-model/"),)),
        note="a tiny checkpoint and GSM8K-style files written by the test stand for Qwen2.5-0.5B and gsm8k/"),
    "rpegjax.GRPOTrainer(": Entry(
        run="test_notebook_example_trains_with_a_python_reward",
        shrink=Shrink(replace=(("steps=50, prompts_per_step=16, group_size=8, max_new_tokens=16,",
                                "steps=2, prompts_per_step=4, group_size=2, max_new_tokens=6, eval_every=0, overrides="
                                "{'model.hidden_size': 32, 'model.num_layers': 1, 'model.num_heads': 2, "
                                "'model.num_kv_heads': 1, 'model.head_dim': 16, 'model.intermediate_size': 64, "
                                "'data.eval_size': 4, 'rollout.num_slots': 8, 'train.export_hf': False, "
                                f"'train.compilation_cache_dir': {str(JAX_CACHE)!r}}},"),))),
    # tools
    "--env calculator --max-turns 3": Entry(
        run="test_calculator_commands",
        shrink=Shrink(flags=f"{TINY} {CACHES} --max-new-tokens=24",
                      replace=(("~/models/Qwen2.5-0.5B-Instruct", "tiny-model"),
                               ("--max-new-tokens 512", "--max-new-tokens 64 --rollout.max_prompt_len=160"))),
        note="the second command's checkpoint: a tiny one written by the test (its tags are several tokens there)"),
    # using the trained model
    "--dataset test.jsonl --out answers.jsonl": Entry(
        run="test_using_the_trained_model",
        shrink=Shrink(replace=(("runs/grpo-<time>", "run"), ("--step 100", "--step 2"),
                               ("--eval-size 200 --samples 8", "--eval-size 8 --samples 8 --max-new-tokens 8"))),
        note="run on a tiny run of the main job; test.jsonl written by the test"),
    # library
    "from rpegjax.models import ModelConfig, Decoder": Entry(run="test_library_imports"),
    'mesh = make_mesh({"fsdp": 4, "tensor": 2})': Entry(
        run="test_sharded_load_and_export_snippet",
        shrink=Shrink(replace=(('"Qwen2.5-0.5B"', '"tiny-model"'),)),
        note="a tiny checkpoint written by the test stands for Qwen2.5-0.5B; run on 8 virtual CPU devices"),
    # planner
    "--model qwen2.5-7b --hardware gh200 --gpus 256 --algo ppo": Entry(run="test_planner_command"),
    "--gpus 8 --dtype float32 $STEP --verify": Entry(
        run="test_dry_run_commands",
        note="a config.json of Qwen2.5-0.5B's shapes and a small tokenizer written by the test stand for the "
             "checkpoint (the dry run reads no weights)"),
    # many processes
    "for i in 0 1 2 3; do": Entry(
        run="test_multi_process_commands",
        shrink=Shrink(flags=f"{TINY} {CACHES} {SPLITTABLE}", replace=(("127.0.0.1:12355", "127.0.0.1:PORT"),))),
    "JAX_PROCESS_ID=0 python scripts/train_grpo.py --graph.mesh=data=2,tensor=2": Entry(
        run="test_multi_process_commands",
        shrink=Shrink(flags=f"{TINY} {CACHES} {SPLITTABLE}", replace=(("127.0.0.1:12355", "127.0.0.1:PORT"),))),
    "HOSTS=(10.0.0.1 10.0.0.1 10.0.0.2 10.0.0.2)": Entry(run="test_ssh_recipe_parses"),
    "#SBATCH --job-name=rpegjax-grpo": Entry(run="test_slurm_script_parses"),
    # benchmarks: every workload's command at test size
    "python benchmarks/bench_grpo_step.py --steps 5 --warmup 2": Entry(
        run="test_w_small_benchmark",
        shrink=Shrink(replace=(("--steps 5 --warmup 2", "--steps 1 --warmup 1 --graphs 'sync unfused'"),))),
    "python benchmarks/bench_generate.py --skip-long-tail": Entry(
        run="test_w_gen_benchmarks",
        shrink=Shrink(replace=(
            ("--skip-long-tail --runs 3 --baseline-runs 2 --transformers-runs-long 2",
             "--skip-long-tail --new-tokens 8 --runs 1 --baseline-runs 1 --transformers-runs-long 0"),
            ("--windows 128 288 --runs 11", "--windows 64 --runs 1")))),
    "python benchmarks/bench_memory.py --models 7b --tokens 16384 --layouts fsdp8,fsdp4xtp2sp": Entry(
        run="test_w_long_cpu_benchmarks",
        shrink=Shrink(replace=(("--models 7b --tokens 16384", "--models 0.5b --tokens 512 --layers 1"),
                               ("bench_generate_memory.py", "bench_generate_memory.py --layers 1 --slots 8 --prompt 64 "
                                                            "--mean 64 --max-response 256"))),
        note="0.5B's shapes cut to one layer and 512-token rows stand for 7B's at 16k"),
    "python benchmarks/bench_generate.py --skip-wgen": Entry(
        run="test_w_tail_benchmarks",
        shrink=Shrink(replace=(
            ("--long-tail-prompts 128 --long-tail-mean 32", "--long-tail-prompts 16 --long-tail-mean 8"),
            ("--long-tail-chunk-steps 8 16", "--long-tail-chunk-steps 8"),
            ("bench_live_decode.py --runs 3", "bench_live_decode.py --runs 1 --mean 8 --shapes queue"),
            ("--mean 32 --pack-tokens 1024 --warmup-rounds 1", "--mean 8 --pack-tokens 256 --warmup-rounds 1"),
            ("--warmup-steps 6 --skip 2 --rounds 2 --steps 10", "--warmup-steps 1 --skip 1 --rounds 1 --steps 1"),
            ("--modes plain plain-no-tail recompute pages recompute-inflight pages-inflight",
             "--modes plain pages-inflight")))),
    "python scripts/plan.py --model qwen2.5-7b --hardware gh200 --gpus 256 --reference --top 0": Entry(
        run="test_w_plan_prediction", shrink=Shrink(replace=(("--gpus 256", "--gpus 16"),)),
        note="16 GH200 stand for W-plan's 256: the same search, a smaller space"),
    "python -c \"from rpegjax.perf.reference import published_runs as v;": Entry(run="test_published_runs_are_predicted"),
    "python benchmarks/bench_perfmodel.py --rounds 2 --steps 3 --warmup 1": Entry(
        run="test_perf_model_benchmark",
        shrink=Shrink(replace=(("--rounds 2 --steps 3 --warmup 1",
                                "--rounds 1 --steps 1 --warmup 1 --only 'tiny grpo'"),))),
    "python scripts/train_grpo.py --run-dir runs/default": Entry(
        run="test_main_job_commands", shrink=Shrink(flags=f"{TINY} {CACHES}")),
}


def entry_blocks() -> dict[str, Block]:
    found = {}
    for key in BLOCKS:
        matches = [block for block in all_blocks() if key in block.text]
        assert matches, f"BLOCKS key {key!r} matches no block of README.md or docs/: update tests/test_docs.py"
        assert len({block.text for block in matches}) == 1, \
            f"BLOCKS key {key!r} matches different blocks ({[b.where for b in matches]}): make it match one text"
        found[key] = matches[0]
    return found


def block_text(key: str) -> str:
    return BLOCKS[key].shrink.apply(entry_blocks()[key].text)


def test_every_block_is_run_or_marked_with_a_reason():
    run = {block.text for block in entry_blocks().values()}
    missing = [f"{block.where}: {block.text.splitlines()[0][:60]!r}" for block in all_blocks()
               if block.text not in run and block.not_run is None]
    assert not missing, f"blocks neither run by tests/test_docs.py BLOCKS nor marked <!-- not run: REASON -->: " \
                        f"{missing}"
    names = {name for name in globals() if name.startswith("test_")}
    for key, entry in BLOCKS.items():
        assert entry.run in names, f"{key!r}: no test {entry.run}"


# ------------------------------------------------------------------------------------------------ running


def scratch(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory to run documented commands in: `scripts/` and `benchmarks/` linked, `python` on PATH this
    interpreter."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    return tmp_path


def environment(directory: pathlib.Path, devices: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith("JAX_")}
    env.update(PATH=f"{directory / '.bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XDG_CACHE_HOME=str(directory / ".cache"), TOKENIZERS_PARALLELISM="false")
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def run_bash(text: str, directory: pathlib.Path, *, timeout: float = 600, devices: int | None = None):
    script = directory / "block.sh"
    script.write_text("set -e\n" + text)
    return subprocess.run(["bash", str(script)], cwd=directory, env=environment(directory, devices),
                          capture_output=True, text=True, timeout=timeout)


def run_python(text: str, directory: pathlib.Path, *, timeout: float = 600, devices: int | None = None):
    return subprocess.run([sys.executable, "-c", text], cwd=directory, env=environment(directory, devices),
                          capture_output=True, text=True, timeout=timeout)


def summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def write_tiny_checkpoint(directory: pathlib.Path) -> pathlib.Path:
    """A random 2-layer Hugging Face checkpoint with the built-in character tokenizer (its dims split over 8
    devices)."""
    from flax import nnx

    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.models.hf import save_pretrained
    from rpegjax.models.tokenizer import builtin_tokenizer
    from rpegjax.train.export import write_char_tokenizer

    tokenizer = builtin_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=-(-tokenizer.vocab_size // 8) * 8, eos_token_id=tokenizer.eos_id)
    tokens = directory / "tokenizer-files"
    tokens.mkdir(parents=True)
    write_char_tokenizer(tokens)
    return save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, directory / "tiny-model", tokenizer_dir=tokens)


# ------------------------------------------------------------------------- the default run (and the planner)


def test_setup_command_trains_the_main_job(tmp_path):
    import importlib.metadata
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "rpegjax" and importlib.metadata.distribution("rpegjax").version == project["version"]
    directory = scratch(tmp_path)
    result = run_bash(block_text("pip install -e . && python scripts/train_grpo.py"), directory)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (directory / "runs").iterdir()
    assert summary(result.stdout)["steps"] == 2 and pathlib.Path(summary(result.stdout)["run_dir"]) == \
        run_dir.relative_to(directory)
    assert (run_dir / "hf" / "model.safetensors").is_file() and (run_dir / "gantt.png").is_file()
    # the tour's look at the run directory: the listing, and the final evaluation as the last metrics record
    look = run_bash(block_text("ls runs/grpo-*/"), directory)
    assert look.returncode == 0, look.stderr[-3000:]
    listed, last = look.stdout.splitlines()[:-1], look.stdout.splitlines()[-1]
    assert {"config.json", "metrics.jsonl", "samples.jsonl", "hf", "checkpoints"} <= set(listed)
    assert "eval/accuracy" in json.loads(last)


def test_test_command_is_valid(tmp_path):
    command = block_text('pip install -e ".[test]" && python -m pytest').split("&& ", 1)[1].strip()
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("pytest-xdist") for requirement in extras["test"])
    result = subprocess.run([*command.replace("python", sys.executable, 1).split(), "--collect-only",
                             "tests/test_layout.py"], cwd=ROOT, env=environment(tmp_path), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_config_file_is_read(tmp_path):
    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.cli import parse_command

    path = tmp_path / "run.yaml"
    path.write_text(block_text("train:\n  steps: 500"))
    config = parse_command([f"--config={path}"], Algorithm.GRPO).config
    assert (config.train.steps, config.train.eval_every, config.rollout.group_size) == (500, 25, 16)
    assert config.grpo.optimizer.learning_rate == 5e-5 and config.grpo.group_size == 16


def test_notebook_example_trains_with_a_python_reward(tmp_path):
    """README's notebook example as a script (its reward is then defined in __main__, as in a notebook): it runs
    in this process, says so, and is what the run was scored on."""
    directory = scratch(tmp_path)
    result = run_python(block_text("rpegjax.GRPOTrainer("), directory)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, start, end, reward = result.stdout.split()[-4:]
    assert "reward: __main__:correct, in threads of this process" in result.stdout + result.stderr
    records = [json.loads(line) for line in (directory / run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and float(reward) == records[-2]["reward"]
    assert float(start) == records[0]["eval/accuracy"] and float(end) == records[-1]["eval/accuracy"]
    assert (directory / run_dir / "data" / "dataset.jsonl").read_text().startswith('{"prompt": "Q:10+10\\n"')


def test_library_imports(tmp_path):
    result = run_python(block_text("from rpegjax.models import ModelConfig, Decoder"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow  # planner search over 256 GPUs: 1.5-4 min on 2 cores at load ~18
def test_planner_command(tmp_path):
    result = run_bash(block_text("--model qwen2.5-7b --hardware gh200 --gpus 256 --algo ppo"), scratch(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best" in result.stdout and "verl-like" in result.stdout


# ------------------------------------------------------------------------------------------------ slow


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.mark.slow
def test_sharded_load_and_export_snippet(tmp_path, tiny_checkpoint):
    directory = scratch(tmp_path)
    (directory / "tiny-model").symlink_to(tiny_checkpoint)
    code = block_text("from rpegjax.models import ModelConfig, Decoder") + block_text(
        'mesh = make_mesh({"fsdp": 4, "tensor": 2})')
    result = run_python(code, directory, devices=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (directory / "export" / "config.json").is_file() and list((directory / "export").glob("*.safetensors"))


@pytest.mark.slow
def test_custom_reward_command(tmp_path, tiny_checkpoint):
    directory = scratch(tmp_path)
    (directory / "myreward.py").write_text(entry_blocks()["def correct(completion: str, example: dict) -> float:\n"
                                                          "    match"].text)
    (directory / "tiny-model").symlink_to(tiny_checkpoint)
    for split, numbers in (("train", range(30)), ("test", range(30, 40))):
        (directory / "gsm8k").mkdir(exist_ok=True)
        (directory / "gsm8k" / split).write_text("".join(
            json.dumps({"question": f"{a}+{a}=", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"}) + "\n" for a in numbers))
    result = run_bash(block_text("--reward myreward:correct --reward myreward:concise=0.2"), directory)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "myreward:correct + myreward:concise" in result.stderr and summary(result.stdout)["steps"] == 2


@pytest.mark.slow
def test_calculator_commands(tmp_path, tiny_checkpoint):
    directory = scratch(tmp_path)
    (directory / "tiny-model").symlink_to(tiny_checkpoint)
    result = run_bash(block_text("--env calculator --max-turns 3"), directory, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("rollouts: multi-turn with the calculator tool") == 2
    assert "supervised steps on worked episodes that call the calculator" in result.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The main job at test size, as the README's first command runs it, in a directory named `run`."""
    directory = scratch(tmp_path_factory.mktemp("trained"))
    text = block_text("pip install -e . && python scripts/train_grpo.py").replace(
        "scripts/train_grpo.py", "scripts/train_grpo.py --run-dir=run", 1)
    result = run_bash(text, directory)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


@pytest.mark.slow
def test_the_tour_generates_from_the_run(tiny_run):
    result = run_bash(block_text("# accuracy and pass@1..8"), tiny_run)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(line["prompt"], line["sample"]) for line in lines[:4]] == [("Q:12+30\n", i) for i in range(4)]
    assert "pass@8" in lines[-1]


@pytest.mark.slow
def test_using_the_trained_model(tiny_run):
    (tiny_run / "test.jsonl").write_text("".join(json.dumps({"prompt": f"Q:{a}+1\n", "answer": str(a + 1)}) + "\n"
                                                 for a in range(10, 14)))
    result = run_bash(block_text("--dataset test.jsonl --out answers.jsonl"), tiny_run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tiny_run / "answers.jsonl").is_file() and (tiny_run / "step100" / "config.json").is_file()
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line.get("problems") for line in lines[:3]] == [4, 8, 4] and "pass@8" in lines[1]
    assert [(line["prompt"], line["sample"]) for line in lines[3:]] == [("Q:12+30\n", i) for i in range(4)]


@pytest.mark.slow
def test_dry_run_commands(tmp_path):
    from rpegjax.models.config import ModelConfig
    from rpegjax.train.export import write_char_tokenizer

    directory = scratch(tmp_path)
    checkpoint = directory / "Qwen2.5-0.5B-Instruct"
    checkpoint.mkdir()
    write_char_tokenizer(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(ModelConfig.qwen2p5("0.5b").to_hf_dict()))
    result = run_bash(block_text("--gpus 8 --dtype float32 $STEP --verify"), directory, timeout=2400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("fits: yes") + result.stderr.count("fits: yes") == 2  # plan.py --verify, the job's


@pytest.mark.slow
def test_multi_process_commands(tmp_path):
    import socket

    for index, key in enumerate(("for i in 0 1 2 3; do",
                                 "JAX_PROCESS_ID=0 python scripts/train_grpo.py --graph.mesh=data=2,tensor=2")):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        (tmp_path / f"block{index}").mkdir()
        directory = scratch(tmp_path / f"block{index}")
        result = run_bash(block_text(key).replace("PORT", str(port)), directory, timeout=1200)
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(result.stdout)["steps"] == 2


def test_slurm_script_parses():
    text = entry_blocks()["#SBATCH --job-name=rpegjax-grpo"].text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    command = text[text.index("python scripts/train_grpo.py"):].replace("\\\n", " ").split()
    flags = [flag for flag in command[2:] if not flag.startswith("--model.path")]
    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.cli import parse_command

    config = parse_command([*flags, "--print-config"], Algorithm.GRPO).config
    assert config.graph.mesh == "data=-1,fsdp=8,tensor=4" and config.train.run_dir == "/shared/runs/grpo-7b"


def test_ssh_recipe_parses():
    """The SSH recipe: valid bash; process i's variables name the coordinator, the count, its rank and its GPU; the
    job's flags parse."""
    from rpegjax.distributed import DistributedConfig
    from rpegjax.graph.ir import Algorithm
    from rpegjax.train.cli import parse_command

    text = entry_blocks()["HOSTS=(10.0.0.1 10.0.0.1 10.0.0.2 10.0.0.2)"].text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    hosts = re.search(r"HOSTS=\(([^)]*)\)", text).group(1).split()
    remote = text[text.index('"cd '):text.rindex('" &')].replace("\\\n", " ")
    for rank in range(len(hosts)):
        words = remote.replace("${HOSTS[0]}", hosts[0]).replace("$((i % 2))", str(rank % 2)).replace("$i", str(rank))
        env = dict(word.split("=", 1) for word in words.split() if re.fullmatch(r"[A-Z_]+=\S+", word))
        cfg = DistributedConfig.from_env(env)
        assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.local_device_ids) == (
            "10.0.0.1:12355", 4, rank, (rank % 2,))
    flags = remote[remote.index("scripts/train_grpo.py") + len("scripts/train_grpo.py"):].split()
    config = parse_command(flags, Algorithm.GRPO).config
    assert config.distributed.port_range == "50000-50100" and config.graph.rollout_devices == 2


# ------------------------------------------------------------------------------------ benchmarks (test size)


def test_published_runs_are_predicted(tmp_path):
    """The published runs' predictions, one line per run: its name, the measured and the predicted seconds."""
    block = block_text("python -c \"from rpegjax.perf.reference import published_runs as v;")
    result = run_bash(block, scratch(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    from rpegjax.perf.reference import published_runs

    runs = published_runs.NEMO_RL_RUNS + published_runs.GB200_RUNS + published_runs.MOE_RUNS
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(runs) and all(line.startswith(run.name) for line, run in zip(lines, runs))
    assert all(float(line.split()[-1]) > 0 for line in lines)


@pytest.mark.slow
def test_w_small_benchmark(tmp_path):
    result = run_bash(block_text("python benchmarks/bench_grpo_step.py --steps 5 --warmup 2"), scratch(tmp_path),
                      timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "sync unfused" in result.stdout


@pytest.mark.slow
def test_w_gen_benchmarks(tmp_path):
    result = run_bash(block_text("python benchmarks/bench_generate.py --skip-long-tail"), scratch(tmp_path),
                      timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_w_long_cpu_benchmarks(tmp_path):
    result = run_bash(block_text("python benchmarks/bench_memory.py --models 7b --tokens 16384 --layouts "
                                 "fsdp8,fsdp4xtp2sp"), scratch(tmp_path), timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_w_tail_benchmarks(tmp_path):
    result = run_bash(block_text("python benchmarks/bench_generate.py --skip-wgen"), scratch(tmp_path), timeout=2400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_w_plan_prediction(tmp_path):
    result = run_bash(block_text("python scripts/plan.py --model qwen2.5-7b --hardware gh200 --gpus 256 --reference "
                                 "--top 0"), scratch(tmp_path), timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "best" in result.stdout and "verl-like" in result.stdout and "ReaL-like" in result.stdout


@pytest.mark.slow
def test_perf_model_benchmark(tmp_path):
    result = run_bash(block_text("python benchmarks/bench_perfmodel.py --rounds 2 --steps 3 --warmup 1"),
                      scratch(tmp_path), timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "tiny grpo" in result.stdout


@pytest.mark.slow
def test_main_job_commands(tmp_path):
    """The main job's two documented runs at test size: the default and partial rollouts with their seeds."""
    directory = scratch(tmp_path)
    result = run_bash(block_text("python scripts/train_grpo.py --run-dir runs/default"), directory, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    for run in ("default", "partial"):
        records = [json.loads(line) for line in (directory / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [1, 2]
    config = json.loads((directory / "runs" / "partial" / "config.json").read_text())
    assert config["rollout"]["partial"] is True and config["train"]["seed"] == 1 and config["data"]["seed"] == 1
