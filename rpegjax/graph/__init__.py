"""The RPEG (RLM Pipeline Execution Graph): IR, builders, transforms and traces.

`ir` defines stages, versioned edges and placements (read its module docstring for the version
convention); `builders` gives the standard GRPO/PPO graphs; `transforms` rewrites graphs for the planner;
`trace` records measured or predicted timelines.
"""

from rpegjax.graph.builders import ALL_PLACEMENT, grpo_graph, ppo_graph
from rpegjax.graph.ir import (
    HOST_PLACEMENT,
    INFERENCE_KINDS,
    PARAMS_PREFIX,
    UPDATE_KINDS,
    Algorithm,
    CriticMode,
    Edge,
    Execution,
    Graph,
    GraphError,
    Payload,
    Placement,
    Role,
    Stage,
    StageKind,
    is_params_payload,
)
from rpegjax.graph.transforms import (
    bounded_async,
    default_fusion,
    fuse,
    microbatch,
    place,
    share_actor_critic,
)

__all__ = [
    "ALL_PLACEMENT", "Algorithm", "CriticMode", "Edge", "Execution", "Graph", "GraphError", "HOST_PLACEMENT", "INFERENCE_KINDS",
    "PARAMS_PREFIX", "Payload", "Placement", "Role", "Stage", "StageKind", "UPDATE_KINDS", "bounded_async",
    "default_fusion", "fuse", "grpo_graph", "is_params_payload", "microbatch", "place", "ppo_graph",
    "share_actor_critic",
]
