"""benchmarks/bench_matmul_shapes.py's step bound: the W-small step's matmul calls counted from the per-call times."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    path = os.path.join(ROOT, "benchmarks", "bench_matmul_shapes.py")
    spec = importlib.util.spec_from_file_location("bench_matmul_shapes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_bound_counts_each_pass_calls():
    """Every call 1 s: a forward is 4 layers x (7 projections + 2 attention dots) + the output layer = 37 calls; a
    backward 4 x (2 x 7 transposed dots + 4 attention dots) + 2 = 74; a decode step 4 x 7 + 1 = 29 calls, 64 steps
    (XLA's loop times LOOP calls), after a prefill of a third of a forward."""
    bench = _bench()
    times = {name: {"wall": 1.0, "cpu": 2.0} for name in bench.SHAPES}
    times.update({name + " (loop)": {"wall": float(bench.LOOP), "cpu": 2.0 * bench.LOOP}
                  for name in bench.SHAPES if name.startswith("decode")})
    wall = bench.step_matmul_seconds(times, "wall")
    assert wall == pytest.approx({"update": 37 + 74, "log-probs": 37, "generation": 37 / 3 + 64 * 29})
    assert bench.step_matmul_seconds(times, "cpu")["update"] == pytest.approx(2 * 111)
    # a weight gradient measured faster with x.T copied first counts at that time; torch has no such variant
    times["down X.T@dY [T,1024]Tx[T,256] (x.T copied)"] = {"wall": 0.5, "cpu": 1.0}
    assert bench.step_matmul_seconds(times, "wall")["update"] == pytest.approx(111 - 4 * 0.5)
    del times["decode down [32,1024]x[1024,256] (loop)"]  # per call where no loop was measured (torch)
    assert bench.step_matmul_seconds(times, "wall")["generation"] == pytest.approx(37 / 3 + 64 * 29)
