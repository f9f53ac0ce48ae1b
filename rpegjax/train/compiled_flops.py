"""Matmul FLOPs per device of a compiled program, read from its optimised HLO with every loop iteration counted.

XLA's `cost_analysis()` counts a while loop's body once whatever its trip count (a decoder whose layers run in a
`lax.scan` reads as one layer; row micro-batches and decode steps likewise), and compile-only GPU devices have no
cost analysis at all (JAX returns None: the dry run printed 0.00 there). So the dry run counts FLOPs here, the same
way on every target, from the per-device modules the compiler produced (`runtime_executable().hlo_modules()`):
each `dot` costs 2 x (its output's elements) x (the product of its contracted dimensions), counted as many times
as the computations that hold it run — a while body its `known_trip_count` times (XLA's own annotation), a fusion's
or call's computation once per call, the costliest branch of a conditional. Element-wise work is left out: the
matmuls are what the performance model's FLOP terms count.

A loop of data-dependent length that holds dots (the causal block loop of blockwise attention, the decode chunk's
`while` that stops once every row is done) is counted once: the count is then a lower bound (`exact` False,
printed "≥"), true when such a loop runs at least once per call, as these do. The count is None (never a guess)
when the module calls a kernel whose arithmetic the HLO does not show (cuBLAS or cuDNN custom calls, Triton or
Mosaic kernels).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

# custom calls whose arithmetic the HLO does not show
_OPAQUE_CALLS = ("__cublas", "__cudnn", "__gpu$xla.gpu.triton", "__triton", "mosaic_gpu")

_HEADER = re.compile(r"^(?:ENTRY )?%([^\s(]+) \(.*\{$")
_ARRAY = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = [a-z0-9]+\[([0-9,]*)\]")
_DOT = re.compile(r"= [a-z0-9]+\[([0-9,]*)\]\S* dot\(%([^\s,)]+).*?lhs_contracting_dims=\{([0-9,]*)\}")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([^\s,})]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUSTOM = re.compile(r'custom_call_target="([^"]*)"')


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


class _Module:
    """One HLO module's text: each computation's own dot FLOPs and the computations it calls, with how often."""

    def __init__(self, text: str):
        self.own: dict[str, float] = {}
        self.calls: dict[str, list[tuple[int | None, tuple[str, ...]]]] = {}  # (times, None: unknown; callees)
        self.entry = ""
        self.opaque = any(call.startswith(_OPAQUE_CALLS) for call in _CUSTOM.findall(text))
        name, shapes = "", {}
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                name, shapes = header.group(1), {}
                self.own[name], self.calls[name] = 0.0, []
                self.entry = name if line.startswith("ENTRY") else self.entry
                continue
            if not name:  # the module's header and its stack-frame tables
                continue
            array = _ARRAY.match(line)
            if array:
                shapes[array.group(1)] = _dims(array.group(2))
            self._instruction(name, line, shapes)

    def _instruction(self, name: str, line: str, shapes: dict[str, list[int]]) -> None:
        dot = _DOT.search(line)
        if dot:
            lhs = shapes[dot.group(2)]
            contracted = math.prod(lhs[i] for i in _dims(dot.group(3)))
            self.own[name] += 2.0 * math.prod(_dims(dot.group(1))) * contracted
        callees = _CALLEE.findall(line)
        if " while(" in line:
            trip = _TRIP.search(line)
            self.calls[name].append((int(trip.group(1)) if trip else None, tuple(c for _, c in callees)))
        elif callees:
            self.calls[name].extend((1, (callee,)) for _, callee in callees)
        branches = _BRANCHES.search(line)
        if branches:  # one branch runs: the costliest is counted
            self.calls[name].append((1, tuple(b.strip().lstrip("%") for b in branches.group(1).split(","))))

    def flops(self, name: str, memo: dict[str, tuple[float, bool]]) -> tuple[float, bool]:
        """FLOPs of one run of computation `name` and all it calls, and whether exact (no loop of unknown length
        with dots: such a loop is counted once)."""
        if name not in memo:
            total, exact = self.own[name], True
            for times, callees in self.calls[name]:
                inner = [self.flops(callee, memo) for callee in callees]
                cost = max(flops for flops, _ in inner)  # a while's condition holds no dots; one branch runs
                exact = exact and all(known for _, known in inner) and (times is not None or cost == 0)
                total += (1 if times is None else times) * cost
            memo[name] = (total, exact)
        return memo[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledFlops:
    """Matmul FLOPs one device runs in one call of a program; `exact` False: a lower bound (module docstring)."""

    flops: float
    exact: bool

    def tera(self) -> str:
        """'12.34' TFLOP, '≥12.34' for a lower bound."""
        return ("" if self.exact else "≥") + f"{self.flops / 1e12:.2f}"


def compiled_flops(compiled: jax.stages.Compiled) -> CompiledFlops | None:
    """Matmul FLOPs per device of one call of `compiled` (module docstring); None when a kernel hides them."""
    total, exact = 0.0, True
    for module in compiled.runtime_executable().hlo_modules():
        parsed = _Module(module.to_string())
        if parsed.opaque:
            return None
        flops, known = parsed.flops(parsed.entry, {})
        total, exact = total + flops, exact and known
    return CompiledFlops(flops=total, exact=exact)


__all__ = ["CompiledFlops", "compiled_flops"]
