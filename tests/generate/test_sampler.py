import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rpegjax.generate import CacheConfig, FinishReason, Sampler, SamplingConfig, stack_completions
from rpegjax.models import ModelConfig
from rpegjax.models.hf import load_pretrained
from rpegjax.models.logprobs import token_logprobs


def _responses(completions):
    return [c.response_ids.tolist() for c in completions]


# ---- equality with transformers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A random float32 Qwen2 built by transformers (biases and norms random too), saved with
    save_pretrained and loaded back as ours."""
    cfg = ModelConfig.tiny()
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg.to_hf_dict())).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.3 * torch.randn_like(parameter))
            elif "embed" in name:
                parameter.copy_(torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[1] ** 0.5)
    path = tmp_path_factory.mktemp("qwen2") / "model"
    model.save_pretrained(path)
    ours, ours_cfg = load_pretrained(path)
    return model, ours, ours_cfg


def test_greedy_tokens_and_logprobs_equal_transformers_generate(hf_pair, make_prompts):
    torch_model, ours, cfg = hf_pair
    graphdef, params = nnx.split(ours)
    sampler = Sampler(cfg, graphdef, num_slots=4, max_prompt_len=7, max_new_tokens=10, chunk_steps=4)
    prompts = make_prompts([3, 7, 5, 1], seed=1)
    greedy = SamplingConfig(max_new_tokens=10, greedy=True, ignore_eos=True)
    free_run = sampler.generate(params, prompts, greedy, key=jax.random.key(0))
    eos = free_run[1].response_ids[4].item()  # makes at least row 1 stop early on EOS
    ours_out = sampler.generate(params, prompts, greedy.replace(ignore_eos=False, eos_id=eos), key=jax.random.key(0))

    width = max(map(len, prompts))
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for transformers
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = torch_model.generate(input_ids, attention_mask=attention, max_new_tokens=10, do_sample=False,
                                   eos_token_id=eos, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[:, width:].numpy()
    torch_logprobs = torch.log_softmax(torch.stack(out.logits, dim=1), dim=-1).numpy()  # b n v
    expected = []
    for row in generated:
        stops = np.flatnonzero(row == eos)
        expected.append(row[: stops[0] + 1 if stops.size else len(row)].tolist())
    assert _responses(ours_out) == expected
    for row, completion in enumerate(ours_out):  # greedy behaviour log-probs: temperature-1 log-softmax
        n = completion.length
        np.testing.assert_allclose(completion.behaviour_logprobs,
                                   torch_logprobs[row, np.arange(n), completion.response_ids], atol=1e-4)
    assert ours_out[1].finish_reason == FinishReason.EOS and len(ours_out[1].response_ids) <= 5
    assert {c.finish_reason for c in ours_out} <= {FinishReason.EOS, FinishReason.LENGTH}


# ---- one reference run shared by several tests (compiling is the slow part) -----------------------------
FILTERED = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9)
PROMPT_LENGTHS = [3, 8, 1, 4, 6, 2, 5]
BUDGETS = [12, 2, 1, 9, 3, 12, 4]


@pytest.fixture(scope="module")
def reference(sampler, tiny_split, make_prompts):
    """7 prompts x 2 samples with budgets from 1 to 12, statically batched on the 4-slot sampler."""
    prompts = make_prompts(PROMPT_LENGTHS, seed=6)
    completions = sampler.generate_static(tiny_split[1], prompts, FILTERED, group_size=2, key=jax.random.key(3),
                                          budgets=BUDGETS)
    return prompts, completions


def test_behaviour_logprobs_equal_teacher_forced_forward(reference, tiny_model):
    """Sampled at T=0.9 with top-k and top-p on: the recorded log-probs are those of the unfiltered
    T=0.9 distribution, as a teacher-forced full forward of the same tokens computes them."""
    _, completions = reference
    batch = stack_completions(completions)
    forward = jax.jit(lambda tokens, mask: token_logprobs(tiny_model, tokens, mask=mask, temperature=0.9))(
        batch.tokens, batch.attention_mask)
    mask = batch.response_mask
    assert mask.sum() == sum(c.length for c in completions) == 2 * sum(BUDGETS)
    np.testing.assert_allclose(np.asarray(forward)[mask], batch.behaviour_logprobs[mask], atol=1e-4)


def test_continuous_equals_static_and_hands_out_early(sampler, tiny_split, reference):
    """Same run, continuously batched: slots are refilled mid-flight, yet every sequence equals the static
    run's, and short ones come out while long ones still decode."""
    prompts, static = reference
    start = sampler.stats.decode_calls
    yielded_after = []  # decode chunks run when each completion came out
    streamed = []
    for completion in sampler.stream(tiny_split[1], prompts, FILTERED, group_size=2, key=jax.random.key(3),
                                     budgets=BUDGETS):
        yielded_after.append(sampler.stats.decode_calls - start)
        streamed.append(completion)
    total = sampler.stats.decode_calls - start
    assert min(sampler.stats.chunks_per_window) < sampler.capacity  # short rows attend to part of the cache only
    assert yielded_after[0] == 1 < total  # prompt 1 (budget 2) ends within the first chunk of 3 steps
    streamed.sort(key=lambda c: c.order)
    assert [c.order for c in streamed] == [c.order for c in static] == [(p, s) for p in range(7) for s in range(2)]
    assert _responses(streamed) == _responses(static)
    for a, b in zip(streamed, static, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
        assert a.finish_reason == b.finish_reason == FinishReason.LENGTH
        assert a.length == BUDGETS[a.prompt_index]


def test_group_samples_share_one_prefill_and_differ(sampler, tiny_split, reference):
    prompts, completions = reference
    before = sampler.stats.prefilled_prompts, sampler.stats.prefill_calls
    again = sampler.generate_static(tiny_split[1], prompts[:2], FILTERED, group_size=2, key=jax.random.key(3),
                                    budgets=BUDGETS[:2])
    assert (sampler.stats.prefilled_prompts - before[0], sampler.stats.prefill_calls - before[1]) == (2, 1)
    assert [c.order for c in again] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _responses(again) == _responses(completions[:4])
    for prompt in (0, 3, 5):  # the 12- and 9-token responses of a group differ
        assert completions[2 * prompt].response_ids.tolist() != completions[2 * prompt + 1].response_ids.tolist()
    assert completions[1].prompt_ids.tolist() == prompts[0]


def test_model_token_frequencies_match_its_softmax(tiny_split):
    """A vocabulary-16 model, one prompt, 2,048 first tokens (8 prompt copies x group 256) at T=0.8 with
    top-p 0.9: Pearson chi-square p-value > 1e-3 against the model's filtered softmax, < 1e-6 against its
    plain T=1 softmax, and nothing drawn outside the top-p set."""
    from scipy import stats

    from rpegjax.generate import filter_logits
    from rpegjax.models import Decoder

    cfg = ModelConfig.tiny(vocab_size=16)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    sampler = Sampler(cfg, graphdef, num_slots=256, max_prompt_len=4, max_new_tokens=1)
    prompt = [3, 14, 7]
    config = SamplingConfig(max_new_tokens=1, temperature=0.8, top_p=0.9)
    completions = sampler.generate(params, [prompt] * 8, config, group_size=256, key=jax.random.key(9))
    counts = np.bincount([c.response_ids[0] for c in completions], minlength=16)
    logits = np.asarray(model(np.array([prompt]))[0, -1], np.float64)
    filtered = np.asarray(filter_logits(np.asarray(logits / 0.8, np.float32)[None], top_p=0.9))[0].astype(np.float64)
    probs = np.exp(filtered - filtered.max())
    probs /= probs.sum()
    plain = np.exp(logits - logits.max())
    plain /= plain.sum()
    support = probs > 0
    assert support.sum() < 16 and counts[~support].sum() == 0
    assert stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue > 1e-3
    assert stats.chisquare(counts, plain * counts.sum()).pvalue < 1e-6


# ---- stops, finish reasons, determinism ---------------------------------------------------------------
def _eos_and_stop(row0: list[int], row1: list[int]) -> tuple[int, int, int, int]:
    """From two free-run responses, tokens under which row 0 ends at EOS (from its 3rd token on) and row 1 at a stop
    token after at least one other: (eos, stop, row 0's length, row 1's length). Searched, as the draws decide
    which tokens appear where."""
    for at0 in range(2, len(row0)):
        eos = row0[at0]
        end0 = row0.index(eos) + 1
        for at1 in range(1, len(row1)):
            stop = row1[at1]
            if stop not in row0[:end0] and stop not in row1[:at1] and eos not in row1[:at1 + 1]:
                return eos, stop, end0, at1 + 1
    raise AssertionError(f"no EOS and stop tokens end rows {row0} and {row1} apart")


def test_eos_and_stop_ids_end_each_row_where_they_first_appear(sampler, tiny_split, reference):
    """Per-row keys make the stopped run a prefix of the free run, so the expected cut is known: with an EOS token
    from row 0's response and a stop token from row 1's, row 0 ends at EOS, row 1 at the stop token, each where it
    first appears, and every other row as its free run says."""
    prompts, completions = reference
    free = completions[:4]  # prompts 0 and 1 (budgets 12 and 2), two samples each
    eos, stop, end0, end1 = _eos_and_stop(free[0].response_ids.tolist(), free[1].response_ids.tolist())
    config = FILTERED.replace(eos_id=eos, stop_ids=(stop,))
    stopped = sampler.generate(tiny_split[1], prompts[:2], config, group_size=2, key=jax.random.key(3),
                               budgets=BUDGETS[:2])
    for before, after in zip(free, stopped, strict=True):
        ids = before.response_ids.tolist()
        cut = next((i for i, t in enumerate(ids) if t in (eos, stop)), None)
        if cut is None:
            assert after.response_ids.tolist() == ids and after.finish_reason == FinishReason.LENGTH
        else:
            assert after.response_ids.tolist() == ids[: cut + 1]
            assert after.finish_reason == (FinishReason.EOS if ids[cut] == eos else FinishReason.STOP)
        np.testing.assert_allclose(after.behaviour_logprobs, before.behaviour_logprobs[: after.length], atol=1e-6)
    assert (stopped[0].finish_reason, stopped[0].length) == (FinishReason.EOS, end0)
    assert (stopped[1].finish_reason, stopped[1].length) == (FinishReason.STOP, end1)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_stop_sequences_end_each_row_where_its_response_first_ends_with_one(layout, tiny_cfg, tiny_split, reference):
    """Multi-token stops (a closing tag split into several tokens): the stopped run is the free run cut right
    after the first place where the response ends with a stop sequence; EOS and one-token stops still apply."""
    prompts, completions = reference
    free = completions[:4]
    first, second = free[0].response_ids.tolist(), free[2].response_ids.tolist()
    sequences = (tuple(first[3:5]), tuple(second[1:4]))  # 2 and 3 tokens, from two different rows' responses
    config = FILTERED.replace(stop_sequences=sequences)
    # a sampler of its own: a stop table is a new program, which the shared sampler's compile counts must not see
    sampler = Sampler(tiny_cfg, tiny_split[0], num_slots=4, max_prompt_len=8, max_new_tokens=12, chunk_steps=3,
                      window_step=8, cache=CacheConfig.paged(page_size=4) if layout == "paged" else None)
    stopped = sampler.generate(tiny_split[1], prompts[:2], config, group_size=2, key=jax.random.key(3),
                               budgets=BUDGETS[:2])
    cuts = []
    for before, after in zip(free, stopped, strict=True):
        ids = before.response_ids.tolist()
        cut = next((i for i in range(len(ids)) for seq in sequences
                    if i + 1 >= len(seq) and tuple(ids[i + 1 - len(seq): i + 1]) == seq), None)
        cuts.append(cut)
        if cut is None:
            assert after.response_ids.tolist() == ids and after.finish_reason == FinishReason.LENGTH
        else:
            assert after.response_ids.tolist() == ids[: cut + 1] and after.finish_reason == FinishReason.STOP
        np.testing.assert_allclose(after.behaviour_logprobs, before.behaviour_logprobs[: after.length], atol=1e-6)
    assert cuts[0] is not None and cuts[0] <= 4 and cuts[2] is not None and cuts[2] <= 3  # both sequences stopped


def test_same_key_same_samples_other_key_other_samples(sampler, tiny_split, reference):
    prompts, completions = reference
    kwargs = dict(group_size=2, budgets=BUDGETS[:2])
    again = sampler.generate(tiny_split[1], prompts[:2], FILTERED, key=jax.random.key(3), version=7, **kwargs)
    other = sampler.generate(tiny_split[1], prompts[:2], FILTERED, key=jax.random.key(4), **kwargs)
    assert _responses(again) == _responses(completions[:4]) != _responses(other)
    assert [c.version for c in again] == [7] * 4 and other[0].version is None


def test_programs_compile_once_per_shape(sampler, tiny_split, reference):
    prompts, _ = reference
    list(sampler.stream(tiny_split[1], prompts, FILTERED.replace(temperature=0.5), group_size=2, key=jax.random.key(8),
                        budgets=BUDGETS))  # other temperature and key: traced values, no new program
    counts = sampler.compile_counts()
    assert counts["decode"] == len(sampler.stats.chunks_per_shape)  # one per (window, live bucket)
    assert len(sampler.stats.chunks_per_window) <= 3  # windows 8, 16, 20
    assert {bucket for _, bucket in sampler.stats.chunks_per_shape} <= {1, 2, 4}
    assert counts["admit"] <= 2  # buckets of 1 and 2 prompts, group 2


# ---- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "match"),
    [
        ([[1, 2], []], {}, ValueError, "prompt 1 is empty"),
        ([], {}, ValueError, "non-empty list"),
        ([[1] * 9], {}, ValueError, "prompt 0 has 9 tokens, more than the sampler's max_prompt_len=8"),
        ([[1, 128]], {}, ValueError, r"prompt 0 has token ids outside \[0, 128\)"),
        ([[1.5, 2.0]], {}, ValueError, "prompt 0 holds non-integer"),
        ([[1, 2]], dict(sampling=SamplingConfig(max_new_tokens=13)), ValueError, "exceeds the sampler's max_new_tokens=12"),
        ([[1, 2]], dict(group_size=5), ValueError, "group_size=5 exceeds num_slots=4"),
        ([[1, 2]], dict(group_size=0), ValueError, "group_size must be a positive integer"),
        ([[1, 2]], dict(budgets=[13]), ValueError, r"budgets\[0\] must be an integer in \[1, max_new_tokens=4\]"),
        ([[1, 2]], dict(budgets=[2, 3]), ValueError, "budgets has 2 entries for 1 prompts"),
        ([[1, 2]], dict(sampling=SamplingConfig(max_new_tokens=4, stop_ids=(500,))), ValueError, "stop_ids: 500"),
        ([[1, 2]], dict(key=0), TypeError, "key must be a JAX PRNG key"),
    ],
)
def test_bad_input_raises_clear_errors(sampler, tiny_split, prompts, kwargs, error, match):
    arguments = dict(sampling=SamplingConfig(max_new_tokens=4), key=jax.random.key(0)) | kwargs
    sampling = arguments.pop("sampling")
    with pytest.raises(error, match=match):
        sampler.generate(tiny_split[1], prompts, sampling, **arguments)


