"""The single controller that executes an RPEG, cut along the data flow: the one step loop (`controller`) takes each
step's rollout from a source (`sources`: a worker thread, inline, or received from another process group), made by
the rollout stage (`rollout_stage`, with dynamic sampling's groups in `sampled_groups`) and scored by the scorer
(`scoring`: rewards, shaping, reward metrics), and hands it to the step executor (`executor`), which runs the
graph's other stages and publishes each weights version (`publishing`). Around them: the stage programs they
dispatch (`programs`: rollout, training and weight-sync parts, each able to lower its compiled programs), the versioned parameter store (`versions`), placement -> mesh (`meshes`), arrays between
process groups (`transfers`), the roles of processes in a disaggregated run and what crosses between them (`roles`;
a generation process's side in `sending`), the one set-up path of learner and sampler (`assembly`) and JAX's
persistent compilation cache for a job (`compilation_cache`).

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
