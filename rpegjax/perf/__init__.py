"""The analytical performance model and the planner, in three parts:

* `model`: the cost model. Hardware specs (`hardware`) and collectives, per-stage costs (`costs`, `expert_costs`,
  `stage_costs`, `packed_batches`, the sampler's `generation_cost`, `generation_stage` and `partial_rollouts`),
  the step timeline (`schedule`, `step_model`: `predict`, `Evaluator`) and the pipeline-parallel pre-training
  model (`pretraining`). It reads graphs and model shapes; it never runs a model.
* `planner`: the search over what the runtime executes (`executable`): the space (`space`), a point of it and
  its graph (`choice`), fitting a skeleton to memory (`fitting`), the branch-and-bound search (`search`: `Planner`),
  the plans of other systems (`baselines`), which predictions it trusts (`trust`), why a plan is refused
  (`refusal`) and why the best is fast (`explain`).
* `reference`: the figures the model is fed and checked against: hardware presets from datasheets (`presets`),
  this machine's measured rates (`calibration`, written as a `profile`), and the published runs it is validated
  on (`published_runs`).
"""
