"""Optimiser config: schedules and the AdamW + clipping chain against formulas written here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpegjax.learners.optim import OptimizerConfig, Schedule, make_optimizer, make_schedule


def test_constant_schedule_with_warmup():
    schedule = make_schedule(OptimizerConfig(learning_rate=1e-3, warmup_steps=4))
    np.testing.assert_allclose([schedule(s) for s in range(6)], [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6)
    assert float(make_schedule(OptimizerConfig(learning_rate=1e-3))(100)) == pytest.approx(1e-3)


def test_cosine_schedule_with_warmup():
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=2, schedule="cosine", total_steps=12, min_lr_ratio=0.1)
    assert cfg.schedule is Schedule.COSINE
    schedule = make_schedule(cfg)
    for step in range(14):
        if step < 2:
            want = 1e-3 * (step + 1) / 2
        else:
            progress = min(step - 2, 10) / 10
            want = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5), step


def test_adamw_step_clips_and_decays_matrices_only():
    cfg = OptimizerConfig(learning_rate=0.1, weight_decay=0.5, max_grad_norm=1.0, b1=0.9, b2=0.99, eps=1e-8)
    params = {"w": jnp.full((2, 2), 2.0), "b": jnp.full((3,), 2.0)}
    grads = {"w": jnp.full((2, 2), 3.0), "b": jnp.full((3,), 4.0)}
    optimizer = make_optimizer(cfg)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    # first Adam step on clipped gradients: m_hat = g, v_hat = g^2  ->  g / (|g| + eps) = 1 per entry
    norm = math.sqrt(4 * 9 + 3 * 16)
    g_w, g_b = 3.0 / norm, 4.0 / norm
    np.testing.assert_allclose(updates["w"], -0.1 * (g_w / (g_w + 1e-8) + 0.5 * 2.0), rtol=1e-5)
    np.testing.assert_allclose(updates["b"], -0.1 * (g_b / (g_b + 1e-8)), rtol=1e-5)
    all_decayed = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.5, weight_decay_matrices_only=False))
    updates, _ = all_decayed.update(grads, all_decayed.init(params), params)
    np.testing.assert_allclose(updates["b"], -0.1 * (1.0 + 0.5 * 2.0), rtol=1e-5)


def test_optimizer_works_on_nnx_state(tiny_model):
    from flax import nnx

    _, state = nnx.split(tiny_model)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, weight_decay=0.1))
    grads = jax.tree.map(jnp.zeros_like, state)
    updates, _ = jax.jit(optimizer.update)(grads, jax.jit(optimizer.init)(state), state)
    # zero gradients: only weight decay moves, and only the matrices
    for (path, update), (_, param) in zip(nnx.to_flat_state(updates), nnx.to_flat_state(state)):
        value = np.asarray(param.get_value())
        want = -1e-3 * 0.1 * value if value.ndim >= 2 else np.zeros_like(value)
        np.testing.assert_allclose(update.get_value(), want, rtol=1e-5, atol=1e-12, err_msg=str(path))


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(learning_rate=0.0), "learning_rate must be positive"),
        (dict(schedule="cosine"), "total_steps must exceed warmup_steps=0"),
        (dict(schedule="linear"), "schedule must be one of"),
        (dict(max_grad_norm=-1.0), "max_grad_norm must be positive"),
        (dict(b2=1.0), "b2 must be in"),
    ],
)
def test_config_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**changes)
