"""The partial-rollouts model (`rpegjax.perf.model.partial_rollouts`): steps worked out by hand, the staleness bound,
and the per-step counts against what the real sampler counts under the real partial runtime."""

import itertools

import numpy as np
import pytest

from rpegjax.perf.model.costs import DecodeKernel
from rpegjax.perf.model.generation_cost import DecodeStepCost
from rpegjax.perf.model.partial_rollouts import PartialSchedule, PartialSimulation, PrefillCost

# a decode step costs 10 s, a prefill 1 s per context token: step seconds are readable by hand
TEN_PER_STEP = DecodeStepCost(seconds_per_row=0.0, seconds_per_key=0.0, memory_seconds_fixed=0.0,
                              memory_seconds_per_row=0.0, memory_seconds_per_key=0.0, fixed_seconds=10.0,
                              prefill_seconds=0.0)
PER_TOKEN = PrefillCost(seconds_fixed=0.0, seconds_per_token=1.0, seconds_per_pair=0.0)


def _simulation(lengths, **schedule) -> PartialSimulation:
    queue = iter(lengths)
    fields = dict(group_size=1, groups_per_step=2, inflight_batches=2, max_token_lag=2, async_bound=0, slots=2,
                  prompt=1, capacity=100, chunk=1)
    return PartialSimulation(PartialSchedule(**{**fields, **schedule}), lambda: np.array([next(queue)]),
                             kernel=DecodeKernel.PAGED, cost=TEN_PER_STEP, prefill=PER_TOKEN)


def test_two_steps_worked_out_by_hand():
    """Slots 2, one-sample groups of lengths 5, 2, 2, 2, 2, ... (the prefill samples a sequence's first token,
    each decode step one more). Step 0: A (5) and B (2) start; B ends after step 0, C takes its slot; the second
    complete group (C) ends the step after 2 decode steps; A is carried with 3 tokens, D never started. Step 1:
    A re-prefills prompt + 3 tokens and D starts; both end after one decode step."""
    simulation = _simulation(itertools.chain([5], itertools.repeat(2)))
    first = simulation.step()
    assert (first.decode_steps, first.live_row_steps, first.decoded_tokens, first.trained_tokens) == (2, 4, 7, 4)
    assert (first.seconds, first.carried_sequences, first.reprefill_tokens, first.lag_max) == (2 * 10 + 3, 0, 0, 0)
    assert first.finish_fractions == (0.5, 1.0)
    second = simulation.step()
    assert (second.decode_steps, second.live_row_steps, second.decoded_tokens, second.trained_tokens) == (1, 2, 4, 7)
    assert (second.seconds, second.carried_sequences, second.reprefill_tokens) == (10 + (1 + 3) + 1, 1, 3)
    assert (second.lag_token_sum, second.lag_max) == (3.0, 1)  # A's 3 tokens of step 0 lag one version


def test_kept_pages_carry_without_a_prefill():
    """carry_pages: the same two steps, but A continues from its kept pages at step 1: no prefill of prompt + 3
    tokens (only D's prompt is prefilled); the decode work is the same."""
    simulation = _simulation(itertools.chain([5], itertools.repeat(2)), carry_pages=True)
    first = simulation.step()
    assert (first.decode_steps, first.seconds, first.reprefill_tokens) == (2, 2 * 10 + 3, 0)
    second = simulation.step()
    assert (second.decode_steps, second.live_row_steps, second.decoded_tokens, second.trained_tokens) == (1, 2, 4, 7)
    assert (second.seconds, second.carried_sequences, second.reprefill_tokens) == (10 + 1, 1, 0)


def test_a_due_group_is_waited_for_and_no_token_lags_beyond_the_bound():
    """max_token_lag 1 with k = 0: a group may be carried once. A (6) is carried out of step 0 and due at step 1,
    which waits for it (3 more decode steps) although C completed after one; C, complete, is step 2's batch
    without decoding."""
    simulation = _simulation(itertools.chain([6], itertools.repeat(2)), groups_per_step=1, max_token_lag=1)
    first = simulation.step()
    assert (first.decode_steps, first.trained_tokens) == (1, 2)
    second = simulation.step()
    assert (second.decode_steps, second.trained_tokens, second.carried_sequences, second.lag_max) == (3, 6, 1, 1)
    third = simulation.step()
    assert (third.decode_steps, third.trained_tokens, third.decoded_tokens) == (0, 2, 0)
    for _ in range(20):
        assert simulation.step().lag_max <= 1


