"""The analytical performance model and planner: hardware specs and calibration (`hardware`), collectives,
per-stage costs (`costs`, `stage_costs`, `generation_cost`), the step timeline (`schedule`, `step_model`), the
planner (`planner`), the pipeline-parallel pre-training model (`pretraining`) and the published measurements it
is checked against (`validation`).

It reads graphs and model shapes; it never runs a model (calibration aside, which times small kernels).
"""
