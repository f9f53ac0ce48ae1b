"""Models shared by the learner tests: building one eagerly costs seconds of CPU, so build each once."""

import pytest
from flax import nnx

from rpegjax.models import Decoder, ModelConfig


@pytest.fixture(scope="session")
def tiny_model() -> Decoder:
    """2 layers, d=64, vocab 128, with a value head (unused by GRPO). Tests must not modify it."""
    return Decoder(ModelConfig.tiny(value_head=True), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def tiny_critic() -> Decoder:
    return Decoder(ModelConfig.tiny(value_head=True), rngs=nnx.Rngs(1))