@pytest.mark.parametrize("kernel", [DecodeKernel.LIVE, DecodeKernel.STATIC])
def test_rows_decoded_follow_the_kernel(kernel):
    """LIVE decodes the running rows padded to a power of two at each chunk's start; STATIC every slot."""
    simulation = _simulation(itertools.chain([7, 7, 3], itertools.repeat(7)), slots=8, chunk=2)
    simulation.kernel = kernel
    outcome = simulation.step()  # 4 sequences from step 0, one ends after 2 steps: 3 running, 4 rows
    assert (outcome.decode_steps, outcome.live_row_steps) == (6, 2 * 4 + 4 * 3)
    assert outcome.decoded_row_steps == {DecodeKernel.STATIC: 8 * 6, DecodeKernel.LIVE: 4 * 6}[kernel]
    # a running row's own keys at decode step t: prompt (1) + t + 2; whatever the kernel reads
    assert outcome.live_key_steps == sum(3 * (t + 3) for t in range(6)) + sum(t + 3 for t in range(2))
    # STATIC: every slot's capacity; LIVE: 4 rows over the longest row's window at each chunk's start (prompt +
    # chunk end + 1 = 4, 6, 8 keys) rounded up to a power of two (4, 8, 8), two steps a chunk
    assert outcome.decoded_key_steps == {DecodeKernel.STATIC: 8 * 100 * 6, DecodeKernel.LIVE: 2 * 4 * (4 + 8 + 8)}[kernel]


def test_the_paged_decode_reads_only_live_keys():
    """PAGED: each running row's own keys, nothing else (the live-token share of the KV reads is 1)."""
    outcome = _simulation(itertools.chain([7, 7, 3], itertools.repeat(7)), slots=8, chunk=2).step()
    assert outcome.decoded_key_steps == outcome.live_key_steps == 3 * 33 + 7


# ------------------------------------------------------------------------- against the runtime's counts
GROUP, BATCH, SLOTS, CHUNK, PROMPT, BUDGET, STEPS = 2, 2, 4, 2, 4, 32, 10


def _runtime_counts():
    """The real partial runtime (`rpegjax.runtime.partial_rollouts`, `max_token_lag` 2, k = 0, two batches in
    flight) over a real sampler (4 slots, chunks of 2 steps, live buckets) for STEPS steps: per step the sampler's
    counts (`SamplerStats`), and every group's response lengths by prompt (a few more steps finish the groups
    still in flight). A stop id in 8 ends a response: lengths of mean ~8 with a tail to the budget of 32."""
    import jax
    from flax import nnx

    from rpegjax.generate import Sampler, SamplingConfig
    from rpegjax.models import Decoder, ModelConfig
    from rpegjax.runtime.partial_rollouts import PartialRolloutConfig, PartialRollouts

    cfg = ModelConfig.tiny(eos_token_id=None)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    sampler = Sampler(cfg, graphdef, num_slots=SLOTS, max_prompt_len=PROMPT, max_new_tokens=BUDGET,
                      chunk_steps=CHUNK, window_step=8)
    sampling = SamplingConfig(max_new_tokens=BUDGET, temperature=1.0, stop_ids=tuple(range(0, cfg.vocab_size, 8)))
    partial = PartialRollouts(PartialRolloutConfig(max_token_lag=2), sampler=sampler, sampling=sampling,
                              group_size=GROUP, batch_size=BATCH, async_bound=0)
    taken, lengths, counts = [], {}, []

    def take_batch():
        taken.extend(range(len(taken), len(taken) + BATCH))
        return taken[-BATCH:]

    rng = np.random.default_rng(0)
    for step in range(STEPS + 3):
        partial.fill(take_batch, lambda examples: [rng.integers(1, cfg.vocab_size, PROMPT).tolist() for _ in examples])
        stats = sampler.stats
        before = (stats.decode_steps, stats.live_row_steps, stats.decoded_row_steps)
        groups, _ = partial.run_step(step, step, params, jax.random.fold_in(jax.random.key(1), step))
        counts.append(tuple(now - then for now, then in zip(
            (stats.decode_steps, stats.live_row_steps, stats.decoded_row_steps), before, strict=True)))
        lengths.update({g.example: np.array([len(s.tokens) for s in g.samples]) for g in groups})
    return counts[:STEPS], [lengths.get(example) for example in taken]


