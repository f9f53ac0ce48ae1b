"""Optimiser state in host memory between updates (`rpegjax.runtime.offload`, `Execution.optimizer_offload`).

The round trip is exact (bitwise) and frees the device copy; in a colocated run the optimiser state lies in pinned
host memory while the sampler generates, on the devices while the update runs (and then no KV cache is alive),
and the run trains exactly as without offload."""

import dataclasses

import jax
import numpy as np
import pytest
from tiny_setup import TinySetup, built, run_runtime, tiny_graph

from rpegjax.graph.ir import Execution
from rpegjax.runtime.offload import HOST_MEMORY, OptimizerOffload, on_host

SETUP = TinySetup(prompts_per_step=4, max_new_tokens=6, async_bound=0)


def host_arrays() -> list[jax.Array]:
    return [a for a in jax.live_arrays() if a.sharding.memory_kind == HOST_MEMORY]


def test_round_trip_is_exact_and_frees_the_device_copy():
    learner = built(SETUP).learner
    offload = OptimizerOffload(learner.state_shardings)
    state = learner.init_state()
    # moments that are not zero: one update's worth of optax state, without running the learner's update
    state = state.replace(opt_state=jax.tree.map(lambda x: x + jax.numpy.asarray(0.25, x.dtype) * jax.numpy.ones_like(x)
                                                 if x.ndim else x, state.opt_state))
    before = [np.asarray(leaf).copy() for leaf in jax.tree.leaves(state.opt_state)]
    device_leaves = jax.tree.leaves(state.opt_state)
    rested = offload.to_host(state)
    assert on_host(rested.opt_state) and not on_host(rested.params)
    assert all(leaf.is_deleted() for leaf in device_leaves)  # donated: no device copy left behind
    back = offload.to_device(rested)
    for leaf, sharding, want in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(learner.state_shardings.opt_state),
                                    before, strict=True):
        assert leaf.sharding == sharding  # the update's own layout, in device memory
        np.testing.assert_array_equal(np.asarray(leaf), want)  # bitwise
        assert np.asarray(leaf).tobytes() == want.tobytes()


def test_offload_without_a_mesh_is_refused():
    with pytest.raises(ValueError, match="optimizer_offload needs the learner on a mesh"):
        OptimizerOffload(None)


def observe(programs, generation: list, updates: list, cache_shape: tuple[int, ...]) -> None:
    """Hooks: at each generated piece, the bytes of live arrays in host memory and the live arrays of the KV cache's
    shape; inside each update (its program
    about to run), the host arrays and the live arrays of the KV cache's shape."""
    generate = programs.generate

    def generating(*args, **kwargs):
        for piece in generate(*args, **kwargs):
            caches = [a for a in jax.live_arrays() if a.shape == cache_shape]
            generation.append((sum(a.nbytes for a in host_arrays()), len(caches)))
            yield piece

    class Observed:
        def __init__(self, learner):
            self._learner = learner

        def __getattr__(self, name):
            return getattr(self._learner, name)

        def update(self, state, batch):
            caches = [a for a in jax.live_arrays() if a.shape == cache_shape]
            updates.append((len(host_arrays()), len(caches), on_host(state.opt_state)))
            return self._learner.update(state, batch)

    programs.generate = generating
    programs.training.learner = Observed(programs.training.learner)


def test_colocated_run_offloads_while_generating_and_trains_as_without():
    graph = tiny_graph(SETUP)
    offloaded_graph = dataclasses.replace(graph, execution=Execution(optimizer_offload=True))
    cfg = built(SETUP).model_cfg
    # the contiguous KV cache of one layer: [slots, kv heads, capacity, head dim]
    cache_shape = (8, cfg.num_kv_heads, SETUP.max_prompt_len + SETUP.max_new_tokens, cfg.head_dim)
    generation, updates = [], []
    offloaded = run_runtime(SETUP, 2, graph=offloaded_graph, concurrent_rollout=False,
                            prepare=lambda programs: observe(programs, generation, updates, cache_shape))
    plain = run_runtime(SETUP, 2, graph=graph, concurrent_rollout=False)
    opt_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(offloaded.state.opt_state))
    assert on_host(offloaded.state.opt_state) and not on_host(plain.state.opt_state)
    # every piece of both steps generated with the whole optimiser state in host memory
    assert [nbytes for nbytes, _ in generation] == [opt_bytes, opt_bytes], (generation, opt_bytes)
    assert all(caches > 0 for _, caches in generation)  # the probe sees the cache while the sampler holds it
    # the update's program received its state on the devices; nothing in host memory, no KV cache alive
    assert updates == [(0, 0, False), (0, 0, False)]
    for got, want in zip(jax.tree.leaves(offloaded.state), jax.tree.leaves(plain.state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
