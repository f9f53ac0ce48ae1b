"""The runtime executes the RPEG: version bookkeeping under bounded asynchrony, equivalence with a plain
synchronous loop, fusion, micro-batched rollouts, and failures that must not stop training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.data.iterator import DataIterator
from rpegjax.generate.weight_sync import reshard_params
from rpegjax.graph.trace import max_staleness
from rpegjax.learners.batch import pack_rollouts
from rpegjax.runtime.controller import Runtime
from tiny_setup import TinySetup, built, run_runtime, tiny_graph

TINY = TinySetup()


def run(setup: TinySetup, steps: int, **options):
    """(built setup, runtime, final state, results, trace) of `steps` steps of `setup`."""
    done = run_runtime(setup, steps, **options)
    return done.run, done.runtime, done.state, done.results, done.trace


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_is_exactly_the_bound_and_never_more(k):
    built_run, runtime, _, results, trace = run(TINY.replace(async_bound=k), 5)
    for result in results:
        versions = {c.version for c in result.completions}
        assert versions == {result.version}  # every sequence of a rollout was generated with one version
        assert result.version == max(0, result.step - k)  # generation of step t reads weights t - k
        assert result.step - result.version <= k
        assert result.metrics["staleness"] == result.step - result.version
        # occupancy x slots x decode steps = the tokens decoded: every response token but the first (from prefill)
        decoded = sum(c.length - 1 for c in result.completions)
        slot_steps = built_run.sampler.num_slots * result.metrics["generate/decode_steps"]
        assert result.metrics["generate/slot_occupancy"] * slot_steps == pytest.approx(decoded, rel=1e-9)
        assert 0 < result.metrics["generate/slot_occupancy"] <= result.metrics["generate/bucket_occupancy"] <= 1
    assert max_staleness(trace) == min(k, 4)


def test_synchronous_runtime_reproduces_a_plain_on_policy_loop():
    setup = TINY.replace(async_bound=0, fuse=False)
    _, _, state, results, _ = run(setup, 3)

    # the same run written as a plain loop, without the graph or threads
    reference = built(setup)
    learner, sampler = reference.learner, reference.sampler
    data = DataIterator(reference.train_examples, batch_size=setup.prompts_per_step, seed=0)
    sampling = setup.sampling()
    plain = learner.init_state()
    reference_params = jax.tree.map(np.copy, jax.device_get(learner.params))
    for step in range(3):
        examples = data.next_batch()
        generation_params = jax.tree.map(jnp.copy, plain.params)  # the next update donates plain.params
        if sampler.mesh is not None:
            generation_params = reshard_params(generation_params, sampler.mesh, sampler.rules)
        completions = sampler.generate(generation_params, reference.prompt_ids(examples), sampling, group_size=2,
                                       key=jax.random.fold_in(jax.random.key(7), step), version=step)
        assert [list(c.response_ids) for c in completions] == [list(c.response_ids) for c in results[step].completions]
        batch = pack_rollouts([c.prompt_ids for c in completions], [c.response_ids for c in completions],
                              [c.behaviour_logprobs for c in completions], pad_id=reference.pad_id,
                              length=setup.max_prompt_len + setup.max_new_tokens)
        rewards = np.array([reference.task.reward(reference.decode(c.response_ids), examples[c.prompt_index])
                            for c in completions], np.float32)
        batch = batch.replace(rewards=rewards, old_logprobs=learner.logprobs(plain.params, batch),
                              ref_logprobs=learner.logprobs(reference_params, batch))
        batch, _ = learner.compute_advantages(batch)
        plain, metrics = learner.update(plain, batch)
        assert float(metrics["loss"]) == pytest.approx(results[step].metrics["loss"], abs=1e-6)
        # synchronous: the sampler's log-probs are the training forward's up to kernel round-off, and logged so
        mismatch = results[step].metrics["mismatch/abs_logprob_diff_max"]
        assert mismatch == pytest.approx(float(metrics["mismatch/abs_logprob_diff_max"]), abs=1e-6) and mismatch < 1e-3
    for ours, theirs in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain.params)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6)


def test_fused_graph_gives_the_same_numbers_with_fewer_dispatches():
    _, fused_runtime, fused_state, fused, _ = run(TINY.replace(async_bound=0, fuse=True), 2)
    _, plain_runtime, plain_state, unfused, _ = run(TINY.replace(async_bound=0, fuse=False), 2)
    for a, b in zip(fused, unfused):
        assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
        assert a.metrics["reward"] == b.metrics["reward"]
    for x, y in zip(jax.tree.leaves(fused_state.params), jax.tree.leaves(plain_state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    # reference + old log-probs: one program instead of two, every step
    assert fused_runtime.dispatches_per_step == [d - 1 for d in plain_runtime.dispatches_per_step]


def test_microbatched_rollout_hands_pieces_downstream_and_matches_the_whole_batch():
    # 8 slots (one per device: slots split over all 8) hold the 4 prompts x 2 samples of one piece: the second
    # piece decodes after the first finished
    eight_prompts = TINY.replace(num_slots=8, prompts_per_step=8, async_bound=0)
    _, _, whole_state, whole, _ = run(eight_prompts, 2)
    _, runtime, pieces_state, pieces, trace = run(eight_prompts.replace(generate_microbatches=2), 2)
    for a, b in zip(whole, pieces):
        assert a.metrics["reward"] == b.metrics["reward"]
        assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-5)
    inference = [e for e in trace.events if "old_logprob" in e.stage and e.step == 0]
    assert sorted(e.microbatch for e in inference) == [0, 1]
    generate_end = next(e.end for e in trace.events if e.stage == "generate" and e.step == 0)
    # the first piece's log-probs start before the last sequence of the step has been decoded
    assert min(e.start for e in inference) < generate_end


def _flaky_reward(text, example):
    if example.id[-1] in "02468":  # about half of the problems
        raise RuntimeError("verifier crashed")
    return 0.0


def test_a_reward_function_that_throws_is_counted_and_training_goes_on():
    _, _, _, results, _ = run(TINY.replace(async_bound=1), 3, reward=_flaky_reward)
    assert len(results) == 3
    assert sum(r.metrics["reward/errors"] for r in results) > 0
    assert all(r.metrics["reward"] == 0.0 for r in results)


def test_single_step_graphs_without_decoupled_correction_skip_the_old_logprob_pass():
    # the job's graph choice (tests/train/test_build_graph.py); here the runtime without the pass
    on_policy = TINY.replace(async_bound=0, decoupled=False)
    assert not tiny_graph(on_policy, num_devices=1).has_stage("old_logprob")
    _, _, _, results, _ = run(on_policy, 2)
    assert all(r.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) for r in results)


def _device_ids(tree) -> set[int]:
    return {device.id for leaf in jax.tree.leaves(tree) for device in leaf.sharding.device_set}


def _length_reward(text, example):
    """A reward with signal for an untrained model (its task rewards are all zero): the update then follows
    the advantages, not round-off that Adam would blow up to a full step."""
    return float(len(text) % 3) / 2


def test_disaggregated_generation_runs_on_its_own_devices_and_matches_colocated():
    # 2 KV heads: tensor=2 splits them (the sharding rules refuse to replicate 1 head over 2 devices)
    colocated = TINY.replace(async_bound=1, num_kv_heads=2)
    split = colocated.replace(rollout_devices=4, train_mesh=(("data", 4),), rollout_mesh=(("data", 2), ("tensor", 2)))
    parts, runtime, state, results, trace = run(split, 3, reward=_length_reward)
    assert set(parts.graph.placements) == {"rollout", "train"}
    assert _device_ids(state.params) == {4, 5, 6, 7}  # training on the last four devices
    assert all(_device_ids(params) == {0, 1, 2, 3} for _, params in runtime.store.items())  # generation weights
    places = {(e.stage, e.devices) for e in trace.events}
    assert ("generate", "rollout") in places and any(d == "train" for s, d in places if "update" in s)
    assert [r.version for r in results] == [0, 0, 1]  # the bound holds across device sets
    # weight sync moves the trained weights across device sets unchanged
    synced = runtime.programs.sync(state)
    assert _device_ids(synced) == {0, 1, 2, 3}
    for trained, moved in zip(jax.tree.leaves(state.params), jax.tree.leaves(synced)):
        np.testing.assert_array_equal(np.asarray(trained), np.asarray(moved))
    # the same run colocated: the same rollouts from the same weights, the same first update. (Later updates
    # agree only to round-off: Adam's first step turns round-off in zero-gradient coordinates into lr-sized steps.)
    reference = run(colocated, 3, reward=_length_reward)[3]
    assert any(r.metrics["reward"] > 0 for r in reference)
    for mine, theirs in zip(results, reference):
        if mine.version == 0:
            assert [list(c.response_ids) for c in mine.completions] == [list(c.response_ids) for c in theirs.completions]
    for key in ("loss", "reward", "kl_loss", "grad_norm"):
        assert results[0].metrics[key] == pytest.approx(reference[0].metrics[key], rel=1e-5, abs=1e-7), key


def test_an_inference_stage_with_its_own_layout_runs_resharded_with_the_same_numbers():
    from rpegjax.graph import transforms
    from rpegjax.graph.ir import StageKind
    from rpegjax.runtime.meshes import stage_mesh

    setup = TINY.replace(async_bound=1, fuse=False)
    parts = built(setup)
    graph = transforms.place(parts.graph, "ref_logprob", "all", {"data": 2, "fsdp": 4})
    graph = transforms.place(graph, "old_logprob", "all", {"fsdp": 8})
    _, runtime, _, resharded, trace = run(setup, 2, reward=_length_reward, graph=graph)
    assert {name: dict(mesh.shape) for name, mesh in runtime.stage_meshes.items()} == {
        "ref_logprob": {"data": 2, "fsdp": 4}, "old_logprob": {"fsdp": 8}}
    assert {"ref_logprob", "old_logprob"} <= {e.stage for e in trace.events}
    plain = run(setup, 2, reward=_length_reward)[3]
    for key in ("loss", "kl_loss", "ratio_mean"):
        assert resharded[0].metrics[key] == pytest.approx(plain[0].metrics[key], rel=1e-5, abs=1e-7), key
    # equal rewards: plain's gradient is exactly 0 (zero advantages, KL of identical log-probs); the resharded
    # reference log-probs differ by float32 rounding (~1e-7), which leaves a KL gradient of that order
    assert resharded[0].metrics["grad_norm"] == pytest.approx(plain[0].metrics["grad_norm"], rel=1e-5, abs=1e-6)
    # one fused program on a layout of its own gives the learner-layout numbers
    programs, state = parts.programs(None), parts.learner.init_state()
    rows = np.random.default_rng(0).integers(3, 90, size=(8, 18)).tolist()
    batch = pack_rollouts([r[:6] for r in rows], [r[6:] for r in rows], [[0.0] * 12] * 8, pad_id=0, length=18)
    kinds = [StageKind.REF_LOGPROB, StageKind.OLD_LOGPROB]
    expected = programs.infer(kinds, state, batch)
    got = programs.infer(kinds, state, batch, stage_mesh(graph, "ref_logprob"))
    for field in expected:
        assert {d.id for d in got[field].sharding.device_set} == set(range(8))
        np.testing.assert_allclose(np.asarray(got[field]), np.asarray(expected[field]), atol=1e-5)


def test_graphs_whose_placements_the_programs_do_not_honour_are_refused():
    from rpegjax.graph import transforms
    from rpegjax.graph.ir import GraphError

    parts = built(TINY.replace(async_bound=1))  # sampler and learner on all eight devices
    programs = parts.programs(None)
    split = transforms.disaggregate(parts.graph, 4, {"data": 4}, {"data": 4})
    with pytest.raises(GraphError, match=r"stage 'generate' .* placed on devices \[0, 1, 2, 3\], but its program runs on "
                                         r"devices \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        Runtime(split, programs, None, prompt_ids=None, key=jax.random.key(0))
    update_elsewhere = transforms.place(parts.graph, "actor_update", "all", {"fsdp": 8})
    with pytest.raises(GraphError, match="stage 'actor_update' .* only inference stages can run with a layout of their own"):
        Runtime(update_elsewhere, programs, None, prompt_ids=None, key=jax.random.key(0))


def test_a_shared_critic_stage_gets_log_probs_and_values_from_one_pass():
    from rpegjax.graph.ir import StageKind

    parts = built(TINY.replace(ppo_critic="shared"))
    programs, state = parts.programs(None), parts.learner.init_state()
    rows = np.random.default_rng(1).integers(3, 90, size=(8, 18)).tolist()
    batch = pack_rollouts([r[:6] for r in rows], [r[6:] for r in rows], [[0.0] * 12] * 8, pad_id=0, length=18)
    both, alone = (StageKind.OLD_LOGPROB, StageKind.CRITIC_VALUE), [(StageKind.OLD_LOGPROB,), (StageKind.CRITIC_VALUE,)]
    joint = programs.infer(both, state, batch)
    separate = {k: v for kinds in alone for k, v in programs.infer(kinds, state, batch).items()}
    for field in ("old_logprobs", "values"):
        np.testing.assert_allclose(np.asarray(joint[field]), np.asarray(separate[field]), atol=1e-6)

    def flops(kinds):  # XLA's count for the compiled program
        return programs.training.lower_inference(kinds, state, batch).compile().cost_analysis()["flops"]

    # one trunk pass: the log-prob pass plus a value head, far from a second pass
    assert flops(both) < flops(alone[0]) + 0.5 * flops(alone[1])


def test_a_plain_reward_function_is_enough_for_the_stage_programs(tmp_path, monkeypatch):
    import sys

    # a user's function in a module of its own (the worker processes import it, as they receive our sys.path)
    (tmp_path / "user_length_reward.py").write_text(
        "def length(completion, example):\n    return len(completion) + (example['answer'] != '')\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    from user_length_reward import length

    setup = TINY.replace(async_bound=0)
    parts = built(setup)
    programs = parts.programs(length)  # no RewardRunner: the programs make one and own it
    data = DataIterator(parts.train_examples, batch_size=setup.prompts_per_step, seed=0)
    results = []
    Runtime(parts.graph, programs, data, prompt_ids=parts.prompt_ids, key=jax.random.key(7)).run(
        parts.learner.init_state(), start_step=0, num_steps=1, on_step=lambda result, _: results.append(result))
    programs.close()
    texts = [parts.decode(c.response_ids) for c in results[0].completions]
    assert results[0].metrics["reward"] == pytest.approx(np.mean([len(t) + 1 for t in texts]), abs=1e-6)
    assert results[0].metrics["reward/errors"] == 0
