"""Learners of a model with LoRA adapters: only the adapters are trained and in the optimiser state, the frozen base
is the reference policy, and the update's gradient is the full model's gradient projected onto the adapters."""

import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollouts import B, G, LENGTH, make_batch

from rpegjax.learners.grpo import GRPOConfig, GRPOLearner
from rpegjax.learners.objective import policy_denominators, update_inputs
from rpegjax.learners.optim import OptimizerConfig
from rpegjax.learners.ppo import PPOConfig, PPOLearner
from rpegjax.learners.trainable import split_trainable
from rpegjax.models import Decoder, ModelConfig
from rpegjax.models.lora import Adapter, LoRAConfig, LoRAParam, LoRATarget, adapter_paths, count_parameters
from rpegjax.sharding import ShardingRules, make_mesh

LORA = LoRAConfig(rank=4, alpha=8.0)
DROPOUT, SEED = 0.3, 9
CFG = dict(group_size=G, kl_coef=0.04, kl_kind="k3", optimizer=OptimizerConfig(learning_rate=1e-2, max_grad_norm=None))


@pytest.fixture(scope="module")
def base():
    return Decoder(ModelConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def adapted(base):
    return base.with_lora(LORA, seed=1)




def with_dropout(model: Decoder, rate: float) -> Decoder:
    """`model`'s weights (shared) under adapters with LoRA dropout `rate`."""
    lora = dataclasses.replace(model.lora, dropout=rate)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(model.cfg, rngs=nnx.Rngs(0), lora=lora)))
    return nnx.merge(graphdef, nnx.state(model))


