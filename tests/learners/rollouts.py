"""A small GRPO batch shared by the learner tests: 8 rows of random prompts (2-5 tokens) and responses (2-9
tokens) over the tiny vocabulary, padded to 16, with behaviour log-probs and rewards of two groups of 4."""

import numpy as np

from rpegjax.learners.batch import TrainBatch, pack_rollouts

B, G, LENGTH = 8, 4, 16


def make_batch(seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 128, size=rng.integers(2, 6))) for _ in range(B)]
    responses = [list(rng.integers(1, 128, size=rng.integers(2, 10))) for _ in range(B)]
    behaviour = [rng.normal(-4.8, 0.3, size=len(r)) for r in responses]
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], np.float32)
    return pack_rollouts(prompts, responses, behaviour, pad_id=0, length=LENGTH, rewards=rewards)
