"""TrainState and the optimizer it carries (Optax chain: clipping, AdamW/SGD, schedule, accumulation)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import struct
from flax.training import train_state

from jaxblock.initializers import abstract_params, init_boxed
from train.config import ConfigError, OptimConfig


class TrainState(train_state.TrainState):
    """Flax TrainState plus the learning-rate schedule (for the `lr` metric) and the optim.freeze patterns.

    The update is wrapped in optax.apply_if_finite: a non-finite gradient leaves params and
    optimizer state untouched, and `opt_state.notfinite_count` counts consecutive skips. `frozen`: the
    patterns of the leaves the optimizer leaves alone, which train/loop/step.py therefore does not
    differentiate.
    """

    lr_schedule: Callable[[Any], Any] = struct.field(pytree_node=False)
    frozen: tuple[str, ...] = struct.field(pytree_node=False, default=())


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warm = min(cfg.warmup_steps, max(total_steps - 1, 0))
    decay = max(total_steps - warm, 1)
    end = cfg.lr * cfg.end_lr_ratio
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.end_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay)
    else:
        after = optax.constant_schedule(cfg.lr)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), after], [warm])


def decay_mask(params: Any, decay_embeddings: bool) -> Any:
    """True for leaves that take weight decay: matrices, not norms/biases (nor embeddings unless asked)."""

    def rule(path: tuple[Any, ...], leaf: Any) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        if name in ("embedding", "pos_embedding"):
            return decay_embeddings
        return name == "kernel"

    return jax.tree_util.tree_map_with_path(rule, params)


def frozen_labels(params: Any, patterns: list[str] | tuple[str, ...]) -> Any:
    """"frozen" for the leaves optim.freeze names (a glob over the leaf's name or its slash path), else
    "train". ConfigError for a pattern that names no parameter."""
    def path_of(path: tuple[Any, ...]) -> str:
        return "/".join(str(getattr(p, "key", p)) for p in path)

    paths = [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p.rsplit("/", 1)[-1], pattern)
                   for p in paths):
            raise ConfigError(f"optim.freeze: '{pattern}' names no parameter: use a name or slash path such as "
                              f"{paths[0] if paths else 'encoder/embedding'}")

    def label(path: tuple[Any, ...], leaf: Any) -> str:
        full = path_of(path)
        hit = any(fnmatch.fnmatchcase(full, pt) or fnmatch.fnmatchcase(full.rsplit("/", 1)[-1], pt) for pt in patterns)
        return "frozen" if hit else "train"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[Any, optax.Schedule]:
    schedule = make_schedule(cfg, total_steps)
    parts: list[optax.GradientTransformation] = []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    if cfg.optimizer == "adamw":
        parts.append(
            optax.adamw(
                schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                mask=lambda p: decay_mask(p, cfg.decay_embeddings),
            )
        )
    else:
        parts.append(optax.sgd(schedule, momentum=cfg.momentum or None))
    tx: Any = optax.chain(*parts)
    if cfg.freeze:  # frozen leaves: a zero update and no Adam moments (clipping sees the trained ones only)
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                   lambda p: frozen_labels(p, cfg.freeze))
    if cfg.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum)
    # The loop halts after train.max_nonfinite consecutive skips; this bound only keeps optax from ever
    # applying a non-finite update on its own.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=10**6)
    return tx, schedule


def create_state(
    model: nn.Module, params: Any, optim: OptimConfig, total_steps: int
) -> TrainState:
    tx, schedule = make_optimizer(optim, total_steps)
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, lr_schedule=schedule,
                             frozen=tuple(optim.freeze))


def init_params(model: nn.Module, seed: int, batch_len: int) -> Any:
    """Unboxed float params from a dummy [1, L] batch (jaxblock.initializers.init_boxed with its logical
    axis metadata stripped; the abstract twin, for shapes and logical PartitionSpecs, is `abstract_init`)."""
    return nn.unbox(init_boxed(model, seed, batch_len))


def abstract_init(model: nn.Module, batch_len: int) -> tuple[Any, Any]:
    """(parameter shapes and dtypes, their logical PartitionSpecs) from one abstract init
    (jaxblock.initializers.abstract_params, kept per model): nothing is computed, and the specs come from
    the same boxed tree the shapes are unboxed from."""
    boxed = abstract_params(model, batch_len)
    return nn.unbox(boxed), nn.get_partition_spec(boxed)
