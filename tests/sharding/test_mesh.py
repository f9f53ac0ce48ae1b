import dataclasses

import jax
import numpy as np
import pytest

from rpegjax.sharding import (
    Granule,
    hybrid_device_grid,
    make_hybrid_mesh,
    make_mesh,
    parse_mesh,
    resolve_axis_sizes,
    split_across_granules,
)


def test_make_mesh_named_sizes():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.devices.size == len(jax.devices()) == 8


def test_wildcard_takes_the_rest():
    assert resolve_axis_sizes({"data": -1, "tensor": 2}, 8) == {"data": 4, "tensor": 2}
    assert dict(make_mesh({"data": 1, "fsdp": -1}).shape) == {"data": 1, "fsdp": 8}


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"data": 3, "tensor": 2}, "has 6 devices but 8 are available"),
        ({"data": -1, "tensor": 3}, "not divisible by 3"),
        ({"data": -1, "tensor": -1}, "at most one mesh axis may be -1"),
        ({"data": 0, "tensor": 8}, "'data' has size 0"),
        ({}, "at least one axis"),
    ],
)
def test_bad_meshes_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(sizes)


def test_parse_mesh():
    assert parse_mesh("data=2, fsdp=-1,tensor=2") == {"data": 2, "fsdp": -1, "tensor": 2}
    with pytest.raises(ValueError, match="not an integer"):
        parse_mesh("data=two")
    with pytest.raises(ValueError, match="name=size"):
        parse_mesh("data")


# ---- meshes that follow the hardware ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the hybrid layout reads of a device: its id, host process and slice (no real device needed)."""

    id: int
    process_index: int
    slice_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def fake_devices(granules: int, per_granule: int, *, interleaved: bool = False) -> list[FakeDevice]:
    """`granules` hosts of `per_granule` devices; `interleaved` lists them round-robin (not grouped by host)."""
    devices = [FakeDevice(g * per_granule + i, g, g) for g in range(granules) for i in range(per_granule)]
    return sorted(devices, key=lambda d: (d.id % per_granule, d.process_index)) if interleaved else devices


@pytest.mark.parametrize("granule", [Granule.PROCESS, Granule.SLICE])
def test_hybrid_grid_keeps_tensor_inside_a_host_and_splits_hosts_over_the_slowest_axes(granule):
    devices = fake_devices(4, 2, interleaved=True)  # listed round-robin: a plain reshape would mix hosts in tensor
    grid = hybrid_device_grid({"data": 2, "fsdp": 2, "tensor": 2}, devices, granule=granule)
    assert grid.shape == (2, 2, 2)
    hosts = np.vectorize(lambda d: d.process_index)(grid)
    assert (hosts == hosts[..., :1]).all()  # every tensor group is inside one host
    np.testing.assert_array_equal(hosts[..., 0], [[0, 1], [2, 3]])  # data, then fsdp, across hosts
    assert sorted(d.id for d in grid.flat) == list(range(8))
    plain = np.array(devices, dtype=object).reshape(2, 2, 2)
    assert not (np.vectorize(lambda d: d.process_index)(plain) == np.vectorize(lambda d: d.process_index)(plain)[..., :1]).all()


@pytest.mark.parametrize(
    "sizes, granules, per_granule, across, within, outer",
    [
        ({"data": 4, "tensor": 2}, 4, 2, None, {"data": 1, "tensor": 2}, {"data": 4, "tensor": 1}),
        ({"data": 2, "fsdp": 4, "tensor": 2}, 4, 4, None, {"data": 1, "fsdp": 2, "tensor": 2},
         {"data": 2, "fsdp": 2, "tensor": 1}),
        ({"data": 2, "fsdp": 4, "tensor": 2}, 4, 4, {"fsdp": 4}, {"data": 2, "fsdp": 1, "tensor": 2},
         {"data": 1, "fsdp": 4, "tensor": 1}),
        ({"data": -1, "tensor": 4}, 2, 8, None, {"data": 2, "tensor": 4}, {"data": 2, "tensor": 1}),
        ({"data": 8}, 1, 8, None, {"data": 8}, {"data": 1}),
    ],
)
def test_split_across_granules(sizes, granules, per_granule, across, within, outer):
    assert split_across_granules(sizes, granules, per_granule, across=across) == (within, outer)


@pytest.mark.parametrize(
    "sizes, granules, per_granule, across, message",
    [
        ({"data": 2, "tensor": 4}, 4, 2, None, r"does not factor over 4 granules of 2 devices.*'tensor': 4.* inside one"),
        ({"data": 3, "tensor": 2}, 2, 3, None, "does not factor over 2 granules of 3 devices"),
        ({"data": 2, "tensor": 4}, 4, 2, {"tensor": 2}, "'tensor' must stay inside one granule"),
        ({"data": 4, "tensor": 2}, 4, 2, {"data": 3}, "'data' of size 4 cannot span 3 granules"),
        ({"data": 8}, 4, 2, {"fsdp": 2}, r"unknown axes \['fsdp'\]"),
        ({"data": 3, "tensor": 2}, 4, 2, None, "has 6 devices but 8 are available"),
    ],
)
def test_hybrid_mesh_that_does_not_factor_is_refused_naming_the_axes(sizes, granules, per_granule, across, message):
    with pytest.raises(ValueError, match=message):
        split_across_granules(sizes, granules, per_granule, across=across)


def test_hybrid_grid_refuses_unequal_granules_and_devices_without_slices():
    uneven = fake_devices(2, 2) + [FakeDevice(4, 2, 2)]
    with pytest.raises(ValueError, match=r"different numbers of the devices \(\{0: 2, 1: 2, 2: 1\}\)"):
        hybrid_device_grid({"data": 5}, uneven)
    with pytest.raises(ValueError, match="has no slice_index; use granule='process'"):
        hybrid_device_grid({"data": 8}, jax.devices(), granule=Granule.SLICE)  # CPU devices have no slices


def test_hybrid_mesh_of_one_process_is_the_plain_mesh():
    assert (make_hybrid_mesh({"data": 2, "tensor": 4}).devices == make_mesh({"data": 2, "tensor": 4}).devices).all()
