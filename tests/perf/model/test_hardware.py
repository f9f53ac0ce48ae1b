"""Hardware hierarchy, presets and α–β collective costs against hand-computed values."""

import math

import pytest

from rpegjax.perf.model import collectives
from rpegjax.perf.model.collectives import Group
from rpegjax.perf.model.hardware import GB, DeviceSpec, HardwareSpec, Level, Topology
from rpegjax.perf.reference import presets


def _two_level(node_bandwidth=100 * GB, network_bandwidth=10 * GB, alpha_node=1e-6, alpha_net=5e-6, topology=Topology.SWITCH):
    device = DeviceSpec(name="d", peak_flops={"bfloat16": 1e15}, memory_bytes=80 * GB, memory_bandwidth=2000 * GB)
    return HardwareSpec(name="two-level", device=device, num_devices=32, levels=(
        Level(name="node", size=4, bandwidth=node_bandwidth, latency=alpha_node, topology=topology),
        Level(name="cluster", size=32, bandwidth=network_bandwidth, latency=alpha_net)))


def test_ring_all_reduce_on_one_level_is_the_textbook_formula():
    hw = _two_level()
    size = 3e8
    for n in (2, 4):
        expected = 2 * (n - 1) / n * size / (100 * GB) + 2 * (n - 1) * 1e-6
        assert collectives.all_reduce_seconds(size, hw, Group(size=n)) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_across_nodes_is_hierarchical():
    hw = _two_level()
    size = 1e9
    # 16 devices, stride 1: 4 inside each node, then 4 nodes over the network carrying size / 4 each
    expected = (2 * 3 / 4 * size / (100 * GB) + 2 * 3 * 1e-6) + (2 * 3 / 4 * (size / 4) / (10 * GB) + 2 * 3 * 5e-6)
    assert collectives.all_reduce_seconds(size, hw, Group(size=16)) == pytest.approx(expected, rel=1e-12)
    # one device per node (stride 4): everything crosses the network
    expected_strided = 2 * 7 / 8 * size / (10 * GB) + 2 * 7 * 5e-6
    assert collectives.all_reduce_seconds(size, hw, Group(size=8, stride=4)) == pytest.approx(expected_strided, rel=1e-12)


def test_all_reduce_latency_is_the_part_that_does_not_grow_with_the_bytes():
    hw = _two_level()
    for group in (Group(size=4), Group(size=16), Group(size=8, stride=4), Group(size=1)):
        latency = collectives.all_reduce_latency(hw, group)
        one, two = (collectives.all_reduce_seconds(size, hw, group) for size in (1e8, 2e8))
        assert one - latency == pytest.approx(two - one, rel=1e-9, abs=1e-15)
    assert collectives.all_reduce_latency(hw, Group(size=16)) == pytest.approx(2 * 3 * 1e-6 + 2 * 3 * 5e-6)


def test_one_shot_all_reduce_reads_every_peer_inside_one_node():
    """vLLM's custom kernel: two barriers and a read of each of the n - 1 peers' buffers over the node's links."""
    hw = _two_level()
    size = 2e5
    for n in (2, 4):
        expected = 3 * 1e-6 + (n - 1) * size / (100 * GB)
        assert collectives.one_shot_all_reduce_seconds(size, hw, Group(size=n)) == pytest.approx(expected, rel=1e-12)
        assert collectives.one_shot_all_reduce_latency(hw, Group(size=n)) == pytest.approx(3e-6)
    assert collectives.one_shot_all_reduce_seconds(size, hw, Group(size=1)) == 0.0
    assert collectives.inside_first_level(hw, Group(size=4)) and not collectives.inside_first_level(hw, Group(size=8))
    assert not collectives.inside_first_level(hw, Group(size=2, stride=4))
    for group in (Group(size=8), Group(size=2, stride=4)):
        with pytest.raises(ValueError, match="inside one node of 4 devices"):
            collectives.one_shot_all_reduce_seconds(size, hw, group)


def test_the_h100_preset_records_the_memory_cuda_reports():
    device = presets.h100_node().device
    assert device.memory_bytes == 80 * GB and device.reported_memory_bytes == 84_942_979_072
    assert presets.gh200_quad().device.reported_memory_bytes == presets.gh200_quad().device.memory_bytes
    with pytest.raises(ValueError, match="cuda_memory_bytes must be positive"):
        DeviceSpec(name="d", peak_flops={"bfloat16": 1e15}, memory_bytes=GB, memory_bandwidth=GB, cuda_memory_bytes=0)


