"""The dry run: every stage program of a plan compiled with abstract inputs, measured, refused when too big."""

import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from flax import nnx

from rpegjax.graph import builders
from rpegjax.graph.ir import Execution
from rpegjax.learners import GRPOConfig
from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.models.lora import LoRAConfig, LoRAParam
from rpegjax.train.dry_run import Batch, compile_programs, dry_run, lower_plan, run_plan

ROOT = pathlib.Path(__file__).parents[2]
CFG = ModelConfig.tiny(vocab_size=256)


def _graph(parallel, *, use_reference=True):
    graph = builders.grpo_graph(use_reference=use_reference, num_devices=4, parallel=parallel)
    return dataclasses.replace(graph, execution=Execution(attention="blockwise", attention_block_size=16, remat="full",
                                                          scan_layers=True))


@pytest.mark.slow
def test_dry_run_measures_every_stage_program_and_refuses_what_does_not_fit():
    """~30 s on an idle machine (4 programs compiled on 4 virtual devices)."""
    assert jax.device_count() >= 4
    graph = _graph({"fsdp": 2, "tensor": 2})
    batch = Batch(rows=8, prompt=16, new=48, slots=8, group_size=4)
    report = dry_run(graph, CFG, GRPOConfig(group_size=4, kl_coef=0.04), batch, capacity_bytes=1e9)
    assert [(p.stage, p.program.split(" ")[0]) for p in report.programs] == [
        ("ref_logprob", "inference"), ("old_logprob", "inference"), ("actor_update", "update"),
        ("weight_sync", "weight"), ("generate", "prefill"), ("generate", "decode")]
    assert report.fits and report.refusal() is None
    update = report.programs[2]
    # the update's arguments hold the training state's shard (float32 weights + two AdamW moments, split 4 ways
    # by fsdp x tensor; norms and biases replicate, so a little more) and the batch
    state = 3 * 4 * CFG.num_params() / 4
    assert state <= update.arguments <= 1.5 * state + 8 * 64 * 16
    assert update.aliased > 0  # the state is donated
    assert update.flops.flops > 0 and update.temporaries > 0
    # beside the update: the reference weights (float32, fsdp x tensor) and the generation copy (tensor only:
    # generation spreads slots over every other axis)
    assert update.resident == pytest.approx(4 * CFG.num_params() / 4 + 4 * CFG.num_params() / 2, rel=0.1)
    for program in report.programs:
        assert program.peak == pytest.approx(program.program_bytes + program.resident)
    small = dataclasses.replace(report, capacity_bytes=update.peak * 0.99)
    assert not small.fits
    assert "stage 'actor_update' (update) needs" in small.refusal() and "GB per device" in small.refusal()
    assert "NO" in small.table()


def test_dry_run_of_a_lora_run_compiles_the_runtime_programs_with_the_frozen_base():
    """Runs by default: the dry run lowers the learners' own programs, whose signature LoRA changed once without the
    (slow) tests above noticing, so every program of the step is lowered. Compiled, only what is measured (2 programs,
    not 12: this test took ~4 min loaded when it compiled a LoRA and a plain run whole): the update's arguments hold
    the adapters' state and the frozen base (float32, split 4 ways); the reference reads the base itself (no copy)."""
    graph = _graph({"fsdp": 2, "tensor": 2})
    batch = Batch(rows=8, prompt=16, new=48, slots=8, group_size=4)
    lora = LoRAConfig(rank=4)
    lowered = lower_plan(graph, CFG, GRPOConfig(group_size=4, kl_coef=0.04), batch, lora=lora)
    assert [p.stage for p in lowered] == ["ref_logprob", "old_logprob", "actor_update", "weight_sync", "generate",
                                          "generate"]
    reference, update = compile_programs([lowered[0], lowered[2]], capacity_bytes=1e9).programs
    base = 4 * CFG.num_params() / 4
    adapters = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: Decoder(CFG, rngs=nnx.Rngs(0), lora=lora)), LoRAParam)))
    bound = 1.5 * base + 3 * 4 * adapters + 8 * 64 * 16
    assert base <= update.arguments <= bound
    # no Adam moments of the base weights: a plain run's update holds weights and two moments, >= 3 x base (it used
    # to be compiled here to compare: ~100 s loaded), which this bound leaves no room for
    assert bound < 3 * base
    assert base <= reference.arguments <= 1.5 * base + 8 * 64 * 16


