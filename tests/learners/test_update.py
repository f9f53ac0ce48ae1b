"""The shared update loop: row split, epochs x mini-batches x micro-batches, and optimiser-state shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax.learners.batch import TrainBatch
from rpegjax.learners.losses import aggregate, aggregation_denominator
from rpegjax.learners.update import TrainState, UpdateLayout, make_update, split_rows, train_state_shardings
from rpegjax.sharding import make_mesh


def test_split_rows_interleaves():
    rows = jnp.arange(12)
    split = np.asarray(split_rows(rows, UpdateLayout(num_minibatches=2, num_microbatches=3)))
    assert split.shape == (2, 3, 2)
    for j in range(2):
        for u in range(3):
            np.testing.assert_array_equal(split[j, u], [i * 6 + j * 3 + u for i in range(2)])


def test_update_loop_matches_a_numpy_loop():
    """Linear regression with token-mean squared error and plain SGD, against the loop written out in numpy."""
    rng = np.random.default_rng(0)
    b, t = 12, 5
    x = rng.normal(size=(b, t)).astype(np.float32)
    y = rng.normal(size=(b, t)).astype(np.float32)
    mask = rng.random((b, t)) < 0.7
    batch = TrainBatch(tokens=jnp.zeros((b, t), jnp.int32), token_mask=jnp.asarray(mask), response_mask=jnp.asarray(mask),
                       values=jnp.asarray(x), returns=jnp.asarray(y))

    def loss_fn(w, micro, denominator, key):
        assert key is None  # no seed: no random keys
        error = (w * micro.values - micro.returns) ** 2
        loss = aggregate(error, micro.response_mask, "token-mean", denominator=denominator)
        return loss, {"error_max": jnp.max(jnp.where(micro.response_mask, error, 0.0))}

    layout = UpdateLayout(epochs=2, num_minibatches=2, num_microbatches=3)
    update = jax.jit(make_update(loss_fn, lambda rows: aggregation_denominator(rows.response_mask, "token-mean"),
                                 optax.sgd(0.1), layout))
    state = TrainState(params=jnp.float32(0.5), opt_state=optax.sgd(0.1).init(jnp.float32(0.5)), step=jnp.int32(0))
    state, metrics = update(state, batch)

    w = 0.5
    for _ in range(2):
        for j in range(2):
            rows = [r for r in range(b) if (r % 6) // 3 == j]
            m, xs, ys = mask[rows], x[rows].astype(np.float64), y[rows]
            w -= 0.1 * np.sum(np.where(m, 2 * (w * xs - ys) * xs, 0.0)) / m.sum()
    np.testing.assert_allclose(state.params, w, rtol=1e-5)
    assert int(state.step) == 4
    assert float(metrics["error_max"]) > 0 and np.isfinite(float(metrics["loss"]))


def test_update_keys_follow_the_state_step_and_the_micro_batch():
    """With a seed, micro-batch u of the optimiser step with state.step = n draws from fold_in(fold_in(key(seed), n), u):
    a run resumed at step n draws what an uninterrupted one does; every (step, micro-batch) draws anew."""
    b, t, seed, start = 12, 3, 7, 5
    batch = TrainBatch(tokens=jnp.zeros((b, t), jnp.int32), token_mask=jnp.ones((b, t), bool),
                       response_mask=jnp.ones((b, t), bool))

    def loss_fn(w, micro, denominator, key):
        draw = jax.random.uniform(key)
        return w * draw, {"draw": draw, "draw_max": draw, "draw_min": draw}

    layout = UpdateLayout(epochs=2, num_minibatches=2, num_microbatches=3)
    update = jax.jit(make_update(loss_fn, lambda rows: None, optax.sgd(0.1), layout, seed=seed))
    state = TrainState(params=jnp.float32(0.5), opt_state=optax.sgd(0.1).init(jnp.float32(0.5)), step=jnp.int32(start))
    _, metrics = update(state, batch)

    draws = np.array([[float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), n), u)))
                       for u in range(3)] for n in range(start, start + 4)])
    assert len(np.unique(draws)) == draws.size
    np.testing.assert_allclose(float(metrics["draw"]), draws.mean(), rtol=1e-6)
    assert float(metrics["draw_max"]) == draws.max() and float(metrics["draw_min"]) == draws.min()


def test_optimizer_state_shardings_follow_parameters_through_multi_transform():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = {"actor": {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}, "critic": {"w": jnp.zeros((4, 8))}}
    shardings = {
        "actor": {"w": NamedSharding(mesh, PartitionSpec("fsdp", "tensor")), "b": NamedSharding(mesh, PartitionSpec("tensor"))},
        "critic": {"w": NamedSharding(mesh, PartitionSpec(None, "tensor"))},
    }
    optimizer = optax.multi_transform(
        {"actor": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), "critic": optax.adamw(1e-2)},
        {"actor": "actor", "critic": "critic"},
    )
    state = train_state_shardings(optimizer, params, shardings, mesh)
    actor_adam = state.opt_state.inner_states["actor"].inner_state[1][0]
    critic_adam = state.opt_state.inner_states["critic"].inner_state[0]
    assert actor_adam.mu["actor"]["w"].spec == PartitionSpec("fsdp", "tensor")
    assert actor_adam.nu["actor"]["b"].spec == PartitionSpec("tensor")
    assert critic_adam.nu["critic"]["w"].spec == PartitionSpec(None, "tensor")
    assert actor_adam.count.spec == PartitionSpec()
    assert state.step.spec == PartitionSpec()
