"""The execution options: one definition of each choice, whose values are the strings saved plans and configs hold."""

import ast
import json
import pathlib

import pytest

from rpegjax.graph.ir import Execution, GraphError
from rpegjax.options import AttentionKind, CacheLayout, DType, RematPolicy, parse_choice

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "rpegjax"
OPTIONS = (AttentionKind, RematPolicy, CacheLayout, DType)


def test_values_are_the_saved_strings():
    # plan files (`execution`), run configs (`model.*`, `rollout.kv_cache`) and config.json hold these: never rename
    assert [k.value for k in AttentionKind] == ["dense", "blockwise", "cudnn"]
    assert [r.value for r in RematPolicy] == ["none", "dots", "full"]
    assert [c.value for c in CacheLayout] == ["contiguous", "paged"]
    assert [d.value for d in DType] == ["float32", "bfloat16", "float16"]


def _string_enums(path: pathlib.Path) -> dict[str, frozenset[str]]:
    """Classes of `path` whose body assigns only string constants (an enum's members), by their value sets."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        values = [statement.value.value for statement in node.body
                  if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant)
                  and isinstance(statement.value.value, str)]
        if values:
            found[node.name] = frozenset(values)
    return found


def test_no_other_module_defines_an_execution_option_again():
    owned = {frozenset(member.value for member in kind): kind.__name__ for kind in OPTIONS}
    copies = [f"{path.relative_to(PACKAGE)}: {name} repeats {owned[values]}"
              for path in PACKAGE.rglob("*.py") if path.parent.name != "options"
              for name, values in _string_enums(path).items() if values in owned]
    assert not copies, copies


def test_execution_holds_members_and_writes_plain_strings():
    execution = Execution(attention="cudnn", remat="dots", kv_cache="paged", param_dtype="float32", dtype="bfloat16")
    assert execution.attention is AttentionKind.CUDNN and execution.remat is RematPolicy.DOTS
    assert execution.kv_cache is CacheLayout.PAGED and execution.dtype is DType.BFLOAT16
    written = execution.to_dict()
    assert all(type(written[name]) is str for name in ("attention", "remat", "kv_cache", "param_dtype", "dtype"))
    assert Execution.from_dict(json.loads(json.dumps(written))) == execution
    with pytest.raises(GraphError, match=r"Execution.remat must be one of \['none', 'dots', 'full'\], got 'some'"):
        Execution(remat="some")


def test_parse_choice_names_the_field_and_the_choices():
    assert parse_choice(DType, "bfloat16", "x") is DType.BFLOAT16
    with pytest.raises(ValueError, match=r"Section.kv_cache must be one of \['contiguous', 'paged'\], got 'ring'"):
        parse_choice(CacheLayout, "ring", "Section.kv_cache")


def test_kernel_properties():
    assert [d.itemsize for d in DType] == [4, 2, 2]
    assert AttentionKind.CUDNN.compute_dtypes == (DType.BFLOAT16, DType.FLOAT16)
    assert AttentionKind.BLOCKWISE.compute_dtypes == tuple(DType)
    assert [k.skips_causal_blocks for k in AttentionKind] == [False, True, True]
