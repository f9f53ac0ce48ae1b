"""α–β costs of collectives on a device hierarchy (bandwidth-optimal hierarchical algorithms).

A collective runs over a `Group`: `size` devices at indices base + i·stride (one mesh axis; the last mesh axis
has stride 1). Each level of the hierarchy contributes the members of one unit of that level that are not
already inside a unit of the level below: `factors(group)` = (n_0, n_1, ...) with prod = size.

Costs (S in bytes, B_i the per-device bandwidth at level i, α_i its latency):
* all-reduce (reduce-scatter inside the node, all-reduce of S/n_0 across nodes, ..., all-gather back):
    T = Σ_i 2 (n_i − 1)/n_i · S_i / B_i + 2 (n_i − 1) α_i,   S_0 = S,  S_{i+1} = S_i / n_i.
  With one level this is the ring all-reduce 2 (n−1)/n · S/B + 2 (n−1) α.
* all-gather (S = gathered output per device) and reduce-scatter (S = input per device): half of that.
* all-to-all (S = bytes each device holds, S/n to every member): members outside the level-below unit are
  reached over level i, all levels concurrently:  T = max_i (S · out_i / n) / B_i + Σ_i out_i α_i.
* point-to-point: S / B + α on the level that contains both ends.
* one-shot all-reduce inside one unit of the first level (a serving engine's custom kernel for small messages,
  vLLM's `custom_all_reduce`: a barrier, every device reading its n − 1 peers' buffers, a barrier):
    T = 3 α_0 + (n − 1) · S / B_0.
On a full-mesh level a device drives one link per peer (`Level.device_bandwidth`).
"""

from __future__ import annotations

import dataclasses

from rpegjax.perf.model.hardware import HardwareSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """`size` devices spaced `stride` apart (device indices base, base + stride, ...)."""

    size: int
    stride: int = 1

    def __post_init__(self) -> None:
        for name in ("size", "stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Group.{name} must be a positive integer, got {value!r}")


def factors(hardware: HardwareSpec, group: Group) -> tuple[float, ...]:
    """Members of `group` added at each level: (inside one node, nodes per rack, racks, ...); prod = size.

    Integers for the usual power-of-two layouts; a group that does not tile a level evenly gets a fractional
    factor (an average), which the formulas accept.
    """
    out: list[float] = []
    inside = 1  # members inside one unit of the previous level
    for index, level in enumerate(hardware.levels):
        last = index == len(hardware.levels) - 1
        members = group.size if last else max(inside, min(group.size, max(1, level.size // group.stride)))
        out.append(members / inside)
        inside = members
    return tuple(int(f) if float(f).is_integer() else f for f in out)


def _check(num_bytes: float, hardware: HardwareSpec, group: Group) -> tuple[float, ...]:
    if num_bytes < 0:
        raise ValueError(f"collective size must be >= 0 bytes, got {num_bytes!r}")
    return factors(hardware, group)


def all_reduce_seconds(num_bytes: float, hardware: HardwareSpec, group: Group) -> float:
    """Hierarchical all-reduce of `num_bytes` per device (see module docstring)."""
    if group.size == 1 or num_bytes == 0:
        return 0.0
    total, size = 0.0, float(num_bytes)
    for level, n in zip(hardware.levels, _check(num_bytes, hardware, group)):
        if n > 1:
            total += 2 * (n - 1) / n * size / level.device_bandwidth(n - 1) + 2 * (n - 1) * level.latency
            size /= n
    return total


def all_reduce_latency(hardware: HardwareSpec, group: Group) -> float:
    """The α part of `all_reduce_seconds` (its seconds at 0 bytes): the rest grows linearly with the bytes."""
    if group.size == 1:
        return 0.0
    return sum(2 * (n - 1) * level.latency for level, n in zip(hardware.levels, factors(hardware, group)) if n > 1)


def inside_first_level(hardware: HardwareSpec, group: Group) -> bool:
    """Whether every member of `group` sits in one unit of the first level (one node)."""
    return factors(hardware, group)[0] == group.size


def one_shot_all_reduce_seconds(num_bytes: float, hardware: HardwareSpec, group: Group) -> float:
    """One-shot all-reduce of `num_bytes` per device inside one node (see module docstring); ValueError for a group
    that spans nodes (the kernel reads its peers' memory over NVLink)."""
    if group.size == 1 or num_bytes == 0:
        return 0.0
    _check(num_bytes, hardware, group)
    peers = group.size - 1
    return one_shot_all_reduce_latency(hardware, group) + peers * num_bytes / hardware.levels[0].device_bandwidth(peers)


def one_shot_all_reduce_latency(hardware: HardwareSpec, group: Group) -> float:
    """The α part of `one_shot_all_reduce_seconds`: two barriers and the reads, 3 α of the first level."""
    if group.size == 1:
        return 0.0
    if not inside_first_level(hardware, group):
        level = hardware.levels[0]
        raise ValueError(f"a one-shot all-reduce runs inside one {level.name} of {level.size} devices; this group of "
                         f"{group.size} (stride {group.stride}) spans more")
    return 3 * hardware.levels[0].latency


def all_gather_seconds(num_bytes: float, hardware: HardwareSpec, group: Group) -> float:
    """Hierarchical all-gather producing `num_bytes` on every device (each contributes num_bytes / size)."""
    if group.size == 1 or num_bytes == 0:
        return 0.0
    total, size = 0.0, float(num_bytes)
    for level, n in zip(hardware.levels, _check(num_bytes, hardware, group)):
        if n > 1:
            total += (n - 1) / n * size / level.device_bandwidth(n - 1) + (n - 1) * level.latency
            size /= n
    return total


def reduce_scatter_seconds(num_bytes: float, hardware: HardwareSpec, group: Group) -> float:
    """Hierarchical reduce-scatter of `num_bytes` per device (each keeps num_bytes / size); costs as all-gather."""
    return all_gather_seconds(num_bytes, hardware, group)


def all_to_all_seconds(num_bytes: float, hardware: HardwareSpec, group: Group) -> float:
    """All-to-all where every device holds `num_bytes` and sends num_bytes / size to each member."""
    if group.size == 1 or num_bytes == 0:
        return 0.0
    per_member = num_bytes / group.size
    slowest, latency, inside = 0.0, 0.0, 1
    for level, n in zip(hardware.levels, _check(num_bytes, hardware, group)):
        reached = inside * n
        outside = reached - inside  # members first reached at this level
        if outside:
            slowest = max(slowest, per_member * outside / level.device_bandwidth(outside))
            latency += outside * level.latency
        inside = reached
    return slowest + latency


def all_to_all_latency(hardware: HardwareSpec, group: Group) -> float:
    """The α part of `all_to_all_seconds` (Σ_i out_i α_i): the rest grows linearly with the bytes."""
    if group.size == 1:
        return 0.0
    latency, inside = 0.0, 1
    for level, n in zip(hardware.levels, factors(hardware, group)):
        latency += (inside * n - inside) * level.latency
        inside *= n
    return latency


def point_to_point_seconds(num_bytes: float, hardware: HardwareSpec, level_index: int) -> float:
    """One message of `num_bytes` over one link of level `level_index`."""
    if num_bytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {num_bytes!r}")
    if not 0 <= level_index < len(hardware.levels):
        raise ValueError(f"level index {level_index} out of range for {len(hardware.levels)} levels of {hardware.name!r}")
    level = hardware.levels[level_index]
    return num_bytes / level.bandwidth + level.latency
