"""Generation from a policy with LoRA adapters: the base model on merged weights (W + s A B) gives the same greedy
tokens and log-probs as the adapted model decoding x W + s (x A) B."""

import jax
import numpy as np
from flax import nnx

from rpegjax.generate import Sampler, SamplingConfig
from rpegjax.models.lora import LoRAConfig, LoRAParam, merge_adapters


def test_merged_generation_equals_adapter_generation(tiny_model, make_prompts):
    lora = LoRAConfig(rank=4, alpha=8.0)
    adapted = tiny_model.with_lora(lora, seed=1)
    rng = np.random.default_rng(4)
    for _, variable in nnx.to_flat_state(nnx.state(adapted, LoRAParam)):  # a trained adapter: B != 0
        variable.set_value(0.3 * rng.standard_normal(variable.get_value().shape).astype(np.float32))
    params = nnx.state(adapted)
    base = adapted.without_lora()
    shape = dict(num_slots=4, max_prompt_len=7, max_new_tokens=12, chunk_steps=4)
    with_adapters = Sampler(adapted.cfg, nnx.graphdef(adapted), lora=lora, **shape)
    merged = Sampler(base.cfg, nnx.graphdef(base), **shape)
    prompts = make_prompts([3, 7, 5, 1], seed=1)
    greedy = SamplingConfig(max_new_tokens=12, greedy=True, ignore_eos=True)
    ours = with_adapters.generate(params, prompts, greedy, key=jax.random.key(0))
    theirs = merged.generate(jax.jit(lambda p: merge_adapters(p, lora.scale))(params), prompts, greedy,
                             key=jax.random.key(0))
    plain = merged.generate(nnx.state(base), prompts, greedy, key=jax.random.key(0))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-4)
    # the adapters change what is generated
    assert any(not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(ours, plain))
