"""The cost model: what one RL step of a graph costs on a hardware spec (time per stage, memory per device, the
predicted timeline), from formulas over model shapes; it never runs a model. `step_model` is its entry point
(`predict`, `Evaluator`)."""
