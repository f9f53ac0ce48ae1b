"""Logical axis names: the only sharding vocabulary that models and losses use.

A rules table (`rpegjax.sharding.rules`) maps them to mesh axes; models never see mesh-axis names.
"""

BATCH = "batch"
SEQ = "seq"  # the sequence of every per-token activation (context parallelism shards it)
RESIDUAL_SEQ = "residual_seq"  # the residual stream's sequence between blocks (sequence parallelism shards it too)
EMBED = "embed"
MLP = "mlp"
EXPERT = "expert"  # the experts of a mixture-of-experts layer
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VOCAB = "vocab"
LAYERS = "layers"
CACHE_SEQ = "cache_seq"

# Mesh axis names used by the built-in strategies.
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
CONTEXT_AXIS = "context"  # one row's sequence split over devices (context parallelism)
EXPERT_AXIS = "expert"  # a mixture-of-experts model's experts split over devices (expert parallelism); data-like else
