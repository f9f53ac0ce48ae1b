"""The single controller that executes an RPEG: the step loop and its threads (`controller`), the stage programs
it dispatches (`programs`), the versioned parameter store (`versions`) and placement -> mesh (`meshes`).

This package is the one place that dispatches stages, moves arrays between device sets and reshards weights.
"""

from rpegjax.runtime.controller import Runtime, StepResult
from rpegjax.runtime.meshes import stage_mesh
from rpegjax.runtime.programs import StagePrograms
from rpegjax.runtime.versions import ParameterStore, RuntimeStopped

__all__ = ["ParameterStore", "Runtime", "RuntimeStopped", "StagePrograms", "StepResult", "stage_mesh"]
