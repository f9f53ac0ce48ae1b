"""Meshes, logical-axis rules and shardings."""

from rpegjax.sharding.mesh import (
    Granule,
    hybrid_device_grid,
    make_hybrid_mesh,
    make_mesh,
    parse_mesh,
    resolve_axis_sizes,
    split_across_granules,
)
from rpegjax.sharding.rules import (
    ActivationSharding,
    ShardingRules,
    check_param_shardings,
    constrain,
    logical_to_spec,
    param_shardings,
    param_specs,
    shard_state,
)

__all__ = [
    "ActivationSharding",
    "Granule",
    "ShardingRules",
    "check_param_shardings",
    "constrain",
    "hybrid_device_grid",
    "logical_to_spec",
    "make_hybrid_mesh",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "parse_mesh",
    "resolve_axis_sizes",
    "shard_state",
    "split_across_granules",
]
