"""The package layout shows the architecture: dependencies between sub-packages flow one way.

Read from the source with `ast` (nothing is imported): every `import rpegjax.x...` / `from rpegjax.x... import`
in `rpegjax/<package>/` is an edge package -> x. Imports inside functions count too: a late import hides a
cycle, it does not remove it.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "rpegjax"
TESTS = pathlib.Path(__file__).resolve().parent

# What each sub-package may import (besides itself). Lower layers never import upper ones.
ALLOWED = {
    "options": set(),  # execution options (attention, remat, KV-cache layout, dtypes): plain Python, for every layer
    "sharding": set(),
    "models": {"options", "sharding", "distributed"},  # distributed: the barrier of a collective export
    "data": set(),
    "rewards": {"data"},
    "distributed": {"sharding"},  # below models: process collectives, no model
    "generate": {"options", "models", "sharding"},
    "envs": {"generate", "rewards", "data"},  # multi-turn episodes: tools, their environments, the sampler's feed
    "learners": {"options", "models", "sharding", "graph"},  # graph: the RPEG's vocabulary (CriticMode), pure Python
    "graph": {"options"},
    "perf": {"options", "graph", "models"},
    "runtime": {"options", "graph", "learners", "generate", "rewards", "data", "models", "sharding", "distributed",
                "envs"},
    "train": {"options", "runtime", "envs", "graph", "perf", "learners", "generate", "rewards", "data", "models",
              "sharding", "distributed"},
}
# Third-party modules a layer must not need: the RPEG is plain Python, the perf model never runs a model
# (its calibration imports JAX lazily, inside the function that times kernels).
FORBIDDEN_TOP_LEVEL = {"options": {"jax", "flax", "optax", "numpy"}, "graph": {"jax", "flax", "optax", "numpy"},
                       "perf": {"flax", "optax"}}
# Packages whose tests build what they test from the layers below, never through an upper layer's set-up path:
# the runtime's tests run the runtime on their own small setup (tests/runtime/tiny_setup.py), not through the job.
TESTS_MUST_NOT_IMPORT = {"runtime": {"train"}}


def _imports(path: pathlib.Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "rpegjax":  # `from rpegjax import distributed`
                names.update(f"rpegjax.{alias.name}" for alias in node.names)
    return names


def package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue  # rpegjax/__init__.py re-exports; it belongs to no layer
        source = parts[0]
        for name in _imports(path):
            pieces = name.split(".")
            if pieces[0] == "rpegjax" and len(pieces) > 1 and pieces[1] != source:
                edges.setdefault(source, set()).add(pieces[1])
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_package_is_placed():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), "add new sub-packages to ALLOWED with the layers they may import"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside any sub-package: {loose}"


def test_no_cycle_between_packages():
    assert find_cycle(package_edges()) is None


def test_dependencies_flow_one_way():
    wrong = {f"{source} -> {target}" for source, targets in package_edges().items()
             for target in targets - ALLOWED[source]}
    assert not wrong, f"imports against the layering: {sorted(wrong)}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN_TOP_LEVEL))
def test_layer_does_not_need(package):
    found = {f"{path.name}: {name}" for path in (PACKAGE / package).rglob("*.py")
             for name in _imports(path, top_level_only=True) if name.split(".")[0] in FORBIDDEN_TOP_LEVEL[package]}
    assert not found, f"rpegjax/{package} imports {sorted(found)}"


def upper_layer_imports(tests: pathlib.Path, forbidden: set[str]) -> set[str]:
    """`file: module` for every import of `rpegjax.<forbidden package>` in the Python files of `tests`."""
    return {f"{path.name}: {name}" for path in sorted(tests.glob("*.py")) for name in _imports(path)
            if name.split(".")[:1] == ["rpegjax"] and name.split(".")[1:2] and name.split(".")[1] in forbidden}


@pytest.mark.parametrize("package", sorted(TESTS_MUST_NOT_IMPORT))
def test_tests_build_without_upper_layers(package):
    found = upper_layer_imports(TESTS / package, TESTS_MUST_NOT_IMPORT[package])
    assert not found, f"tests/{package} imports {sorted(found)}"


def test_the_test_import_rule_sees_late_and_package_imports(tmp_path):
    (tmp_path / "test_a.py").write_text("def f():\n    from rpegjax.train.build import build\n")
    (tmp_path / "b.py").write_text("from rpegjax import train\nimport rpegjax.trainer_free\nimport rpegjax.runtime\n")
    assert upper_layer_imports(tmp_path, {"train"}) == {"test_a.py: rpegjax.train.build", "b.py: rpegjax.train"}


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# Every collective over processes lives in `distributed/collectives.py`, as programs over one device per process:
# `jax.experimental.multihost_utils` assumes that every process holds as many devices, so no module uses it.
MULTIHOST_UTILS_USERS: set[str] = set()


def _uses_multihost_utils(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "jax.experimental":
            if any(alias.name == "multihost_utils" for alias in node.names):
                return True
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(name.startswith("jax.experimental.multihost_utils") for name in names):
                return True
    return False


def test_no_module_talks_to_multihost_utils():
    users = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _uses_multihost_utils(path)}
    stray = sorted(users - MULTIHOST_UTILS_USERS)
    assert not stray, f"collectives over processes belong in distributed/collectives.py: {stray}"


# Sizes: a function over 80 lines does several things, a class over 300 lines is several objects.
# Nested functions count as functions. Keys are `path: qualified name`, without line numbers.
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300
OVERSIZED_ALLOWED: set[str] = set()  # none: a function or class past the limits is split, not listed


def oversized(root: pathlib.Path) -> dict[str, int]:
    """`path: qualified name` -> lines, for every function over MAX_FUNCTION_LINES and every class over
    MAX_CLASS_LINES in the Python files under `root`."""
    found = {}

    def visit(node: ast.AST, path: str, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = scope + (child.name,)
                lines = child.end_lineno - child.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    found[f"{path}: {'.'.join(name)}"] = lines
                visit(child, path, name)
            else:
                visit(child, path, scope)

    for file in sorted(root.rglob("*.py")):
        visit(ast.parse(file.read_text(), filename=str(file)), file.relative_to(root).as_posix(), ())
    return found


def test_no_function_over_80_lines_and_no_class_over_300():
    found = oversized(PACKAGE)
    new = {key: lines for key, lines in found.items() if key not in OVERSIZED_ALLOWED}
    assert not new, f"split these (lines): {new}"
    stale = sorted(OVERSIZED_ALLOWED - set(found))
    assert not stale, f"no longer oversized: remove {stale} from OVERSIZED_ALLOWED"


def test_the_size_rule_sees_nested_functions_methods_and_classes(tmp_path):
    def block(header: str, lines: int, indent: str = "") -> str:  # a definition of exactly `lines` lines
        return f"{indent}{header}\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))

    (tmp_path / "a.py").write_text("def outer():\n" + block("def inner():", 81, "    ")
                                   + block("async def fits():", 80))
    (tmp_path / "b.py").write_text(block("class Big:", 301) + block("class Fits:", 300)
                                   + block("class Host:", 2) + block("def method(self):", 81, "    "))
    assert oversized(tmp_path) == {"a.py: outer": 82, "a.py: outer.inner": 81, "b.py: Big": 301,
                                   "b.py: Host.method": 81}
