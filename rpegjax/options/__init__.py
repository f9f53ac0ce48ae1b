"""Execution options shared by every layer (attention kernel, remat policy, KV-cache layout, dtypes).

The bottom of the package layering: plain Python, imported by models, generate, graph, perf, learners, runtime
and train alike, so that each choice is defined once (`rpegjax.options.execution`).
"""

from rpegjax.options.execution import (
    MODEL_EXECUTION_FIELDS,
    AttentionKind,
    CacheLayout,
    CarryMode,
    DecodeAttention,
    DType,
    OptimizerSharding,
    RematPolicy,
    parse_choice,
    remat_runs,
)

__all__ = ["MODEL_EXECUTION_FIELDS", "AttentionKind", "CacheLayout", "CarryMode", "DecodeAttention", "DType", "OptimizerSharding", "RematPolicy", "parse_choice", "remat_runs"]
