"""Decoder models, value head, checkpoint I/O and tokenizers."""

from rpegjax.models.config import Architecture, Llama3RopeScaling, ModelConfig
from rpegjax.models.transformer import Decoder, KVCache, default_positions

__all__ = ["Architecture", "Decoder", "KVCache", "Llama3RopeScaling", "ModelConfig", "default_positions"]