def trained(model: Decoder) -> Decoder:
    """A copy of `model` whose B matrices are random, so that the adapters' output matters."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(4)
    flat = dict(nnx.to_flat_state(state))
    for path, variable in flat.items():
        if isinstance(variable, LoRAParam) and path[-1] == "b":
            flat[path] = variable.replace(jnp.asarray(0.1 * rng.standard_normal(variable.get_value().shape), jnp.float32))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def fill(learner, state, batch):
    batch, _ = learner.compute_advantages(batch)
    return batch.replace(old_logprobs=learner.logprobs(learner.actor_params(state.params), batch),
                         ref_logprobs=learner.logprobs(learner.reference_params(), batch))


def test_only_adapters_are_trained_and_the_base_is_the_reference(base, adapted):
    learner = GRPOLearner(GRPOConfig(**CFG), adapted)
    plain = GRPOLearner(GRPOConfig(**CFG), base)
    assert all(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(learner.params))
    assert count_parameters(learner.params) == count_parameters(nnx.state(adapted, LoRAParam))
    state = learner.init_state()
    # Adam's two moments over the adapters, nothing over the base (+ two step counts)
    assert count_parameters(state.opt_state) == 2 * count_parameters(learner.params) + 2
    batch = make_batch()
    reference = np.asarray(learner.logprobs(learner.reference_params(), batch))
    np.testing.assert_allclose(reference, np.asarray(plain.logprobs(plain.params, batch)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(learner.logprobs(learner.actor_params(state.params), batch)), reference,
                               atol=1e-5)
    # the reference is the frozen base itself: the same buffers as the model's weights, not a copy
    assert learner.reference_params()["lm_head"].get_value() is learner.frozen["lm_head"].get_value()
    frozen_before = jax.tree.map(np.asarray, learner.frozen)
    for step in range(2):
        state, metrics = learner.update(state, fill(learner, state, make_batch(seed=step)))
    assert learner.update_traces == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner.frozen), frozen_before)
    moved = np.asarray(learner.logprobs(learner.actor_params(state.params), batch))
    assert np.abs(moved - reference).max() > 1e-3


def test_update_gradient_is_the_full_gradient_projected_on_the_adapters(base, adapted):
    """At B = 0: dL/dA = s G B^T = 0 and dL/dB = s A^T G, G the full model's gradient of the kernel; the update's
    grad_norm (before clipping) must be the norm of that projection."""
    cfg = GRPOConfig(**CFG)
    learner, plain = GRPOLearner(cfg, adapted), GRPOLearner(cfg, base)
    state = learner.init_state()
    batch = fill(learner, state, make_batch())
    inputs = update_inputs(batch, cfg)
    full = jax.jit(jax.grad(lambda p: plain._loss(p, inputs, policy_denominators(cfg, inputs))[0]))(plain.params)
    flat_full, flat_adapters = dict(nnx.to_flat_state(full)), dict(nnx.to_flat_state(nnx.state(adapted, LoRAParam)))
    squares = 0.0
    for adapter, kernel in adapter_paths(nnx.state(adapted)):
        a = np.asarray(flat_adapters[(*adapter, "a")].get_value(), np.float64)
        a = a.reshape(-1, a.shape[-1])
        g = np.asarray(flat_full[kernel].get_value(), np.float64).reshape(a.shape[0], -1)
        squares += np.sum((LORA.scale * a.T @ g) ** 2)
    _, metrics = learner.update(state, batch)
    np.testing.assert_allclose(float(metrics["grad_norm"]), np.sqrt(squares), rtol=1e-4)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_sharded_lora_update_equals_unsharded(adapted, dropout):
    """With LoRA dropout too (two micro-batches, each with its own masks): the masks do not depend on the mesh."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = with_dropout(adapted, dropout)
    cfg = GRPOConfig(**CFG, num_microbatches=2 if dropout else 1)
    results = []
    for learner in (GRPOLearner(cfg, model, seed=5),
                    GRPOLearner(cfg, model, mesh=mesh, rules=ShardingRules.fsdp_tp(), seed=5)):
        state = learner.init_state()
        state, metrics = learner.update(state, fill(learner, state, make_batch()))
        results.append((state, metrics))
    (state, metrics), (sharded_state, sharded_metrics) = results
    b = sharded_state.params["layers"][0]["attention"]["q_proj_lora"]["b"].get_value()
    assert b.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
    for (path, x), (_, y) in zip(nnx.to_flat_state(sharded_state.params), nnx.to_flat_state(state.params)):
        np.testing.assert_allclose(x.get_value(), y.get_value(), rtol=1e-4, atol=1e-5, err_msg=str(path))
    for key, value in metrics.items():
        np.testing.assert_allclose(sharded_metrics[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_ppo_shared_critic_trains_adapters_and_value_head():
    """With LoRA dropout: the actor's forward in the update (which gives the shared critic's values too) drops."""
    model = Decoder(ModelConfig.tiny(value_head=True), rngs=nnx.Rngs(0)).with_lora(LORA, seed=1)
    cfg = PPOConfig(critic="shared", kl_coef=0.0, optimizer=CFG["optimizer"])
    learner = PPOLearner(cfg, with_dropout(model, DROPOUT), seed=SEED)
    trainable = dict(nnx.to_flat_state(learner.params["actor"]))
    assert {path[-1] for path in trainable if not isinstance(trainable[path], LoRAParam)} == {"value_kernel", "value_bias"}
    assert learner.frozen["actor"]["lm_head"] is not None
    state = learner.init_state()
    batch = make_batch()
    batch = batch.replace(old_logprobs=learner.logprobs(learner.actor_params(state.params), batch),
                          values=learner.values(state.params, batch))
    batch, _ = learner.compute_advantages(batch)
    plain = PPOLearner(cfg, model)
    _, plain_metrics = plain.update(plain.init_state(), batch)
    state, metrics = learner.update(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert abs(float(metrics["grad_norm"]) - float(plain_metrics["grad_norm"])) > 1e-4 * float(metrics["grad_norm"])
    assert np.abs(np.asarray(state.params["actor"]["value_kernel"].get_value())).max() > 0
    assert split_trainable(learner.actor_params(state.params))[1] is not None



def test_ppo_shared_critic_with_adapters_has_the_base_as_reference():
    """The reference of a shared critic's actor with adapters: the base (adapters off), whole with its value head."""
    base = Decoder(ModelConfig.tiny(value_head=True), rngs=nnx.Rngs(0))
    cfg = PPOConfig(critic="shared", kl_coef=0.01, optimizer=CFG["optimizer"])
    learner, plain = PPOLearner(cfg, base.with_lora(LORA, seed=1)), PPOLearner(cfg, base)
    batch = make_batch()
    reference = np.asarray(learner.logprobs(learner.reference_params(), batch))
    np.testing.assert_allclose(reference, np.asarray(plain.logprobs(plain.reference_params(), batch)), atol=1e-6)
    # the frozen base's buffers themselves, not a copy
    assert learner.reference_params()["lm_head"].get_value() is learner.frozen["actor"]["lm_head"].get_value()


def test_lora_dropout_only_in_the_update_and_drawn_per_step(adapted):
    """Log-probs (old, reference) never drop; the update's masks are the same for the same step and seed, new for
    another step."""
    model = trained(adapted)
    learner, plain = GRPOLearner(GRPOConfig(**CFG), with_dropout(model, DROPOUT), seed=SEED), GRPOLearner(GRPOConfig(**CFG), model)
    batch = make_batch()
    state = learner.init_state()
    actor = learner.actor_params(state.params)
    np.testing.assert_array_equal(np.asarray(learner.logprobs(actor, batch)),
                                  np.asarray(plain.logprobs(plain.actor_params(plain.params), batch)))
    batch = fill(learner, state, batch)

    def grad_norm(learner, step):
        state = learner.init_state()
        _, metrics = learner.update(state.replace(step=jnp.asarray(step, jnp.int32)), batch)
        return float(metrics["grad_norm"])

    norms = [grad_norm(learner, 0), grad_norm(learner, 0), grad_norm(learner, 1)]
    assert norms[0] == norms[1]  # the same step: the same masks, bit for bit
    assert abs(norms[2] - norms[0]) > 1e-4 * norms[0]  # another step: other masks
    assert abs(grad_norm(plain, 0) - norms[0]) > 1e-4 * norms[0]  # and dropout changes the update


def test_lora_dropout_update_gradient_equals_the_masked_reference(adapted, monkeypatch):
    """The update at state.step = n with one micro-batch: layer l's adapter of target i drops its input with
    keep ~ Bernoulli(1 - p) from fold_in^4(key(seed), n, 0, l, i); its grad_norm equals that of the plain model's
    loss whose adapter inputs are multiplied by those masks / (1 - p) (a dense reference built here)."""
    model, step = trained(adapted), 3
    cfg = GRPOConfig(**CFG)
    learner, plain = GRPOLearner(cfg, with_dropout(model, DROPOUT), seed=SEED), GRPOLearner(cfg, model)
    state = learner.init_state()
    batch = fill(learner, state, make_batch())
    _, metrics = learner.update(state.replace(step=jnp.asarray(step, jnp.int32)), batch)

    mcfg, rows = model.cfg, B * LENGTH
    widths = {LoRATarget.O: mcfg.num_heads * mcfg.head_dim, LoRATarget.DOWN: mcfg.intermediate_size}
    micro_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(SEED), step), 0)
    masks = [np.asarray(jax.random.bernoulli(jax.random.fold_in(jax.random.fold_in(micro_key, layer), index), 1 - DROPOUT,
                                             (rows, widths.get(target, mcfg.hidden_size))))
             for layer in range(mcfg.num_layers) for index, target in enumerate(LoRATarget)]
    calls = []

    def reference_call(self, x, dtype, dropout_key=None):
        keep = masks[len(calls)]
        calls.append(None)
        a, b = self.a.get_value().astype(dtype), self.b.get_value().astype(dtype)
        return ((x * jnp.asarray(keep / (1 - DROPOUT), dtype)) @ a.reshape(-1, a.shape[-1])) @ (b.reshape(b.shape[0], -1) * self.scale)

    monkeypatch.setattr(Adapter, "__call__", reference_call)
    inputs = update_inputs(batch, cfg)
    trainable, frozen = split_trainable(plain.actor_params(plain.params))
    grads = jax.jit(jax.grad(lambda p: plain._loss(nnx.merge_state(p, frozen), inputs, policy_denominators(cfg, inputs))[0]))(trainable)
    assert len(calls) == len(masks)
    want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-4)