def test_gather_scatter_are_half_an_all_reduce_and_trivial_groups_are_free():
    hw = _two_level()
    group = Group(size=16)
    assert collectives.all_gather_seconds(1e9, hw, group) == pytest.approx(collectives.all_reduce_seconds(1e9, hw, group) / 2)
    assert collectives.reduce_scatter_seconds(1e9, hw, group) == collectives.all_gather_seconds(1e9, hw, group)
    assert collectives.all_reduce_seconds(1e9, hw, Group(size=1)) == 0.0


def test_full_mesh_node_drives_one_link_per_peer():
    hw = _two_level(node_bandwidth=150 * GB, topology=Topology.FULL_MESH)
    size = 1e9
    expected = 2 * 3 / 4 * size / (3 * 150 * GB) + 2 * 3 * 1e-6
    assert collectives.all_reduce_seconds(size, hw, Group(size=4)) == pytest.approx(expected, rel=1e-12)
    assert collectives.point_to_point_seconds(size, hw, 0) == pytest.approx(size / (150 * GB) + 1e-6)


def test_all_to_all_is_bounded_by_the_network_share():
    hw = _two_level()
    size = 8e8  # each device holds size, sends size/8 to each of 7 others; 4 of them are in other nodes
    expected = max(3 * size / 8 / (100 * GB), 4 * size / 8 / (10 * GB)) + 3 * 1e-6 + 4 * 5e-6
    assert collectives.all_to_all_seconds(size, hw, Group(size=8)) == pytest.approx(expected, rel=1e-12)


def test_group_factors_follow_the_hierarchy():
    hw = presets.gh200_quad(256)
    assert collectives.factors(hw, Group(size=8)) == (4, 2, 1)
    assert collectives.factors(hw, Group(size=64, stride=4)) == (1, 8, 8)
    assert math.prod(collectives.factors(hw, Group(size=6))) == pytest.approx(6)


def test_presets_carry_the_datasheet_figures_and_hierarchy():
    gh = presets.preset("gh200", 256)
    assert gh.device.memory_bytes == 96 * GB and gh.device.memory_bandwidth == 4000 * GB
    assert gh.device.flops("bfloat16") == 989e12
    assert [level.size for level in gh.levels] == [4, 32, 256]
    assert gh.levels[0].topology is Topology.FULL_MESH and gh.levels[0].bandwidth == 150 * GB
    assert gh.levels[1].bandwidth == 25 * GB
    assert gh.level_index(0, 3) == 0 and gh.level_index(3, 4) == 1 and gh.level_index(0, 200) == 2
    h100 = presets.preset("h100", 16)
    assert h100.node_size == 8 and h100.levels[1].bandwidth == 50 * GB
    assert presets.preset("gh200-nvl32", 64).levels[0].size == 32
    assert presets.preset("h200", 8).device.memory_bytes == 141 * GB
    gb = presets.preset("gb200-nvl72", 144)  # two NVL72 racks: 186 GB HBM3e at 8 TB/s, 2.5 PFLOP/s dense BF16
    assert gb.device.memory_bytes == 186 * GB and gb.device.memory_bandwidth == 8000 * GB
    assert gb.device.flops("bfloat16") == 2500e12 and gb.device.flops("float32") == 1250e12
    assert [level.size for level in gb.levels] == [72, 144] and gb.levels[0].bandwidth == 900 * GB
    assert gb.level_index(0, 71) == 0 and gb.level_index(71, 72) == 1
    assert presets.preset("gh200", 8).with_devices(1024).levels[-1].size >= 1024


def test_bad_specs_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'"):
        presets.preset("tpu", 8)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        DeviceSpec(name="x", peak_flops={"bfloat16": 1.0}, memory_bytes=1, memory_bandwidth=1, matmul_efficiency=1.5)
    device = DeviceSpec(name="x", peak_flops={"bfloat16": 1.0}, memory_bytes=1, memory_bandwidth=1)
    with pytest.raises(ValueError, match="larger multiple"):
        HardwareSpec(name="h", device=device, num_devices=8, levels=(Level(name="a", size=4, bandwidth=1, latency=0),
                                                                     Level(name="b", size=6, bandwidth=1, latency=0)))
    with pytest.raises(ValueError, match="fewer than num_devices=16"):
        HardwareSpec(name="h", device=device, num_devices=16, levels=(Level(name="a", size=8, bandwidth=1, latency=0),))
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'int8'"):
        device.flops("int8")
    with pytest.raises(ValueError, match="Group.size"):
        Group(size=0)
