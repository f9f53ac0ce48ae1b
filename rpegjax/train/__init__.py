"""The job layer: the run configuration (`config`), building its components (`build`), the trainer loop
(`trainer`), the command line (`cli`, `overrides`), held-out evaluation, warm start, checkpoints and metrics.
"""
