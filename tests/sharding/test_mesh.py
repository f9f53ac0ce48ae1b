import jax
import pytest

from rpegjax.sharding import make_mesh, parse_mesh, resolve_axis_sizes


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
