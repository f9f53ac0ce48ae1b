"""Shared tiny models and samplers for the generation tests (module-scoped: compiling is the slow part)."""

import numpy as np
import pytest
from flax import nnx

from rpegjax.generate import Sampler
from rpegjax.models import Decoder, ModelConfig


@pytest.fixture(scope="package")
def tiny_cfg() -> ModelConfig:
    return ModelConfig.tiny(eos_token_id=None)


@pytest.fixture(scope="package")
def tiny_model(tiny_cfg, randomize) -> Decoder:
    return randomize(Decoder(tiny_cfg, rngs=nnx.Rngs(0)), seed=0)


@pytest.fixture(scope="package")
def tiny_split(tiny_model):
    return nnx.split(tiny_model)


@pytest.fixture(scope="package")
def sampler(tiny_cfg, tiny_split) -> Sampler:
    """4 slots, prompts up to 8 tokens, up to 12 new tokens, chunks of 3 steps, attention windows 8, 16, 20."""
    return Sampler(tiny_cfg, tiny_split[0], num_slots=4, max_prompt_len=8, max_new_tokens=12, chunk_steps=3,
                   window_step=8)


@pytest.fixture(scope="package")
def make_prompts(tiny_cfg):
    """Random prompts of the given lengths over the tiny vocabulary."""
    def make(lengths, seed: int = 0) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, tiny_cfg.vocab_size, n).tolist() for n in lengths]

    return make
