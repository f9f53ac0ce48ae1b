"""The run configuration: choices are enums validated on construction, derived fields have one source."""

import json

import pytest

from rpegjax.data.jsonl import DatasetFormat
from rpegjax.graph.ir import Algorithm, CriticMode
from rpegjax.learners.ppo import PPOConfig
from rpegjax.rewards.task import Difficulty
from rpegjax.rewards.tasks import TaskName
from rpegjax.train.cli import parse_args
from rpegjax.train.config import DataSection, RolloutSection, RunConfig


def test_choices_become_enums_and_round_trip_through_json():
    config = RunConfig(data=DataSection(task="countdown", difficulty="hard"))
    assert config.data.task is TaskName.COUNTDOWN and config.data.difficulty is Difficulty.HARD
    assert config.algorithm is Algorithm.GRPO
    assert RunConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("field, value", [("task", "algebra"), ("difficulty", "extreme")])
def test_unknown_choice_names_field_and_choices(field, value):
    with pytest.raises(ValueError, match=rf"DataSection\.{field} must be one of \[.*\], got '{value}'"):
        DataSection(**{field: value})


def test_dataset_format_needs_a_dataset(tmp_path):
    with pytest.raises(ValueError, match="dataset_format is set but no dataset"):
        DataSection(dataset_format="gsm8k")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    assert DataSection(dataset=str(data), dataset_format="plain").dataset_format is DatasetFormat.PLAIN


def test_the_algorithm_picks_its_section_and_the_critic_layout():
    grpo = RunConfig(ppo=PPOConfig(critic="shared"))
    assert grpo.algorithm_section() is grpo.grpo and not grpo.shares_actor_critic  # a PPO section GRPO ignores
    separate = RunConfig(algorithm="ppo")
    assert separate.algorithm_section() is separate.ppo and not separate.shares_actor_critic
    shared = RunConfig(algorithm="ppo", ppo=PPOConfig(critic="shared"))
    assert shared.algorithm_section().critic is CriticMode.SHARED and shared.shares_actor_critic


def test_model_section_dtypes_are_choices_and_round_trip(tmp_path):
    from rpegjax.options import DType
    from rpegjax.train.config import ModelSection

    config = RunConfig(model=ModelSection(param_dtype="float32", dtype="bfloat16"))
    assert config.model.dtype is DType.BFLOAT16 and config.model.generation_dtype is None
    assert '"dtype": "bfloat16"' in config.to_json()
    assert RunConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match=r"ModelSection.dtype must be one of \['float32', 'bfloat16', 'float16'\], got 'fp8'"):
        ModelSection(dtype="fp8")


def test_group_size_and_temperature_come_from_the_rollout():
    config = RunConfig(rollout=RolloutSection(group_size=4, temperature=0.9))
    assert config.grpo.group_size == 4 and config.grpo.temperature == 0.9 and config.ppo.temperature == 0.9
    for flag in ("--grpo.group_size=4", "--ppo.temperature=0.5"):
        with pytest.raises(SystemExit):
            parse_args([flag], Algorithm.GRPO)


def test_one_critic_mode_for_graph_and_learner():
    assert PPOConfig(critic="shared").critic is CriticMode.SHARED


def test_multi_turn_flags_and_their_checks():
    from rpegjax.envs.catalog import EnvironmentName
    from rpegjax.envs.python_sandbox import SandboxIsolation

    config = parse_args(["--env=calculator", "--max-turns=3", "--episode-token-budget=20", "--max-new-tokens=24",
                         "--rollout.tool_tags=[,],{,}", "--rollout.sandbox_isolation=none"], Algorithm.GRPO)[0]
    rollout = config.rollout
    assert rollout.env == EnvironmentName.CALCULATOR and rollout.max_turns == 3 and rollout.episode_token_budget == 20
    assert rollout.tool_tags == ("[", "]", "{", "}") and rollout.sandbox_isolation == SandboxIsolation.NONE
    assert RunConfig.from_json(config.to_json()).rollout == rollout
    with pytest.raises(ValueError, match=r"episode_token_budget \(40\) must fit in max_new_tokens \(32\)"):
        RolloutSection(env="calculator", episode_token_budget=40)
    with pytest.raises(ValueError, match="tool_tags must be 4 non-empty strings"):
        RolloutSection(tool_tags=("[", "]"))
    with pytest.raises(ValueError, match="RolloutSection.env must be one of \\['none', 'calculator', 'python-sandbox'\\]"):
        RolloutSection(env="browser")