def test_the_model_counts_what_the_runtime_sampler_counts_on_the_same_lengths():
    """The simulation, fed the response lengths the runtime sampled (in the order it took the prompts), predicts
    each step's decode steps, running rows and rows decoded (live buckets) as the runtime's sampler counts them:
    totals within 10%, the median step within 10%, and the slot occupancy within 0.05."""
    counts, lengths = _runtime_counts()
    queue = iter(lengths)
    started_unknown = []

    def new_group():
        group = next(queue)
        if group is None:  # never trained by the runtime: it never started it
            started_unknown.append(True)
            return np.full(GROUP, BUDGET)
        return group

    simulation = PartialSimulation(
        PartialSchedule(group_size=GROUP, groups_per_step=BATCH, inflight_batches=2, max_token_lag=2, async_bound=0,
                        slots=SLOTS, prompt=PROMPT, capacity=PROMPT + BUDGET, chunk=CHUNK),
        new_group, kernel=DecodeKernel.LIVE, cost=TEN_PER_STEP, prefill=PER_TOKEN)
    predicted = [simulation.step() for _ in range(STEPS)]
    predicted = np.array([(p.decode_steps, p.live_row_steps, p.decoded_row_steps) for p in predicted], dtype=float)
    measured = np.array(counts, dtype=float)
    totals = predicted.sum(0) / measured.sum(0) - 1
    assert np.all(np.abs(totals) <= 0.10), (predicted.tolist(), measured.tolist())
    per_step = np.abs(predicted - measured) / np.maximum(measured, 1)
    assert np.all(np.median(per_step, axis=0) <= 0.10), (predicted.tolist(), measured.tolist())
    occupancy = lambda rows: rows[:, 1].sum() / (rows[:, 0].sum() * SLOTS)
    assert abs(occupancy(predicted) - occupancy(measured)) <= 0.05
    assert occupancy(measured) >= 0.6  # the pool keeps the slots busy: the case the model is for


def test_the_planner_fills_a_long_tails_slots_with_partial_rollouts():
    """A long tail (16 prompts x 4, responses log-normal mean 512, max 2048) on 8 GH200, the best colocated plan
    with and without partial rollouts: with them the generation slots are busier and the step less than half as
    long (1.7 s against 5.5 s when written), sequences
    are carried and re-prefilled, and no trained token lags more than k + 2 versions (the job's default bound)."""
    from rpegjax.models import ModelConfig
    from rpegjax.perf import planner
    from rpegjax.perf.model import step_model
    from rpegjax.perf.model.generation_cost import ResponseLengths
    from rpegjax.perf.model.stage_costs import Workload
    from rpegjax.perf.reference import presets

    workload = Workload(prompts=16, group_size=4, prompt_tokens=256, responses=ResponseLengths.lognormal(512, 2048))
    evaluator = step_model.Evaluator.for_runtime(ModelConfig.qwen2p5("0.5b"), workload, presets.gh200_quad(8))
    best = {}
    for partial in (False, True):
        # a partial plan at k = 1 trains tokens up to 3 versions old: offered where the space allows that staleness
        space = planner.PlanSpace(async_bounds=(1, 3) if partial else (1,), fusion=(True,), microbatches=(1,), tensor_sizes=(1,),
                                  generation_fractions=(None,), reshard_inference=(False,), attention=("cudnn",),
                                  remat=("full",), optimizer_offload=(False,), partial_rollouts=(partial,))
        best[partial] = planner.Planner(evaluator, algorithm="grpo", num_devices=8, space=space).search(top=1).best
    assert best[True].graph.execution.partial_rollouts and not best[False].graph.execution.partial_rollouts
    plain, partial = (best[p].prediction.stage("generate").detail for p in (False, True))
    assert partial["slot_busy"] > plain["slot_busy"]
    # two batches decode together, and the tail of one overlaps the next: generation is no longer its longest row
    assert best[True].prediction.step_seconds < 0.5 * best[False].prediction.step_seconds
    assert partial["carried_sequences"] > 0 and partial["reprefill_tokens"] > 0
    assert 0 < partial["carry_lag_mean"] and partial["carry_lag_max"] <= 2  # versions beyond k = 1