def test_bad_sampler_shape_raises(tiny_cfg, tiny_split):
    with pytest.raises(ValueError, match="num_slots must be a positive integer, got 0"):
        Sampler(tiny_cfg, tiny_split[0], num_slots=0, max_prompt_len=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        Sampler(tiny_cfg.replace(max_position_embeddings=16), tiny_split[0], num_slots=2, max_prompt_len=8,
                max_new_tokens=9)


# ---- sharding ---------------------------------------------------------------------------------------------
def test_sharded_sampler_equals_unsharded(tiny_cfg, tiny_split, reference):
    """data 4 x tensor 2 on 8 devices, parameters moved from an FSDP x TP training layout, continuous batching:
    the same sequences as the unsharded static reference run."""
    from jax.sharding import PartitionSpec

    from rpegjax.generate import generation_rules, reshard_params
    from rpegjax.sharding import ShardingRules, make_mesh, shard_state

    graphdef, params = tiny_split
    prompts, expected = reference
    train = shard_state(params, make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), ShardingRules.fsdp_tp())
    mesh = make_mesh({"data": 4, "tensor": 2})
    sharded = Sampler(tiny_cfg, graphdef, num_slots=4, max_prompt_len=8, max_new_tokens=12, chunk_steps=3, mesh=mesh)
    assert sharded.new_state().cache.layers[0].k.sharding.spec == PartitionSpec("data", "tensor", None, None)
    with pytest.raises(ValueError, match="not in the sampler's layout.*reshard_params"):
        sharded.stream(train, prompts, FILTERED, key=jax.random.key(3))  # still in the training layout
    got = sharded.generate(reshard_params(train, mesh, generation_rules()), prompts, FILTERED, group_size=2,
                           key=jax.random.key(3), budgets=BUDGETS)
    assert _responses(got) == _responses(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)


