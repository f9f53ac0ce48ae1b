"""The single controller that executes an RPEG: the step loop and its threads (`controller`), the stage programs
it dispatches (`programs`: rollout, training and weight-sync parts, each able to lower its compiled programs), the versioned parameter store (`versions`) placement -> mesh (`meshes`), arrays between
process groups (`transfers`), the roles of processes in a disaggregated run and what crosses between them (`roles`)
and JAX's persistent compilation cache for a job (`compilation_cache`).

This package is the one place that dispatches stages, moves arrays between device sets and reshards weights.
"""

from rpegjax.runtime.compilation_cache import default_compilation_cache_dir, enable_compilation_cache
from rpegjax.runtime.controller import Runtime, StepResult
from rpegjax.runtime.meshes import stage_mesh
from rpegjax.runtime.programs import StagePrograms
from rpegjax.runtime.versions import ParameterStore, RuntimeStopped

__all__ = [
    "ParameterStore",
    "Runtime",
    "RuntimeStopped",
    "StagePrograms",
    "StepResult",
    "default_compilation_cache_dir",
    "enable_compilation_cache",
    "stage_mesh",
]