@pytest.mark.slow
def test_train_cli_dry_run_refuses_before_anything_starts(tmp_path):
    """~1 min: the job CLI re-runs itself on the plan's devices, compiles, prints the table and exits 3."""
    plan = tmp_path / "plan.json"
    plan.write_text(_graph({"data": 1, "fsdp": 4}, use_reference=False).to_json())  # the job's default: no KL
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_grpo.py"), "--dry-run", "--memory-gb", "0.001", "--plan", str(plan),
         "--run-dir", str(tmp_path / "run"), "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "16",
         "--warm-start-steps", "0"],
        check=False, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "re-running on 4 virtual CPU devices" in result.stderr
    assert "does not fit: stage" in result.stderr and "| actor_update | update | f4 |" in result.stdout
    assert not (tmp_path / "run").exists()  # nothing started


def _fingerprint(module_text: str) -> str:
    return hashlib.sha256(module_text.encode()).hexdigest()


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_the_dry_run_lowers_the_very_programs_a_run_launches(kv_cache, tmp_path):
    """A real one-step run of a small job records every program it compiles (JAX's StableHLO dumps); the dry run
    of the same config lowers its programs through their owners. Each program the dry run lowers (update,
    inference stages, weight sync, generation's prefill and decode chunk; paged: prefill, start, decode) is one the
    run launched: the same module, byte for byte. Before the dry run lowered through the owners its log-prob
    programs were its own (no micro-batching, no padding) and prefill was not checked at all."""
    from rpegjax.data.iterator import DataIterator
    from rpegjax.rewards.runner import RewardRunner, RewardRunnerConfig
    from rpegjax.runtime import Runtime
    from rpegjax.train.build import build
    from rpegjax.train.config import (DataSection, ModelSection, RolloutSection, RunConfig, TrainSection,
                                      WarmStartSection)
    from rpegjax.train.trainer import make_programs

    # prompts sized from the data (the arithmetic task's are 8 tokens: the longest is the prefill the dry run
    # lowers); capacity 8 + 8 <= the sampler's window step: every decode chunk attends to the whole capacity, as the
    # dry run's decode does; 8 prompts fill the 16 slots in one prefill, as the dry run's prefill does; pages longer
    # than any prompt: every later sample of a group copies its prompt's partial page, as the dry run's start does
    cfg = RunConfig(
        model=ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64),
        data=DataSection(train_size=16, eval_size=4),
        rollout=RolloutSection(prompts_per_step=8, group_size=2, max_new_tokens=8, num_slots=16,
                               chunk_steps=4, kv_cache=kv_cache, page_size=16),
        warm_start=WarmStartSection(steps=0), train=TrainSection(steps=1, reward_workers=1),
    ).replace(grpo=dataclasses.replace(RunConfig().grpo, kl_coef=0.04))
    dumps = tmp_path / "run"
    jax.config.update("jax_include_debug_info_in_dumps", False)
    jax.config.update("jax_dump_ir_to", str(dumps))
    try:
        parts = build(cfg, log=lambda _: None)
        rewards = RewardRunner(parts.task.reward, RewardRunnerConfig(timeout_s=5.0, workers=1,
                                                                     isolation=parts.task.isolation))
        programs = make_programs(parts, rewards)
        data = DataIterator(parts.train_examples, batch_size=cfg.rollout.prompts_per_step, seed=0)
        Runtime(parts.graph, programs, data, prompt_ids=parts.prompt_ids, key=jax.random.key(0)).run(
            parts.learner.init_state(), start_step=0, num_steps=1, on_step=lambda result, _: None)
        rewards.close()
    finally:
        jax.config.update("jax_dump_ir_to", "")
    launched = {_fingerprint(path.read_text()): path.name for path in dumps.glob("*.mlir")}
    lowered = run_plan(cfg).lower()
    expected = {"inference", "update", "weight sync", "prefill", "decode"} | ({"start"} if kv_cache == "paged" else set())
    assert {program.program.split(" (")[0] for program in lowered} == expected
    for program in lowered:
        found = launched.get(_fingerprint(program.lowered.as_text()))
        assert found is not None, (program.stage, program.program, sorted(launched.values()))


