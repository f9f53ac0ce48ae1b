"""KV-cache sampler: jit prefill + decode loop, continuous batching, group sampling, behaviour log-probs."""

from rpegjax.generate.completion import (
    Completion,
    CompletionBatch,
    FinishReason,
    stack_completions,
)
from rpegjax.generate.paged_cache import CacheConfig
from rpegjax.generate.requests import Request, RequestFeed
from rpegjax.generate.sampler import Sampler, SamplerStats, slot_replicas, usable_slots
from rpegjax.generate.sampling import SamplingConfig, filter_logits, sample_tokens
from rpegjax.generate.weight_sync import (
    generation_batch_axes,
    generation_rules,
    reshard_params,
)

__all__ = [
    "CacheConfig",
    "Completion",
    "CompletionBatch",
    "FinishReason",
    "Request",
    "RequestFeed",
    "Sampler",
    "SamplerStats",
    "SamplingConfig",
    "filter_logits",
    "generation_batch_axes",
    "generation_rules",
    "reshard_params",
    "sample_tokens",
    "slot_replicas",
    "stack_completions",
    "usable_slots",
]
