"""rpegjax: JAX-native RL training of reasoning language models, driven by the RLM Pipeline Execution Graph.

`rpegjax.GRPOTrainer(...).train()` / `rpegjax.PPOTrainer` run the training job from Python
(`rpegjax.train.api`); they are imported on first use, so `import rpegjax` stays light."""

__version__ = "0.1.0"

_API = ("GRPOTrainer", "PPOTrainer", "TrainResult")


def __getattr__(name: str):
    if name in _API:
        from rpegjax.train import api

        return getattr(api, name)
    raise AttributeError(f"module 'rpegjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