def test_a_config_saved_with_the_old_sandbox_network_field_still_loads(tmp_path):
    """Runs saved before the sandbox moved to bubblewrap stay resumable and exportable: the replaced field is read
    as the default isolation (stronger than either old mode)."""
    from rpegjax.envs.python_sandbox import SandboxIsolation

    data = json.loads(RunConfig().to_json())
    del data["rollout"]["sandbox_isolation"]
    data["rollout"]["sandbox_network"] = "audit-hook"
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert RunConfig.from_file(tmp_path / "config.json").rollout.sandbox_isolation == SandboxIsolation.BUBBLEWRAP


def test_lora_flags_set_the_lora_section_and_round_trip():
    cfg, _ = parse_args(["--lora-rank", "8", "--lora-alpha", "32", "--lora-targets", "q,v,down",
                         "--lora-generation", "adapters"], Algorithm.GRPO)
    lora = cfg.lora.config()
    assert (lora.rank, lora.scale, [t.value for t in lora.targets]) == (8, 4.0, ["q", "v", "down"])
    assert cfg.lora.generation == "adapters"
    assert RunConfig.from_json(cfg.to_json()).lora == cfg.lora
    # LoRA's default rate is 10x the algorithm's; --lora-lr sets it
    assert cfg.lora.optimizer(cfg.grpo.optimizer).learning_rate == pytest.approx(10 * cfg.grpo.optimizer.learning_rate)
    cfg, _ = parse_args(["--lora-rank", "8", "--lora-lr", "3e-4"], Algorithm.PPO)
    assert cfg.lora.optimizer(cfg.ppo.optimizer).learning_rate == 3e-4
    assert RunConfig().lora.config() is None and RunConfig().lora.optimizer(cfg.ppo.optimizer) == cfg.ppo.optimizer


def test_lora_dropout_flag_reaches_the_adapters_and_round_trips():
    cfg, _ = parse_args(["--lora-rank", "8", "--lora-dropout", "0.1"], Algorithm.GRPO)
    assert cfg.lora.config().dropout == 0.1
    assert RunConfig.from_json(cfg.to_json()).lora.config().dropout == 0.1  # config.json: what --resume reads
    assert RunConfig().lora.dropout == 0.0


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "-1"], "LoRASection.rank"), (["--lora-rank", "4", "--lora-targets", "q,x"], "LoRASection.targets"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "LoRASection.dropout must be a probability in [0, 1), got 1.0"),
    (["--lora-rank", "4", "--lora-dropout", "-0.1"], "LoRASection.dropout must be a probability in [0, 1), got -0.1"),
    (["--lora-dropout", "0.1"], "LoRASection.dropout=0.1 needs LoRA adapters (rank > 0)"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "LoRASection.alpha"),
    (["--lora-generation", "fused"], "--lora.generation: 'fused' is not one of ['merged', 'adapters']"),
])
def test_bad_lora_flags_name_the_field(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags, Algorithm.GRPO)
    assert message in capsys.readouterr().err


KV_TINY = ["--model.hidden_size=32", "--model.num_layers=1", "--model.num_heads=2", "--model.num_kv_heads=1",
           "--model.head_dim=16", "--model.intermediate_size=64", "--data.train_size=16", "--data.eval_size=4",
           "--prompts-per-step=4", "--group-size=2", "--max-new-tokens=6", "--rollout.num_slots=16",
           "--warm-start-steps=0", "--mesh=data=-1"]  # 8 virtual devices: 8 slot replicas of 2


