"""KV-cache sampler: jit prefill + decode loop, continuous batching, group sampling, behaviour log-probs."""

from rpegjax.generate.completion import Completion, CompletionBatch, FinishReason, stack_completions
from rpegjax.generate.sampler import Sampler, SamplerStats
from rpegjax.generate.sampling import SamplingConfig, filter_logits, sample_tokens
from rpegjax.generate.weight_sync import generation_rules, reshard_params

__all__ = [
    "Completion",
    "CompletionBatch",
    "FinishReason",
    "Sampler",
    "SamplerStats",
    "SamplingConfig",
    "filter_logits",
    "generation_rules",
    "reshard_params",
    "sample_tokens",
    "stack_completions",
]
