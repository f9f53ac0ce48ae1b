"""The layer stack cut into segments of one repeated unit (`kinds.stack_segments`), and state descriptions."""

import pytest

from rpegjax.models.kinds import StackSegment, StateArray, stack_segments


@pytest.mark.parametrize("stack, segments", [
    ("f" * 28, [(0, "f", 28)]),
    ("sssssf" * 10 + "ss", [(0, "sssssf", 10), (60, "s", 2)]),  # Gemma 3 27B's 62 layers
    ("lllf" * 10, [(0, "lllf", 10)]),  # Qwen3.5's 3:1 linear and full attention
    ("ddd" + "m" * 58, [(0, "d", 3), (3, "m", 58)]),  # DeepSeek-V3's first dense layers
    ("a" + "bc" * 10, [(0, "a", 1), (1, "bc", 10)]),
    ("abc", [(0, "a", 1), (1, "b", 1), (2, "c", 1)]),
])
def test_stack_segments_repeat_the_shortest_unit_that_covers_most(stack, segments):
    found = stack_segments(tuple(stack))
    assert [(s.start, "".join(s.unit), s.repeats) for s in found] == segments
    assert found[-1].stop == len(stack) and all(a.stop == b.start for a, b in zip(found, found[1:]))
    assert StackSegment(start=2, unit=("a", "b"), repeats=3).stop == 8


def test_a_positions_axis_is_refused_on_a_pool_or_the_row_axis():
    with pytest.raises(ValueError, match="positions=0 must be a non-leading axis"):
        StateArray(("batch", None), positions=0)
    with pytest.raises(ValueError, match="unpooled"):
        StateArray(("batch", None, None), positions=1, pooled=True)
