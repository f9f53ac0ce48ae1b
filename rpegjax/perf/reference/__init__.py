"""Reference data of the performance model: hardware presets (`presets`, datasheet figures), measured hardware
(`calibration` measures this machine, `profile` is the file it writes) and the published runs the model is checked
against (`published_runs`). Calibration imports JAX inside its functions only."""
