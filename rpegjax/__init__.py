"""rpegjax: JAX-native RL training of reasoning language models, driven by the RLM Pipeline Execution Graph."""

__version__ = "0.1.0"
