"""Generation with the experts split over an `expert` mesh axis (8 virtual devices): a tiny Qwen3-MoE's tokens and
behaviour log-probs equal the unsharded sampler's, greedy and sampled with a fixed key, for both KV-cache layouts,
dropless (the all-gather exchange of CPU meshes) and capped; each device holds only its experts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from rpegjax.generate import (
    CacheConfig,
    Sampler,
    SamplingConfig,
    generation_rules,
    reshard_params,
)
from rpegjax.models import Architecture, Decoder, ModelConfig
from rpegjax.sharding import ShardingRules, make_mesh, shard_state

PROMPT_LENGTHS = [3, 7, 5, 1, 6, 2]
GREEDY = SamplingConfig(max_new_tokens=10, greedy=True, ignore_eos=True)
SAMPLED = SamplingConfig(max_new_tokens=10, temperature=1.0, top_k=20, ignore_eos=True)
PAGED = CacheConfig.paged(page_size=16, pages_per_replica=4)  # two pages per sequence: few page windows to compile
# (cache, capacity factor, mesh, samplings): the contiguous cache on data x expert, the paged one with the experts'
# width split over tensor too; the capacity mode sampled only (each sampling compiles its own programs)
CASES = {"contiguous-dropless": (None, None, {"data": 2, "expert": 4}, (GREEDY, SAMPLED)),
         "paged-dropless": (PAGED, None, {"data": 2, "expert": 2, "tensor": 2}, (GREEDY, SAMPLED)),
         "paged-capacity": (PAGED, 1.0, {"expert": 4, "tensor": 2}, (SAMPLED,))}


@pytest.fixture(scope="module")
def moe(randomize):
    """A tiny Qwen3-MoE with 8 experts (top 2), random weights; its graphdefs dropless and capped."""
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE, eos_token_id=None, num_experts=8)
    graphdef, params = nnx.split(randomize(Decoder(cfg, rngs=nnx.Rngs(0)), seed=0))
    return cfg, graphdef, params


def _generate(cfg, graphdef, params, cache, samplings, mesh=None):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    sampler = Sampler(cfg, graphdef, num_slots=16, max_prompt_len=8, max_new_tokens=10, chunk_steps=4, mesh=mesh,
                      cache=cache)
    if mesh is not None:  # from a training layout, as weight sync moves them
        train = shard_state(params, make_mesh({"fsdp": 2, "expert": 4}), ShardingRules.fsdp_tp())
        params = reshard_params(train, mesh, sampler.rules)
    return sampler, params, [sampler.generate(params, prompts, sampling, group_size=2, key=jax.random.key(3))
                             for sampling in samplings]


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "paged-capacity" else case
                                  for case in sorted(CASES)])  # the capacity mode's exchange: test_expert_parallel
def test_expert_parallel_sampler_equals_unsharded(moe, case):
    cache, capacity_factor, sizes, samplings = CASES[case]
    cfg, graphdef, params = moe
    if capacity_factor is not None:
        cfg = cfg.replace(moe_capacity_factor=capacity_factor)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    _, _, expected = _generate(cfg, graphdef, params, cache, samplings)
    sampler, placed, got = _generate(cfg, graphdef, params, cache, samplings, make_mesh(sizes))
    # each device holds its experts only (and its slice of their width under tensor)
    tensor = "tensor" if "tensor" in sizes else None
    assert placed["layers"][0]["mlp"]["gate_proj"].get_value().sharding.spec == PartitionSpec("expert", None, tensor)
    assert sampler.replicas == 8 // sizes.get("tensor", 1)
    for sampling, ours, theirs in zip(samplings, got, expected, strict=True):
        assert [c.response_ids.tolist() for c in ours] == [c.response_ids.tolist() for c in theirs], sampling
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, err_msg=str(sampling))
        if not sampling.greedy:  # the samples of a prompt differ
            assert len({tuple(c.response_ids.tolist()) for c in ours}) > len(PROMPT_LENGTHS)


def test_generation_rules_split_experts_only_over_a_batch_axis():
    """The expert axis splits the experts when it splits the slots; otherwise the experts stay whole."""
    from rpegjax.sharding import axes

    assert generation_rules().params[axes.EXPERT] == "expert"
    assert generation_rules().activations[axes.EXPERT] == "expert"
    assert axes.EXPERT not in generation_rules(batch_axes=("data",)).params


def test_experts_the_expert_axis_does_not_divide_are_refused():
    """4 experts over expert=8: the sampler names the kernel and the axis instead of replicating the experts."""
    cfg = ModelConfig.tiny(Architecture.QWEN3_MOE)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"\['mlp'\]\['\w+_proj'\].*\('expert', size 4\) is not divisible by mesh axes \('expert',\)"):
        Sampler(cfg, graphdef, num_slots=8, max_prompt_len=4, max_new_tokens=4, mesh=make_mesh({"expert": 8}))