def test_the_dry_run_of_partial_rollouts_lowers_the_carried_sequences_prefill():
    """A carried sample continues as a one-sample request of prompt + prefix, up to the capacity: the dry run of a
    run with partial rollouts lowers that prefill (all 16 slots' rows, 16 = 8 prompt + 8 new tokens wide) beside
    the groups' own (8 groups of 2, 8 wide), and the sampler holds both batches in flight (16 slots, not 8)."""
    from rpegjax.train.config import (DataSection, ModelSection, RolloutSection, RunConfig, TrainSection,
                                      WarmStartSection)

    cfg = RunConfig(
        model=ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64),
        data=DataSection(train_size=16, eval_size=4),
        rollout=RolloutSection(prompts_per_step=4, group_size=2, max_new_tokens=8, num_slots=64, chunk_steps=4,
                               partial=True),
        warm_start=WarmStartSection(steps=0), train=TrainSection(steps=1, reward_workers=1))
    plan = run_plan(cfg)
    assert plan.graph.execution.partial_rollouts and plan.batch.slots == 16
    generation = {p.program.split(" (16 slots")[0]: p.lowered.as_text() for p in plan.lower() if p.stage == "generate"}
    assert set(generation) == {"prefill", "prefill (carried sequences)", "decode"}
    assert "tensor<16x16xi32>" in generation["prefill (carried sequences)"]
    assert "tensor<8x8xi32>" in generation["prefill"]


def test_the_dry_run_of_kept_pages_lowers_the_retag_and_counts_the_pool_beside_training():
    """carry=pages: the dry run lowers the program that gives kept rows their new PRNG streams, and the kept pool
    (the sampler's decode state) stays beside the training programs: their resident bytes grow by its size."""
    from rpegjax.train.config import (DataSection, ModelSection, RolloutSection, RunConfig, TrainSection,
                                      WarmStartSection)

    def lowered(**rollout):
        cfg = RunConfig(
            model=ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                               intermediate_size=64),
            data=DataSection(train_size=16, eval_size=4),
            rollout=RolloutSection(prompts_per_step=4, group_size=2, max_new_tokens=8, num_slots=64, chunk_steps=4,
                                   partial=True, kv_cache="paged", **rollout),
            warm_start=WarmStartSection(steps=0), train=TrainSection(steps=1, reward_workers=1))
        return run_plan(cfg).lower()

    recompute, pages = lowered(), lowered(partial_carry="pages")
    assert not any("retag" in p.program for p in recompute)
    retag = [p for p in pages if p.program == "retag (kept sequences)"]
    assert len(retag) == 1 and retag[0].stage == "generate"
    update = {p.program: p.resident for p in recompute if p.program == "update"}
    grown = {p.program: p.resident for p in pages if p.program == "update"}
    state = retag[0].lowered.compile().memory_analysis().argument_size_in_bytes  # the state and 3 small arrays
    assert 0 < grown["update"] - update["update"] <= state


