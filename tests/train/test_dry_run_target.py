"""The dry run's compile targets (`rpegjax.train.compile_target`): compile-only CUDA devices with XLA's GPU compiler
on a machine without a GPU, and the clear error when JAX's CUDA plugin is absent.

CI installs the plugin in a directory of its own (`.ci/run`: `pip install --target .gpu-aot ...`) and runs this file
once more with it on the path and RPEGJAX_GPU_AOT=required, where a missing plugin fails instead of skipping;
elsewhere the GPU-compiling tests skip, saying so."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import sys

import pytest
from test_compiled_flops import compile_nested_scans, nested_scans_flops

from rpegjax.graph import builders
from rpegjax.graph.ir import Execution
from rpegjax.learners import GRPOConfig
from rpegjax.models import ModelConfig
from rpegjax.runtime.meshes import stage_mesh
from rpegjax.train import compile_target
from rpegjax.train.compile_target import DryRunTarget, compile_devices
from rpegjax.train.compiled_flops import CompiledFlops, compiled_flops
from rpegjax.train.dry_run import Batch, compile_programs, lower_plan

ROOT = pathlib.Path(__file__).parents[2]
needs_plugin = pytest.mark.skipif(not compile_target.cuda_plugin_installed() and os.environ.get("RPEGJAX_GPU_AOT") != "required",
                                  reason="JAX's CUDA plugin is not installed (pip install -e '.[gpu-aot]'; CI installs it)")


def _graph(dtype: str):
    graph = builders.grpo_graph(use_reference=True, num_devices=4, parallel={"fsdp": 2, "tensor": 2})
    return dataclasses.replace(graph, execution=Execution(attention="blockwise", attention_block_size=64, remat="full",
                                                          scan_layers=True, dtype=dtype, kv_cache="paged"))


def test_a_cuda_target_without_the_plugin_is_an_error_not_a_cpu_compile(monkeypatch):
    monkeypatch.setattr(compile_target, "cuda_plugin_installed", lambda: False)
    with pytest.raises(ValueError, match="cuda-h100.*CUDA plugin is not installed.*gpu-aot"):
        compile_devices(DryRunTarget.CUDA_H100, 4)


def test_plan_verify_target_auto_is_the_hardware_gpu_only_with_the_plugin(monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        plan = importlib.import_module("plan")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for installed, h100, gh200, a100 in ((True, "cuda-h100", "cuda-gh200", "cpu"), (False, "cpu", "cpu", "cpu")):
        monkeypatch.setattr(plan, "cuda_plugin_installed", lambda: installed)
        assert [plan.verify_target("auto", hw).value for hw in ("h100", "gh200", "a100")] == [h100, gh200, a100]
    assert plan.verify_target("cuda-gh200", "h100") is DryRunTarget.CUDA_GH200  # asked for: never replaced


@needs_plugin
def test_compile_only_gpus_carry_the_target_and_meshes_place_on_them():
    devices = compile_devices(DryRunTarget.CUDA_GH200, 8)
    assert len(devices) == 8 and {d.device_kind for d in devices} == {"NVIDIA GH200 96GB HBM3"}
    graph = builders.grpo_graph(use_reference=False, num_devices=8, parallel={"fsdp": 4, "tensor": 2})
    mesh = stage_mesh(graph, "actor_update", devices)
    assert dict(mesh.shape) == {"fsdp": 4, "tensor": 2} and set(mesh.devices.flat) == set(devices)
    assert "compile-only" in compile_target.describe(devices)


@needs_plugin
def test_the_gpu_compiler_holds_bfloat16_activations_where_xla_cpu_holds_float32_copies():
    """~20 s idle. The same plan lowered for 4 compile-only H100s in bfloat16 and in float32 compute: every program
    the runtime launches lowers there; compiled, the bfloat16 inference program's temporaries are well under the
    float32 one's (XLA:CPU compiles both to the same float32 temporaries, docs/benchmarks.md W-long check), and
    the paged decode chunk compiles with its pool as an argument."""
    cfg = ModelConfig.tiny(vocab_size=256).replace(hidden_size=128, intermediate_size=512, max_position_embeddings=1024)
    batch = Batch(rows=16, prompt=64, new=448, slots=16, group_size=4)
    devices = compile_devices(DryRunTarget.CUDA_H100, 4)
    lowered = {dtype: lower_plan(_graph(dtype), cfg.replace(dtype=dtype), GRPOConfig(group_size=4, kl_coef=0.04), batch,
                                 devices=devices)
               for dtype in ("bfloat16", "float32")}
    assert [(p.stage, p.program.split(" ")[0]) for p in lowered["bfloat16"]] == [
        ("ref_logprob", "inference"), ("old_logprob", "inference"), ("actor_update", "update"),
        ("weight_sync", "weight"), ("generate", "prefill"), ("generate", "start"), ("generate", "decode")]
    inference = {dtype: compile_programs(programs[:1], capacity_bytes=1e9) for dtype, programs in lowered.items()}
    assert "4 x NVIDIA H100 80GB HBM3" in inference["bfloat16"].devices
    temporaries = {dtype: report.programs[0].temporaries for dtype, report in inference.items()}
    assert temporaries["bfloat16"] < 0.75 * temporaries["float32"], temporaries
    decode = compile_programs(lowered["bfloat16"][-1:], capacity_bytes=1e9).programs[0]
    page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # k and v, bfloat16, per token
    assert decode.arguments > page_bytes * batch.slots // 4  # at least a slot replica's pool (kv heads over tensor)


@needs_plugin
def test_matmul_flops_are_counted_on_compile_only_gpus_which_have_no_cost_analysis():
    """The dry run printed 0.00 TFLOP for every program here: JAX's cost_analysis() is None on compile-only devices.
    The GPU compiler's modules count every iteration of nested loops exactly, as XLA:CPU's do."""
    compiled = compile_nested_scans(compile_devices(DryRunTarget.CUDA_H100, 2))
    assert compiled.cost_analysis() is None
    assert compiled_flops(compiled) == CompiledFlops(flops=nested_scans_flops(2), exact=True)


def test_the_jobs_dry_run_on_a_cuda_target_needs_the_plan(tmp_path, capsys):
    from rpegjax.train.cli import main
    from rpegjax.train.config import RunConfig

    code = main(["--dry-run", "--dry-run-target", "cuda-h100", "--run-dir", str(tmp_path / "run")], RunConfig().algorithm)
    assert code == 2 and "give the run's plan (--plan plan.json)" in capsys.readouterr().err


@needs_plugin
def test_the_jobs_dry_run_lowers_its_plan_for_compile_only_gpus(tmp_path):
    """`train_grpo.py --plan plan.json --dry-run --dry-run-target cuda-gh200`: the run's model at its shapes, on
    the plan's 4 devices, as GH200s (lowered; one program compiled)."""
    from rpegjax.models.tokenizer import builtin_tokenizer
    from rpegjax.train.build import run_model_config
    from rpegjax.train.config import RunConfig, WarmStartSection
    from rpegjax.train.dry_run import run_plan
    from rpegjax.train.plan_document import model_shape

    graph = builders.grpo_graph(use_reference=False, num_devices=4, parallel={"fsdp": 4})
    cfg = RunConfig(warm_start=WarmStartSection(steps=0))
    model = run_model_config(cfg, builtin_tokenizer(), value_head=False)
    probe = run_plan(cfg)  # the run's own prompt width, on this machine's devices
    rollout = cfg.rollout
    document = {"model": "builtin", "model_config": model_shape(model),
                "workload": {"prompts": rollout.prompts_per_step, "group_size": rollout.group_size,
                             "prompt_tokens": probe.batch.prompt, "response_max": rollout.max_new_tokens},
                "plans": [{"name": "best", "graph": graph.to_dict(), "prediction": {"step_seconds": 1.0, "stages": []}}]}
    (tmp_path / "plan.json").write_text(json.dumps(document))
    cfg = cfg.replace(graph=dataclasses.replace(cfg.graph, plan=str(tmp_path / "plan.json")))
    planned = run_plan(cfg, DryRunTarget.CUDA_GH200)
    assert len(planned.devices) == 4 and {d.device_kind for d in planned.devices} == {"NVIDIA GH200 96GB HBM3"}
    programs = planned.lower()
    report = compile_programs(programs[:1], capacity_bytes=86.4e9)
    assert report.programs[0].stage == "old_logprob" and "4 x NVIDIA GH200 96GB HBM3" in report.devices


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("remat, tied", [("full", True), ("full", False), ("none", True)])
def test_predicted_memory_is_within_15_percent_of_the_gpu_compilers_programs(remat, tied):
    """The performance model's per-device peak against XLA's GPU compiler (8 compile-only H100s), for the update,
    the log-prob and the decode programs of Qwen2.5-0.5B cut to 2 layers, its embeddings tied (as released) and
    untied (its 152k vocabulary is what FSDP gathers whole; the full shapes: benchmarks/bench_memory_model.py
    --target cuda-h100). The tied update read +45% while the model counted XLA:CPU's whole gather of the embedding
    table and a second whole gradient. ~2-4 min each."""
    spec = importlib.util.spec_from_file_location("bench_memory_model", ROOT / "benchmarks" / "bench_memory_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = ModelConfig.qwen2p5("0.5b").replace(num_layers=2, tie_word_embeddings=tied)
    execution = Execution(attention="blockwise", attention_block_size=128, remat=remat, scan_layers=True)
    for row in bench.compare(model, {"data": 1, "fsdp": 8, "tensor": 1}, 1024, 256, execution,
                             target=DryRunTarget.CUDA_H100):
        assert row["predicted"] == pytest.approx(row["compiled"], rel=0.15), row


@needs_plugin
def test_compile_only_gpus_have_no_host_memory_so_an_offloading_plan_lowers_without_the_moves():
    """Compile-only devices report no memory kinds, and a sharding asked for `pinned_host` on them comes back
    without one (JAX drops it): host placement cannot be compiled for them. A colocated plan that offloads its
    optimiser state still lowers every program (each takes the state on the devices); the dry run says the moves
    were not checked, and generation's resident state leaves the optimiser state out, as on the CPU target."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = compile_devices(DryRunTarget.CUDA_H100, 4)
    assert devices[0].addressable_memories() == []
    asked = NamedSharding(Mesh(np.array(devices), ("fsdp",)), PartitionSpec("fsdp"), memory_kind="pinned_host")
    assert asked.memory_kind is None
    cfg = ModelConfig.tiny(vocab_size=256)
    batch = Batch(rows=16, prompt=32, new=64, slots=16, group_size=4)
    graph = builders.grpo_graph(use_reference=False, num_devices=4, parallel={"fsdp": 4})
    planned = dataclasses.replace(graph, execution=Execution(optimizer_offload=True, kv_cache="paged"))
    residents, logs = {}, []
    for target in (DryRunTarget.CUDA_H100, DryRunTarget.CPU):  # the CPU's devices have pinned host memory
        programs = lower_plan(planned, cfg, GRPOConfig(group_size=4), batch, devices=compile_devices(target, 4),
                              log=logs.append)
        residents[target] = {p.program: p.resident for p in programs}
    assert [line for line in logs if "optimiser offload" in line] == [
        next(line for line in logs if "pinned host memory" in line and "not checked" in line)]
    assert residents[DryRunTarget.CUDA_H100] == residents[DryRunTarget.CPU]


@needs_plugin
def test_the_pallas_paged_decode_compiles_for_compile_only_gpus_and_is_refused_on_cpu():
    """A plan with `decode_attention=pallas` on 4 compile-only H100s (fsdp 2 x tensor 2): its decode chunk lowers
    with the Pallas paged-attention kernel (a Triton custom call) in `shard_map` and compiles; on this machine's
    CPU devices the same plan's sampler is refused, naming the kernel and the platform."""
    cfg = ModelConfig.tiny(vocab_size=256).replace(hidden_size=128, intermediate_size=256, max_position_embeddings=512,
                                                   head_dim=32, dtype="bfloat16")
    graph = _graph("bfloat16")
    graph = dataclasses.replace(graph, execution=dataclasses.replace(graph.execution, decode_attention="pallas"))
    batch = Batch(rows=16, prompt=64, new=192, slots=16, group_size=4)
    lowered = lower_plan(graph, cfg, GRPOConfig(group_size=4, kl_coef=0.04), batch,
                         devices=compile_devices(DryRunTarget.CUDA_H100, 4))
    decode = lowered[-1]
    assert decode.program.startswith("decode") and "triton" in decode.lowered.as_text().lower()
    report = compile_programs([decode], capacity_bytes=1e9)
    assert report.fits and "4 x NVIDIA H100 80GB HBM3" in report.devices
    with pytest.raises(ValueError, match=r"decode_attention=pallas runs the Pallas paged-attention kernel, a CUDA "
                                         r"\(Triton\) kernel; the sampler's devices are 'cpu'"):
        lower_plan(graph, cfg, GRPOConfig(group_size=4, kl_coef=0.04), batch,
                   devices=compile_devices(DryRunTarget.CPU, 4))


@needs_plugin
def test_a_fused_packed_log_prob_pass_is_predicted_as_the_gpu_compiler_holds_it():
    """The planner's fused reference + policy log-prob pass over packed rows (float32 masters, bfloat16 compute,
    fsdp over 4 compile-only H100s, one packed row per device per micro-batch), 8 layers: compiled, its peak is
    the model's within 3%. The model had one model's weight copies per program and no stacked layers; the GPU
    holds both models' layers stacked in bfloat16 for the layer scan, their transposed projections and, later,
    both output matrices gathered (`stage_costs._forward_transient_bytes`): the old formula read −6.6% here and
    −22% for Llama 3.1 8B's. ~30 s idle."""
    from rpegjax.graph import transforms
    from rpegjax.perf.model import step_model
    from rpegjax.perf.model.generation_cost import ResponseLengths
    from rpegjax.perf.model.stage_costs import Workload
    from rpegjax.perf.reference import presets

    cfg = ModelConfig.tiny(vocab_size=4096).replace(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                                                    num_kv_heads=4, max_position_embeddings=2048, dtype="bfloat16")
    execution = Execution(attention="blockwise", attention_block_size=128, remat="none", scan_layers=True,
                          param_dtype="float32", dtype="bfloat16", packing=True, max_tokens_per_micro_batch=1024)
    graph = transforms.fuse(builders.grpo_graph(use_reference=True, num_devices=4, parallel={"fsdp": 4}),
                            ["ref_logprob", "old_logprob"])
    graph = dataclasses.replace(graph, execution=execution)
    workload = Workload(prompts=4, group_size=4, prompt_tokens=64, responses=ResponseLengths.fixed(192))
    prediction = step_model.Evaluator.for_runtime(cfg, workload, presets.h100_node(4)).predict(
        graph, enforce_memory=False, with_trace=False)
    programs = lower_plan(graph, cfg, GRPOConfig(group_size=4, kl_coef=0.04),
                          Batch(rows=16, prompt=64, new=192, slots=16, group_size=4),
                          devices=compile_devices(DryRunTarget.CUDA_H100, 4))
    fused = next(p for p in programs if p.program == "inference")
    compiled = compile_programs([fused], capacity_bytes=80e9, predicted={
        s.name: s.peak_memory_bytes for s in prediction.stages}).programs[0]
    assert compiled.stage == "ref_logprob+old_logprob"
    assert compiled.predicted == pytest.approx(compiled.peak, rel=0.03), (compiled.predicted, compiled.peak)