@pytest.mark.parametrize("mesh_sizes", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_slots_split_over_every_axis_but_tensor(tiny_cfg, tiny_split, mesh_sizes):
    """No device repeats another's slots: 16 slots on 4 slot replicas x tensor 2 leave 4 per device."""
    from rpegjax.generate import usable_slots
    from rpegjax.sharding import make_mesh

    mesh = make_mesh(mesh_sizes)
    sampler = Sampler(tiny_cfg, tiny_split[0], num_slots=16, max_prompt_len=4, max_new_tokens=4, mesh=mesh)
    state = sampler.new_state()
    for array in (state.cache.layers[0].k, state.cache.lengths, state.tokens, state.done):
        assert {shard.data.shape[0] for shard in array.addressable_shards} == {16 // 4}
    # heads split over tensor: each device holds one of the 2 KV heads
    assert {shard.data.shape[1] for shard in state.cache.layers[0].k.addressable_shards} == {1}
    with pytest.raises(ValueError, match=r"num_slots=6 does not split over the 4 slot replicas.*multiple of 4"):
        Sampler(tiny_cfg, tiny_split[0], num_slots=6, max_prompt_len=4, max_new_tokens=4, mesh=mesh)
    assert usable_slots(14, 2, mesh) == 12 and usable_slots(14, 3, mesh) == 12 and usable_slots(6, 2, None) == 6
    with pytest.raises(ValueError, match="3 slots cannot hold a group of 2 on each of 4 slot replicas"):
        usable_slots(3, 2, mesh)
