"""Meshes, logical-axis rules and shardings."""

from rpegjax.sharding.mesh import make_mesh, parse_mesh, resolve_axis_sizes
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
    "ShardingRules",
    "check_param_shardings",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "parse_mesh",
    "resolve_axis_sizes",
    "shard_state",
]
