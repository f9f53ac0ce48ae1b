"""`rpegjax.train.compiled_flops`: matmul FLOPs of a compiled program with every loop iteration counted, checked
against the closed form 2·m·n·k per dot (the GPU target's twin is in test_dry_run_target.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rpegjax.train.compiled_flops import CompiledFlops, compiled_flops
from rpegjax.train.dry_run import DryRunReport, ProgramMemory

M, K, LAYERS, REPEATS = 64, 48, 5, 3


def nested_scans(x, ws):
    """LAYERS x REPEATS matmuls [m k] @ [k k]: a scan over layers holding a scan of repeats."""
    def layer(h, w):
        return jax.lax.scan(lambda g, _: (jnp.tanh(g @ w), None), h, None, length=REPEATS)[0], None
    return jax.lax.scan(layer, x, ws)[0].sum()


def compile_nested_scans(devices) -> jax.stages.Compiled:
    mesh = Mesh(np.array(devices), ("rows",))
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("rows")))
    ws = jax.ShapeDtypeStruct((LAYERS, K, K), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    return jax.jit(nested_scans).lower(x, ws).compile()


def nested_scans_flops(devices: int) -> float:
    return 2.0 * (M // devices) * K * K * LAYERS * REPEATS


def test_every_iteration_of_nested_loops_is_counted_per_device():
    compiled = compile_nested_scans(jax.devices()[:2])
    assert compiled_flops(compiled) == CompiledFlops(flops=nested_scans_flops(2), exact=True)
    # XLA's own analysis counts each loop body once: the reason the dry run does not use it
    assert compiled.cost_analysis()["flops"] < nested_scans_flops(2) / REPEATS


def test_a_conditional_counts_its_costliest_branch():
    def f(flag, x, w):
        return jax.lax.cond(flag, lambda: (x @ w @ w).sum(), lambda: (x @ w).sum())

    compiled = jax.jit(f).lower(True, jnp.ones((M, K)), jnp.ones((K, K))).compile()
    assert compiled_flops(compiled) == CompiledFlops(flops=2 * (2.0 * M * K * K), exact=True)


def test_a_loop_of_unknown_length_with_matmuls_is_counted_once_as_a_lower_bound():
    def f(x, w):
        x = x @ w  # one matmul outside the loop
        return jax.lax.while_loop(lambda h: h.sum() < 1e6, lambda h: jnp.abs(h @ w) + 1.0, x)

    compiled = jax.jit(f).lower(jnp.ones((M, K)), jnp.ones((K, K))).compile()
    counted = compiled_flops(compiled)
    assert counted == CompiledFlops(flops=2 * (2.0 * M * K * K), exact=False) and counted.tera() == "≥0.00"


def test_the_dry_run_table_marks_lower_bounds_and_says_n_a_for_an_uncounted_program():
    common = dict(mesh={"fsdp": 2}, arguments=1e9, outputs=0.0, temporaries=1e9, aliased=0.0, resident=0.0,
                  compile_seconds=1.0)
    flops = [CompiledFlops(flops=2.5e12, exact=True), CompiledFlops(flops=1.25e12, exact=False), None]
    report = DryRunReport(programs=tuple(ProgramMemory(stage=f"s{i}", program="p", flops=f, **common)
                                         for i, f in enumerate(flops)), capacity_bytes=80e9, devices="2 x test")
    rows = report.table().splitlines()[3:6]
    assert [row.split("|")[-3].strip() for row in rows] == ["2.50", "≥1.25", "n/a"]