def _plan_document(tmp_path, graph, model: ModelConfig, **workload) -> pathlib.Path:
    from rpegjax.train.plan_document import model_shape

    document = {"model": "qwen2.5-7b", "model_config": model_shape(model),
                "workload": {"prompts": 512, "group_size": 8, "prompt_tokens": 1024, "response_max": 16384, **workload},
                "plans": [{"name": "best", "graph": graph.to_dict(), "prediction": {"step_seconds": 211.0, "stages": []}}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    return path


def test_a_plan_made_for_another_model_or_step_is_refused_by_the_job_and_its_dry_run(tmp_path, capsys):
    """`train_grpo.py --plan plan.json --dry-run` once compiled the built-in 0.4M model at the run's short shapes for
    a 7B plan and printed "fits: yes" beside a 63.5 GB prediction; it is refused, naming what differs."""
    from rpegjax.train.cli import main
    from rpegjax.train.config import RunConfig

    graph = builders.grpo_graph(use_reference=False, num_devices=4, parallel={"fsdp": 4})
    graph = dataclasses.replace(graph, execution=Execution(param_dtype="float32", dtype="bfloat16"))
    plan = _plan_document(tmp_path, graph, ModelConfig.qwen2p5("7b"))
    code = main(["--dry-run", "--plan", str(plan), "--memory-gb", "80", "--run-dir", str(tmp_path / "run")],
                RunConfig().algorithm)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the plan was made for model 'qwen2.5-7b', this run's model differs" in err
    assert "model.hidden_size: plan 3584" in err and "--model DIR" in err
    assert not (tmp_path / "run").exists()

    from rpegjax.train.build import check_plan_shapes, run_model_config
    from rpegjax.models.tokenizer import builtin_tokenizer

    cfg = RunConfig().replace(graph=dataclasses.replace(RunConfig().graph, plan=str(plan)))
    builtin = run_model_config(cfg, builtin_tokenizer(), value_head=False)
    same_model = _plan_document(tmp_path, graph, builtin, prompt_tokens=40)
    cfg = cfg.replace(graph=dataclasses.replace(cfg.graph, plan=str(same_model)))
    with pytest.raises(ValueError, match=r"the plan was made for another step \(--prompts-per-step: plan 512, run "):
        check_plan_shapes(cfg, builtin, 40)


def test_the_job_takes_the_plans_precision_and_a_checkpoints_dry_run_has_dtypes(tmp_path):
    """A default plan (bfloat16 compute) used to be refused by a default job on the CPU (float32 there); the job
    now takes the plan's dtypes when it sets none. `--dry-run --model DIR` without dtypes once built its model with
    None dtypes."""
    from rpegjax.models.tokenizer import builtin_tokenizer
    from rpegjax.train.build import build_graph, run_model_config, run_precision
    from rpegjax.train.config import RunConfig

    graph = builders.grpo_graph(use_reference=False, num_devices=4, parallel={"fsdp": 4})
    graph = dataclasses.replace(graph, execution=Execution(param_dtype="float32", dtype="bfloat16"))
    plan = tmp_path / "graph.json"
    plan.write_text(graph.to_json())
    cfg = RunConfig().replace(graph=dataclasses.replace(RunConfig().graph, plan=str(plan)))
    assert (run_precision(cfg).param_dtype, run_precision(cfg).dtype) == ("float32", "bfloat16")
    assert build_graph(cfg, num_devices=8).execution.dtype == "bfloat16"
    explicit = cfg.replace(model=dataclasses.replace(cfg.model, dtype="float32"))
    with pytest.raises(ValueError, match="the plan executes with float32 weights and bfloat16 compute, this run with "
                                         "float32 weights and float32 compute"):
        build_graph(explicit, num_devices=8)

    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    run = RunConfig().replace(model=dataclasses.replace(RunConfig().model, path=str(checkpoint)))
    model = run_model_config(run, builtin_tokenizer(), value_head=False)
    assert (model.param_dtype, model.dtype) == ("float32", "float32")  # the policy's on the CPU, never None
    assert model.hidden_size == CFG.hidden_size


def test_the_dry_run_renders_prompts_as_the_run_does():
    """The dry run once rendered prompts without the run's system prompt (and chat template): its prompt width, and
    so every program's shapes, differed from the run's."""
    from rpegjax.train.build import build
    from rpegjax.train.config import DataSection, RunConfig, WarmStartSection

    cfg = RunConfig(data=DataSection(train_size=8, eval_size=4, system_prompt="Think step by step, then answer."),
                    warm_start=WarmStartSection(steps=0))
    plain = run_plan(cfg.replace(data=dataclasses.replace(cfg.data, system_prompt=None)))
    planned = run_plan(cfg)
    assert planned.batch.prompt == build(cfg, log=lambda _: None).max_prompt_len
    assert planned.batch.prompt >= plain.batch.prompt + len("Think step by step, then answer.")


def test_the_dry_run_of_a_multi_turn_job_samples_and_prefills_as_its_episodes_do():
    """Episodes stop a model turn at the tool call's end (a stop sequence: another decode program) and feed later
    turns longer than a prompt (a capacity-wide prefill); the dry run once lowered neither."""
    from rpegjax.train.config import DataSection, RolloutSection, RunConfig, WarmStartSection

    cfg = RunConfig(data=DataSection(train_size=8, eval_size=4), warm_start=WarmStartSection(steps=0),
                    rollout=RolloutSection(env="calculator", max_new_tokens=32))
    planned = run_plan(cfg)
    assert planned.batch.multi_turn and planned.sampling.stop_sequences
    single = run_plan(cfg.replace(rollout=dataclasses.replace(cfg.rollout, env="none")))
    assert not single.batch.multi_turn and not single.sampling.stop_sequences
    prefill = next(p for p in planned.lower() if p.program == "prefill")
    tokens = prefill.lowered.args_info[0][2]  # (params, state, tokens, ...): the group size is static
    assert tokens.shape[1] == planned.batch.prompt + planned.batch.new  # a later turn's whole context


def test_a_fused_reference_and_policy_pass_counts_the_policy_weights_once():
    """A fused ref + old log-prob unit on the training layout takes the policy's weights as arguments (with the
    reference's): beside it stay only the rest of the training state (the optimiser state), not the weights again
    (they were once counted twice). Lowered only, on 4 virtual devices."""
    from rpegjax.graph import transforms
    from rpegjax.train.dry_run import lower_plan

    graph = transforms.fuse(_graph({"fsdp": 4}), ["ref_logprob", "old_logprob"])
    batch = Batch(rows=8, prompt=16, new=48, slots=8, group_size=4)
    programs = lower_plan(graph, CFG, GRPOConfig(group_size=4, kl_coef=0.04), batch)
    fused = next(p for p in programs if p.program == "inference")
    update = next(p for p in programs if p.program == "update")
    assert fused.stage == "ref_logprob+old_logprob"
    # beside the update: the reference (float32, N/4 each) and the generation copy; beside the fused pass: the
    # optimiser state (two float32 moments) and the generation copy. The difference: (8 - 4) N / 4 bytes (norms
    # replicate, so a little more); counting the weights again read (8 - 4 + 4) N / 4
    assert fused.resident - update.resident == pytest.approx(CFG.num_params(), rel=0.1)


@pytest.mark.slow  # two 4-device dry runs of a tiny MoE, ~2 minutes on a loaded 2-core machine
def test_the_dry_run_compiles_the_plans_expert_capacity():
    """A plan's `Execution.moe_capacity_factor` reaches the compiled programs: the same MoE plan dropless and in the
    capacity mode lowers different update and decode programs (capacity buffers through a plain all-to-all)."""
    assert jax.device_count() >= 4
    moe = ModelConfig.tiny(Architecture.QWEN3_MOE, vocab_size=256)
    batch = Batch(rows=8, prompt=16, new=16, slots=8, group_size=4)
    reports = {}
    for capacity in (None, 1.0):
        graph = _graph({"data": 2, "expert": 2}, use_reference=False)
        graph = dataclasses.replace(graph, execution=dataclasses.replace(graph.execution, moe_capacity_factor=capacity))
        reports[capacity] = dry_run(graph, moe, GRPOConfig(group_size=4), batch, capacity_bytes=1e9)
    update = {c: next(p for p in r.programs if p.stage == "actor_update") for c, r in reports.items()}
    assert update[None].flops != update[1.0].flops or update[None].temporaries != update[1.0].temporaries