def test_the_rollout_kv_cache_options_reach_the_graph_and_the_sampler(tmp_path):
    from rpegjax.train.build import build, build_graph

    flags = [*KV_TINY, "--rollout.kv_cache=paged", "--rollout.page_size=4", "--rollout.kv_pool_tokens=62",
             f"--run-dir={tmp_path / 'run'}"]
    config, _ = parse_args(flags, Algorithm.GRPO)
    assert RunConfig.from_json(config.to_json()).rollout == config.rollout  # saved with the run (and --resume)
    execution = build_graph(config, num_devices=1).execution
    assert (execution.kv_cache, execution.page_size, execution.kv_pool_tokens) == ("paged", 4, 62)
    sampler = build(config, log=lambda _: None).sampler
    assert sampler.paged is not None and sampler.paged.page_size == 4
    assert sampler.paged.pages_per_replica == 16  # 62 tokens per replica in whole pages of 4
    default, _ = parse_args([*KV_TINY, f"--run-dir={tmp_path / 'other'}"], Algorithm.GRPO)
    assert build_graph(default, num_devices=1).execution.kv_cache == "contiguous"


def test_the_decode_attention_flag_reaches_the_graph_and_the_kernel_is_refused_on_cpu(tmp_path):
    from rpegjax.train.build import build, build_graph

    flags = [*KV_TINY, "--rollout.kv_cache=paged", "--rollout.decode_attention=pallas", f"--run-dir={tmp_path / 'run'}"]
    config, _ = parse_args(flags, Algorithm.GRPO)
    assert build_graph(config, num_devices=1).execution.decode_attention == "pallas"
    with pytest.raises(ValueError, match=r"decode_attention=pallas runs the Pallas paged-attention kernel, a CUDA "
                                         r"\(Triton\) kernel; the sampler's devices are 'cpu'"):
        build(config, log=lambda _: None)
    with pytest.raises(ValueError, match="RolloutSection.decode_attention=pallas reads the paged pool"):
        RolloutSection(decode_attention="pallas")


