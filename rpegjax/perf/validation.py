"""Published measurements that the performance model is checked against, each cited with its set-up.

Nothing here is fitted: the tests (`tests/perf/test_validation.py`) predict each run with the default
efficiencies and compare.
"""

from __future__ import annotations

from rpegjax.perf.costs import ModelShape
from rpegjax.perf.hardware import HardwareSpec, a100_node
from rpegjax.perf.pretraining import PipelineRun


def _gpt(layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads, mlp=4 * hidden,
                      vocab=51200, gated_mlp=False, param_dtype="bfloat16", compute_dtype="bfloat16")


# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023
# (arXiv:2205.05198): Table 3 (model configurations: GPT-3-style, sequence 2048, micro-batch 1, tensor 8,
# run on NVIDIA Selene, DGX A100 80 GB) and Table 5 ("present work" = sequence parallelism + selective
# recomputation: end-to-end iteration time and model FLOPs utilisation).
KORTHIKANTI_2022 = (
    PipelineRun(name="GPT 22B", shape=_gpt(48, 6144, 64), seq_len=2048, global_batch=4, micro_batch=1, tensor=8,
                pipeline=1, data=1, measured_seconds=1.10, measured_mfu=0.415,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
    PipelineRun(name="GPT-3 175B", shape=_gpt(96, 12288, 96), seq_len=2048, global_batch=64, micro_batch=1, tensor=8,
                pipeline=8, data=1, measured_seconds=13.75, measured_mfu=0.514,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
    PipelineRun(name="GPT 530B", shape=_gpt(105, 20480, 128), seq_len=2048, global_batch=280, micro_batch=1, tensor=8,
                pipeline=35, data=1, measured_seconds=37.83, measured_mfu=0.560,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
    PipelineRun(name="GPT 1T", shape=_gpt(128, 25600, 160), seq_len=2048, global_batch=512, micro_batch=1, tensor=8,
                pipeline=64, data=1, measured_seconds=71.49, measured_mfu=0.563,
                source="Korthikanti et al. 2022, Tables 3 and 5"),
)


def selene(devices: int) -> HardwareSpec:
    """The DGX A100 80 GB cluster these runs used."""
    return a100_node(devices)
