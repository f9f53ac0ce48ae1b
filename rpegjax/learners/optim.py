"""Optimiser configuration: AdamW with global-norm clipping and a warm-up + constant/cosine schedule."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from rpegjax.options import OptimizerSharding, parse_choice


class Schedule(enum.StrEnum):
    CONSTANT = "constant"  # linear warm-up, then constant
    COSINE = "cosine"  # linear warm-up, then cosine decay to min_lr_ratio * lr at total_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW; one optimiser step per mini-batch, and the schedule counts those steps.

    `weight_decay_matrices_only` decays only parameters of rank >= 2 (not norms, biases or the value
    bias), as Hugging Face trainers do.
    """

    learning_rate: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    weight_decay_matrices_only: bool = True
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    schedule: Schedule = Schedule.CONSTANT
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", _schedule(self.schedule))
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"OptimizerConfig.learning_rate must be positive, got {self.learning_rate!r}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.eps <= 0:
            raise ValueError(f"OptimizerConfig.eps must be positive, got {self.eps!r}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be positive or None, got {self.max_grad_norm!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.schedule == Schedule.COSINE:
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"OptimizerConfig.total_steps must exceed warmup_steps={self.warmup_steps} for the cosine "
                    f"schedule, got {self.total_steps!r}"
                )
        elif self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"OptimizerConfig.total_steps must be positive or None, got {self.total_steps!r}")


def _schedule(value: Schedule | str) -> Schedule:
    try:
        return Schedule(value)
    except ValueError:
        raise ValueError(f"OptimizerConfig.schedule must be one of {[s.value for s in Schedule]}, got {value!r}") from None


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """lr(step): linear from 0 to lr over `warmup_steps` (lr * (step + 1) / warmup_steps, so the first
    step already moves), then constant, or cosine from lr to min_lr_ratio * lr at `total_steps`."""
    lr = cfg.learning_rate

    def warmup(step):
        return lr * jax.numpy.minimum((step + 1) / max(cfg.warmup_steps, 1), 1.0)

    if cfg.schedule == Schedule.CONSTANT:
        return warmup if cfg.warmup_steps else optax.constant_schedule(lr)
    decay_steps = cfg.total_steps - cfg.warmup_steps
    cosine = optax.cosine_decay_schedule(lr, decay_steps, alpha=cfg.min_lr_ratio)
    if not cfg.warmup_steps:
        return cosine
    return optax.join_schedules([warmup, cosine], [cfg.warmup_steps])


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) then AdamW(schedule); the optimiser state mirrors the params tree."""
    adamw = optax.adamw(
        make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        mask=_decay_mask if cfg.weight_decay_matrices_only else None,
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


def split_over_data(sharding: NamedSharding, shape: Sequence[int], data_axes: Sequence[str]) -> NamedSharding:
    """An optimiser buffer's sharding under ZeRO-1 (`OptimizerSharding.DATA`): its parameter's `sharding`, also
    split over the mesh axes of `data_axes` (the batch's) that it is replicated on. They go on the first dimension
    whose size they divide together with the axes already there (after those, so that each device's slice lies
    inside its parameter shard); a buffer with no such dimension (a short bias or norm) keeps `sharding`."""
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {name for entry in spec for name in _names(entry)}
    extra = tuple(name for name in data_axes if mesh.shape.get(name, 1) > 1 and name not in used)
    if not extra:
        return sharding
    for dim, entry in enumerate(spec):
        names = _names(entry) + extra
        if shape[dim] % math.prod(mesh.shape[name] for name in names) == 0:
            spec[dim] = names
            return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)
    return sharding


def _names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def optimizer_data_axes(sharding: OptimizerSharding, rows: NamedSharding | None) -> tuple[str, ...]:
    """The mesh axes a learner splits its optimiser buffers over besides their parameters' (`train_state_shardings`):
    the axes of its batch rows `rows` under ZeRO-1, none otherwise."""
    sharding = parse_choice(OptimizerSharding, sharding, "optimizer_sharding")
    if sharding is OptimizerSharding.PARAMS or rows is None:
        return ()
    spec = rows.spec[0] if rows.spec else None
    return _names(spec)