def test_a_plans_slots_and_inference_rows_reach_the_sampler_and_the_learner(tmp_path):
    import dataclasses

    from rpegjax.train.build import build, build_graph

    flags = [flag for flag in KV_TINY if not flag.startswith(("--rollout.num_slots", "--prompts-per-step"))]
    flags.append("--prompts-per-step=8")  # 16 rows: without the plan, 16 slots
    planned, _ = parse_args([*flags, f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    graph = build_graph(planned, num_devices=8)
    plan = tmp_path / "plan.json"
    plan.write_text(dataclasses.replace(graph, execution=dataclasses.replace(
        graph.execution, decode_slots=8, inference_rows=4)).to_json())
    ours, _ = parse_args([*flags, f"--plan={plan}", f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    parts = build(ours, log=lambda _: None)
    assert parts.sampler.num_slots == 8  # not the run's 16 (the default 256 capped at the step's rows)
    assert parts.learner.inference_micro_batches(8, 10, shards=1) == 2  # 8 rows in micro-batches of 4
    other, _ = parse_args([*flags, f"--plan={plan}", "--rollout.num_slots=16", f"--run-dir={tmp_path / 'run'}"],
                          Algorithm.GRPO)
    with pytest.raises(ValueError, match="the plan's sampler is {'decode_slots': 8}, this run asks for"):
        build_graph(other, num_devices=8)
    rows, _ = parse_args([*flags, f"--plan={plan}", "--grpo.inference_rows=2", f"--run-dir={tmp_path / 'run'}"],
                         Algorithm.GRPO)
    with pytest.raises(ValueError, match="inference in micro-batches of 4 rows, this run asks for 2"):
        build_graph(rows, num_devices=8)


def test_kv_cache_options_are_checked_and_never_override_a_plan_silently(tmp_path):
    from rpegjax.graph.ir import Execution, GraphError
    from rpegjax.train.build import build_graph

    with pytest.raises(ValueError, match="RolloutSection.kv_pool_tokens=64 sizes the paged cache's pool"):
        RolloutSection(kv_pool_tokens=64)
    with pytest.raises(ValueError, match="RolloutSection.page_size"):
        RolloutSection(kv_cache="paged", page_size=0)
    with pytest.raises(ValueError, match="RolloutSection.kv_cache"):
        RolloutSection(kv_cache="ring")
    with pytest.raises(GraphError, match="Execution.kv_pool_tokens=64 sizes a paged KV cache's pool"):
        Execution(kv_pool_tokens=64)
    assert Execution.from_dict(Execution(kv_cache="paged", kv_pool_tokens=64).to_dict()).kv_pool_tokens == 64
    plan = tmp_path / "plan.json"
    planned, _ = parse_args([*KV_TINY, f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    plan.write_text(build_graph(planned, num_devices=1).to_json())  # a contiguous plan
    ours, _ = parse_args([*KV_TINY, f"--plan={plan}", f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    assert build_graph(ours, num_devices=1).execution.kv_cache == "contiguous"  # unset: the plan's
    paged, _ = parse_args([*KV_TINY, f"--plan={plan}", "--rollout.kv_cache=paged", f"--run-dir={tmp_path / 'run'}"],
                          Algorithm.GRPO)
    with pytest.raises(ValueError, match="the plan's sampler is {'kv_cache': 'contiguous'"):
        build_graph(paged, num_devices=1)


def test_related_flags_are_checked_against_each_other_not_the_defaults():
    """--microbatches 3 with --prompts-per-step 6 was checked as 3 of the default 32 prompts and refused."""
    cfg, _ = parse_args(["--microbatches", "3", "--prompts-per-step", "6"], Algorithm.GRPO)
    assert (cfg.graph.generate_microbatches, cfg.rollout.prompts_per_step) == (3, 6)
    cfg, _ = parse_args(["--prompts-per-step=6", "--graph.generate_microbatches=3"], Algorithm.GRPO)
    assert cfg.graph.generate_microbatches == 3


@pytest.mark.parametrize("flags, message", [
    (["--microbatches", "4", "--prompts-per-step", "6"],
     "graph.generate_microbatches (4) must divide rollout.prompts_per_step (6)"),
    (["--lora-rank", "100000"], "LoRASection.rank=100000 exceeds min(in, out) = 64 of the targeted projection k "
                                "(128 -> 64) of the built model (model.hidden_size=128)"),
    (["--lora-rank", "200", "--lora-targets", "gate,up"],
     "LoRASection.rank=200 exceeds min(in, out) = 128 of the targeted projection gate (128 -> 384)"),
    (["--lora-alpha", "32"], "LoRASection.alpha=32.0 needs LoRA adapters (rank > 0); rank is 0 (set --lora-rank)"),
    (["--lora-targets", "q,v"], "LoRASection.targets=('q', 'v') needs LoRA adapters"),
    (["--lora-lr", "1e-4"], "LoRASection.learning_rate=0.0001 needs LoRA adapters"),
    (["--reward", ""], "--reward ['']: an empty reward; give package.module:function[=weight]"),
    (["--reward", "m:f", "--reward", " "], "an empty reward"),
    (["--data.reward=m:f,,m:g"], "--data.reward: an empty item in the list 'm:f,,m:g'"),
])
def test_values_are_checked_against_the_resolved_config(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags, Algorithm.GRPO)
    assert message in capsys.readouterr().err


def test_a_lora_rank_within_the_widths_is_accepted():
    cfg, _ = parse_args(["--lora-rank", "64"], Algorithm.GRPO)
    assert cfg.lora.rank == 64


@pytest.mark.parametrize("name, text, message", [
    ("run.yaml", "train:\n  steps: 3\n  steps: 5\n", "duplicate key 'steps' (first at line 2)"),
    ("run.yaml", "train:\n  steps: 3\ntrain:\n  seed: 1\n", "duplicate key 'train' (first at line 1)"),
    ("run.json", '{"train": {"steps": 3, "steps": 5}}', "duplicate key 'steps'"),
])
def test_a_config_file_that_sets_a_key_twice_is_an_error_naming_key_and_file(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        RunConfig.from_file(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_overrides_of_top_level_and_nested_fields_apply_together():
    from rpegjax.train.overrides import apply_overrides

    config = apply_overrides(RunConfig(), {"recipe": "dapo", "rollout.prompts_per_step": "6",
                                           "graph.generate_microbatches": "3", "grpo.clip_high": "0.3"})
    assert (config.recipe, config.rollout.prompts_per_step, config.graph.generate_microbatches) == ("dapo", 6, 3)
    assert config.grpo.clip_high == 0.3
    with pytest.raises(ValueError, match="--rollout.nothing: unknown field 'nothing' of RolloutSection"):
        apply_overrides(RunConfig(), {"rollout.nothing": "1"})
    with pytest.raises(ValueError, match="--rollout.prompts_per_step.x: int has no fields"):
        apply_overrides(RunConfig(), {"rollout.prompts_per_step.x": "1"})


def test_correction_flags_reach_the_learner_and_round_trip(capsys):
    cfg, _ = parse_args(["--grpo.importance_cap=none", "--correction", "icepop", "--grpo.icepop_high=3"],
                        Algorithm.GRPO)
    assert (cfg.grpo.correction, cfg.grpo.correction_band, cfg.grpo.importance_cap) == ("icepop", (0.5, 3.0), None)
    assert RunConfig.from_json(cfg.to_json()).grpo == cfg.grpo
    cfg, _ = parse_args(["--correction=sequence-tis", "--ppo.importance_cap=2"], Algorithm.PPO)
    assert (cfg.ppo.correction, cfg.ppo.importance_cap) == ("sequence-tis", 2.0)
    # the job's default importance cap (5, token TIS) is not read by IcePop: an error, not an ignored value
    with pytest.raises(SystemExit):
        parse_args(["--correction", "icepop"], Algorithm.GRPO)
    assert "importance_cap=5.0 is not read by correction 'icepop'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--correction", "tis"], Algorithm.GRPO)
    assert "'tis' is not one of" in capsys.readouterr().err


def test_packing_flags_reach_the_plan_and_a_plan_is_never_overridden(tmp_path):
    import dataclasses

    from rpegjax.graph.ir import Execution, GraphError
    from rpegjax.train.build import build_graph

    packing = ["--grpo.packing=true", "--grpo.max_tokens_per_micro_batch=64"]
    packed, _ = parse_args([*KV_TINY, *packing, f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    graph = build_graph(packed, num_devices=1)
    assert (graph.execution.packing, graph.execution.max_tokens_per_micro_batch) == (True, 64)
    assert "packed rows of 64 tokens" in graph.execution.describe()
    with pytest.raises(GraphError, match="packing needs the budget"):
        Execution(packing=True)
    with pytest.raises(GraphError, match="update_microbatches=2 and inference_rows=None must stay 1 and null"):
        Execution(packing=True, max_tokens_per_micro_batch=64, update_microbatches=2)
    plan = tmp_path / "plan.json"
    plan.write_text(dataclasses.replace(graph, execution=dataclasses.replace(
        graph.execution, max_tokens_per_micro_batch=128)).to_json())
    other, _ = parse_args([*KV_TINY, *packing, f"--plan={plan}", f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    with pytest.raises(ValueError, match="the plan runs packing=True with max_tokens_per_micro_batch=128, this run "
                                         "asks for 64"):
        build_graph(other, num_devices=1)
    unset, _ = parse_args([*KV_TINY, f"--plan={plan}", f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    assert build_graph(unset, num_devices=1).execution.max_tokens_per_micro_batch == 128  # unset: the plan's


def test_narrower_packed_rows_must_cut_into_the_context_chunks(tmp_path):
    """A length bucket under packing narrows rows to its multiples: over context 2 they must still cut into 4 chunks
    of whole attention blocks, or the run is refused when it is built, not at its first narrow step."""
    from rpegjax.train.build import build_graph

    packing = [*KV_TINY, "--grpo.packing=true", "--grpo.max_tokens_per_micro_batch=256", "--graph.mesh=context=2",
               "--model.attention=blockwise", "--model.attention_block_size=16", f"--run-dir={tmp_path / 'run'}"]
    good, _ = parse_args([*packing, "--grpo.length_bucket=64"], Algorithm.GRPO)
    assert build_graph(good, num_devices=2).execution.max_tokens_per_micro_batch == 256
    bad, _ = parse_args([*packing, "--grpo.length_bucket=48"], Algorithm.GRPO)
    with pytest.raises(ValueError, match=r"grpo.length_bucket=48: narrower packed rows of 96 tokens do not cut into 4 "
                                         r"chunks of whole attention blocks of 16 tokens .*, over placement 'all'; rows "
                                         r"narrow to multiples of length_bucket"):  # 48 would: 4 x 12
        build_graph(bad, num_devices=2)


def test_partial_rollout_flags_reach_the_runtime_settings_and_bad_ones_are_refused():
    from rpegjax.runtime.partial_rollouts import PartialRolloutConfig, StalePolicy
    from rpegjax.train.build import build_graph, run_partial_rollouts
    from rpegjax.train.config import GraphSection, GRPOSection

    settings = lambda config: run_partial_rollouts(config, build_graph(config, num_devices=1))
    assert settings(RunConfig()) is None
    config = RunConfig(rollout=RolloutSection(partial=True, stale_policy="drop"), graph=GraphSection(async_bound=1))
    assert settings(config) == PartialRolloutConfig(max_token_lag=3, stale_policy=StalePolicy.DROP,
                                                    inflight_weights=True)  # unset: on under k >= 1
    synchronous = RunConfig(rollout=RolloutSection(partial=True), graph=GraphSection(async_bound=0))
    assert not settings(synchronous).inflight_weights
    assert not settings(RunConfig(rollout=RolloutSection(partial=True, inflight_weights=False))).inflight_weights
    assert "partial rollouts (2 batches in flight, token lag <= k+2, carry recompute)" in build_graph(config, 1).execution.describe()
    assert RunConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match=r"rollout.max_token_lag \(1\) must exceed graph.async_bound \(1\)"):
        RunConfig(rollout=RolloutSection(partial=True, max_token_lag=1), graph=GraphSection(async_bound=1))
    with pytest.raises(ValueError, match="rollout.partial with grpo.dynamic_sampling"):
        RunConfig(rollout=RolloutSection(partial=True), grpo=GRPOSection(dynamic_sampling=True, group_size=8))
    with pytest.raises(ValueError, match="inflight_batches must be >= 2"):
        RolloutSection(inflight_batches=1)
    with pytest.raises(ValueError, match="stale_policy"):
        RolloutSection(stale_policy="later")
    with pytest.raises(ValueError, match="rollout.inflight_weights continues partial rollouts"):
        RunConfig(rollout=RolloutSection(inflight_weights=True))
    assert settings(RunConfig(rollout=RolloutSection(partial=True, inflight_weights=True))).inflight_weights
    on = settings(RunConfig(rollout=RolloutSection(partial=True, inflight_weights=True, inflight_after=None)))
    assert on.inflight_weights and on.inflight_after is None
    assert settings(RunConfig(rollout=RolloutSection(partial=True, inflight_after=0.25))).inflight_after == 0.25
    for off in (RolloutSection(inflight_after=0.25), RolloutSection(partial=True, inflight_weights=False,
                                                                    inflight_after=0.25)):
        with pytest.raises(ValueError, match="rollout.inflight_after=0.25 says when partial rollouts take weights"):
            RunConfig(rollout=off)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=f"inflight_after must be a share in \\(0, 1\\] or none, got {bad}"):
            RolloutSection(inflight_after=bad)
    with pytest.raises(ValueError, match="under asynchrony bound 0 every step already generates with the newest"):
        settings(RunConfig(rollout=RolloutSection(partial=True, inflight_weights=True),
                           graph=GraphSection(async_bound=0)))


def test_the_partial_carry_flag_reaches_the_plan_and_the_runtime_and_bad_ones_are_refused(tmp_path):
    from rpegjax.options import CarryMode
    from rpegjax.train.build import build_graph, run_partial_rollouts

    flags = [*KV_TINY, "--rollout.partial=true", "--rollout.kv_cache=paged", f"--run-dir={tmp_path / 'run'}"]
    config, _ = parse_args([*flags, "--rollout.partial_carry=pages"], Algorithm.GRPO)
    graph = build_graph(config, num_devices=1)
    assert graph.execution.partial_carry == CarryMode.PAGES and "carry pages" in graph.execution.describe()
    assert run_partial_rollouts(config, graph).carry == CarryMode.PAGES
    default, _ = parse_args(flags, Algorithm.GRPO)
    assert run_partial_rollouts(default, build_graph(default, num_devices=1)).carry == CarryMode.RECOMPUTE
    with pytest.raises(ValueError, match="rollout.partial_carry=pages keeps carried sequences' KV pages in the paged "
                                         "pool; set rollout.kv_cache=paged"):
        RunConfig(rollout=RolloutSection(partial=True, partial_carry="pages"))
    with pytest.raises(ValueError, match="set rollout.partial=true too"):
        RunConfig(rollout=RolloutSection(partial_carry="pages", kv_cache="paged"))
    with pytest.raises(ValueError, match="leave rollout.kv_pool_tokens unset"):
        RunConfig(rollout=RolloutSection(partial=True, partial_carry="pages", kv_cache="paged", kv_pool_tokens=4096))
    with pytest.raises(ValueError, match="partial_carry"):
        RolloutSection(partial_carry="later")


def test_a_plan_with_partial_rollouts_sets_the_run_and_is_never_overridden(tmp_path):
    import dataclasses

    from rpegjax.graph.ir import Execution, GraphError
    from rpegjax.runtime.partial_rollouts import PartialRolloutConfig
    from rpegjax.train.build import build_graph, run_partial_rollouts

    run, _ = parse_args([*KV_TINY, "--async-bound=1", f"--run-dir={tmp_path / 'run'}"], Algorithm.GRPO)
    graph = build_graph(run, num_devices=1)
    assert not graph.execution.partial_rollouts and run_partial_rollouts(run, graph) is None
    plan = tmp_path / "plan.json"
    plan.write_text(dataclasses.replace(graph, async_bound=2, execution=dataclasses.replace(
        graph.execution, partial_rollouts=True, inflight_batches=3, max_token_lag=4)).to_json())
    flags = [*KV_TINY, f"--plan={plan}", f"--run-dir={tmp_path / 'run'}"]
    planned, _ = parse_args(flags, Algorithm.GRPO)  # no rollout flag: the plan's partial rollouts run
    assert run_partial_rollouts(planned, build_graph(planned, num_devices=1)) == PartialRolloutConfig(
        max_token_lag=4, inflight_batches=3)
    same, _ = parse_args([*flags, "--rollout.partial=true", "--rollout.inflight_batches=3"], Algorithm.GRPO)
    assert run_partial_rollouts(same, build_graph(same, num_devices=1)).inflight_batches == 3
    other, _ = parse_args([*flags, "--rollout.partial=true", "--rollout.max_token_lag=3"], Algorithm.GRPO)
    with pytest.raises(ValueError, match=r"the plan's partial rollouts are \{'partial': True, 'inflight_batches': 3, "
                                         r"'max_token_lag': 4, 'partial_carry': 'recompute'\}, this run asks for \{'partial': True, 'max_token_lag': 3\}"):
        build_graph(other, num_devices=1)
    dynamic, _ = parse_args([*flags, "--grpo.dynamic_sampling=true"], Algorithm.GRPO)
    with pytest.raises(ValueError, match="the plan runs partial rollouts: rollout.partial with grpo.dynamic_sampling"):
        build_graph(dynamic, num_devices=1)
    with pytest.raises(GraphError, match="set partial_rollouts too"):
        Execution(inflight_batches=3)
    with pytest.raises(GraphError, match=r"max_token_lag \(2\) must exceed the asynchrony bound \(2\)"):
        dataclasses.replace(graph, async_bound=2, execution=dataclasses.replace(
            graph.execution, partial_rollouts=True, max_token_lag=2)).validate()
