"""The main job fine-tunes a Qwen3-MoE checkpoint that transformers wrote (`--model DIR`), end to end on the CPU."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from hf_parity import assert_final_hf_logit_parity
from test_train_job import TINY, run_job

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _write_checkpoint(model_dir: pathlib.Path) -> list[str]:
    """A random 2-layer Qwen3-MoE (4 experts, top 2; layer 1 dense) with a digit tokenizer; returns the vocabulary."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=")}}
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64, tie_word_embeddings=False,
        eos_token_id=1, pad_token_id=0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    return list(vocab)


@pytest.mark.slow  # ~4 minutes of compilation on a loaded 2-core machine
def test_job_trains_a_transformers_written_qwen3_moe_checkpoint(tmp_path):
    model_dir = tmp_path / "model"
    _write_checkpoint(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    run_dir = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts" / "train_grpo.py"), f"--model={model_dir}", f"--dataset={data}",
               "--steps=2", f"--run-dir={run_dir}", "--prompts-per-step=4", "--group-size=2", "--max-new-tokens=4",
               "--data.eval_size=8", "--mesh=data=1", "--train.reward_workers=1", "--checkpoint-every=2",
               "--grpo.router_aux_loss_coef=0.01", "--grpo.router_z_loss_coef=0.001"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:  # the router terms and the expert load are logged every step
        assert record["moe/load_balance"] > 0 and record["moe/router_z"] > 0
        assert record["moe/tokens_per_expert_max"] >= record["moe/tokens_per_expert_mean"] > 0
    exported = json.loads((run_dir / "hf" / "config.json").read_text())
    assert exported["model_type"] == "qwen3_moe" and exported["mlp_only_layers"] == [1]
    assert_final_hf_logit_parity(run_dir, [[2, 3, 12, 4, 13], [5, 5, 12, 9, 13, 3]], step=2)


def test_router_options_the_run_cannot_honour_are_refused():
    import dataclasses

    from rpegjax.models import Architecture, ModelConfig
    from rpegjax.train.build import check_router_options
    from rpegjax.train.config import RunConfig

    base = RunConfig()
    moe, dense = ModelConfig.tiny(Architecture.QWEN3_MOE), ModelConfig.tiny()

    def run(**changes) -> RunConfig:
        return dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, **changes))

    check_router_options(run(router_aux_loss_coef=0.01, router_z_loss_coef=0.001), moe)
    check_router_options(run(), dense)
    check_router_options(run(router_replay=True), moe)  # the samplers record the routing the learner replays
    with pytest.raises(ValueError, match=r"grpo.router_replay: the model has no experts"):
        check_router_options(run(router_replay=True), dense)
    partial = dataclasses.replace(run(router_replay=True), rollout=dataclasses.replace(base.rollout, partial=True))
    with pytest.raises(ValueError, match=r"grpo.router_replay: partial rollouts"):
        check_router_options(partial, moe)
    with pytest.raises(ValueError, match=r"grpo.router_aux_loss_coef=0.01: the model has no experts"):
        check_router_options(run(router_aux_loss_coef=0.01), dense)


MOE = ["--model.num_experts=4", "--model.num_experts_per_token=2", "--model.moe_intermediate_size=32",
       "--warm-start-steps=0", "--grpo.router_aux_loss_coef=0.01"]


@pytest.mark.slow  # two 4-device jobs, ~3 minutes each on a loaded 2-core machine
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_job_with_expert_parallelism_matches_the_data_parallel_run(tmp_path, capacity):
    """The built-in MoE model trained over data=2 x expert=2 (experts split, all-to-all dispatch) takes the same
    first step as over data=4 (every device holds every expert): the same rollout, loss and router terms."""
    capped = [] if capacity is None else [f"--model.moe_capacity_factor={capacity}"]
    runs = {}
    for mesh in ("data=4", "data=2,expert=2"):
        run_dir = tmp_path / mesh.replace(",", "_").replace("=", "")
        result = run_job(run_dir, "--steps=2", *MOE, *capped, f"--mesh={mesh}", config=TINY[:-1], devices=4,
                         timeout=1500)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[mesh] = [r for r in records if "loss" in r]
    data, expert = runs["data=4"], runs["data=2,expert=2"]
    assert [r["step"] for r in expert] == [1, 2]
    first, other = data[0], expert[0]
    assert first["reward"] == other["reward"]  # the same rollout (the sampler's layout is the same)
    for name in ("loss", "advantage/reward_std", "moe/load_balance", "moe/router_z", "moe/tokens_per_expert_max",
                 "moe/dropped_tokens"):
        assert other[name] == pytest.approx(first[name], rel=1e-4, abs=1e-6), name
    if capacity is not None:
        assert "moe/dropped_fraction" in other


@pytest.mark.slow  # a 4-device job, ~6 minutes on a loaded 2-core machine
def test_disaggregated_job_generates_with_the_experts_split(tmp_path):
    """Generation on its own 2 devices with expert=2 (the sampler holds 2 of the 4 experts per device), training on
    the other 2 with expert=2: the job runs its steps and logs the router terms."""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, "--steps=2", *MOE, "--mesh=expert=2", "--graph.rollout_devices=2",
                     "--graph.rollout_mesh=expert=2", config=TINY[:-1], devices=4, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["moe/load_balance"] > 0 for r in steps)


def test_the_plans_capacity_factor_is_what_the_model_runs():
    """`Execution.moe_capacity_factor` is the run's experts' mode: a job without a plan takes the model section's
    (`run_execution`), and placing the models applies the plan's (`apply_execution`, as the runtime and the dry
    run do) to the same parameters; a dense model refuses a factor. (What the capacity mode computes:
    tests/models/test_expert_parallel.py; that the dry run compiles it: tests/train/test_dry_run.py.)"""
    import dataclasses

    import jax
    from flax import nnx

    from rpegjax.graph.ir import Execution
    from rpegjax.models import Architecture, ModelConfig
    from rpegjax.models.transformer import Decoder
    from rpegjax.runtime.assembly import apply_execution
    from rpegjax.train.build import run_execution
    from rpegjax.train.config import RunConfig

    base = RunConfig()
    capped = dataclasses.replace(base, model=dataclasses.replace(base.model, num_experts=4, moe_capacity_factor=1.25))
    assert run_execution(capped).moe_capacity_factor == 1.25 and run_execution(base).moe_capacity_factor is None
    model = nnx.eval_shape(lambda: Decoder(ModelConfig.tiny(Architecture.QWEN3_MOE), rngs=nnx.Rngs(0)))
    planned = apply_execution(model, Execution(moe_capacity_factor=0.5))
    assert planned.cfg.moe_capacity_factor == 0.5 and model.cfg.moe_capacity_factor is None
    assert jax.tree.structure(nnx.state(planned)) == jax.tree.structure(nnx.state(model))
    assert apply_execution(planned, Execution(moe_capacity_factor=0.5)) is planned  # already so: unchanged
    dense = nnx.eval_shape(lambda: Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="moe_capacity_factor=0.5 needs architecture qwen3_moe"):
        apply_execution(dense, Execution(moe_capacity_factor=0.5))
