"""The planner: searches structure and execution of an RPEG together and returns executable graphs, ranked.

`space` holds the choices, `choice` a point of them and its graph, `fitting` what each skeleton's memory allows,
`search` the branch-and-bound search (`Planner`), `baselines` the plans of verl and ReaL; `executable` says what
the runtime can run, `trust` which predicted memory the planner believes, `refusal` and `explain` say why in words.
"""

from rpegjax.perf.planner.baselines import real_like, verl_like
from rpegjax.perf.planner.choice import Plan, PlanChoice, build_graph
from rpegjax.perf.planner.search import Planner, PlanResult, generation_slot_busy
from rpegjax.perf.planner.space import SLOT_TOLERANCE, PlanSpace, expert_axis_sizes, layouts

__all__ = ["SLOT_TOLERANCE", "Plan", "PlanChoice", "PlanResult", "PlanSpace", "Planner", "build_graph",
           "expert_axis_sizes", "generation_slot_busy", "layouts", "real_like", "verl_like"]
