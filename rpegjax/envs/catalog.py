"""The built-in environments a run chooses by name (`--env`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from rpegjax.envs.calculator import calculator_environment
from rpegjax.envs.protocol import TaggedToolEnvironment
from rpegjax.envs.python_sandbox import (
    PythonSandbox,
    SandboxConfig,
    SandboxIsolation,
    python_environment,
)


class EnvironmentName(enum.StrEnum):
    NONE = "none"  # single-turn rollouts
    CALCULATOR = "calculator"  # `rpegjax.envs.calculator`
    PYTHON_SANDBOX = "python-sandbox"  # `rpegjax.envs.python_sandbox` (opt-in: runs model-written code)


def make_environment(name: EnvironmentName | str, *, tags: Sequence[str] = (),
                     sandbox_isolation: SandboxIsolation | str = SandboxIsolation.BUBBLEWRAP,
                     ) -> TaggedToolEnvironment | None:
    """The environment `name` (None for `none`). `tags`: (call start, call end, result start, result end) to
    replace the environment's own (e.g. a model's own tool tags); () keeps the environment's. `sandbox_isolation`:
    the Python sandbox's (`rpegjax.envs.python_sandbox.SandboxIsolation`)."""
    name = EnvironmentName(name)
    if name == EnvironmentName.NONE:
        return None
    if tags and len(tags) != 4:
        raise ValueError(f"tool tags must be 4 strings (call start, call end, result start, result end), got {tags!r}")
    if name == EnvironmentName.CALCULATOR:
        env = calculator_environment()
    else:
        env = python_environment(PythonSandbox(SandboxConfig(isolation=sandbox_isolation)))
    if not tags:
        return env
    call_start, call_end, result_start, result_end = tags
    return TaggedToolEnvironment(name=env.name, tool=env.tool, call_start=call_start, call_end=call_end,
                                 result_start=result_start, result_end=result_end,
                                 instructions=env.instructions.replace(env.call_start, call_start)
                                 .replace(env.call_end, call_end).replace(env.result_start, result_start)
                                 .replace(env.result_end, result_end))
