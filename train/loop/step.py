"""The pure train and eval steps: (state, batch, rng) -> (state, metrics), for any task (train/tasks/base.py).

`gradient_step` is the one place a gradient is taken and applied; the trainer's step, the Pre-LN/Post-LN
study and the benchmarks all go through it. Steps are compiled in one place (train/devices/runners.py). With
`axis_name` (pmap) gradients and sums are reduced over that axis; those `psum`s are the only collectives
in the code base (under sharded jit XLA inserts its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from train.loop.state import frozen_labels
from train.tasks import Task

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
State = TypeVar("State", bound=train_state.TrainState)
LossFn = Callable[[Any], tuple[jax.Array, Any]]  # params -> (loss, auxiliary outputs)


def gradient_step(state: State, loss_fn: LossFn, axis_name: str | None = None) -> tuple[State, jax.Array, Any, Any]:
    """(updated state, loss, aux, gradients): one optimizer update on the gradient of `loss_fn`.

    With `axis_name` the loss, aux and gradients are summed over that axis before the update, so
    `loss_fn` must return this device's share of the global loss (its sum over the global count).

    Leaves the optimizer freezes (`state.frozen`, from optim.freeze) enter `loss_fn` as constants: their
    gradient is never computed (for a frozen token table, a dense [V, D] scatter-add the optimizer would
    throw away) nor summed over `axis_name`, and it is returned as zeros.
    """
    frozen = _frozen_flags(state)
    if not any(frozen):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        if axis_name is not None:
            grads, loss, aux = jax.lax.psum((grads, loss, aux), axis_name)
        return state.apply_gradients(grads=grads), loss, aux, grads
    leaves, tree = jax.tree.flatten(state.params)
    fixed = [x for x, f in zip(leaves, frozen, strict=True) if f]

    def merged(trained: list[Any], others: list[Any]) -> Any:
        it_t, it_o = iter(trained), iter(others)
        return jax.tree.unflatten(tree, [next(it_o) if f else next(it_t) for f in frozen])

    def trained_loss(trained: list[Any]) -> tuple[jax.Array, Any]:
        return loss_fn(merged(trained, fixed))

    trained = [x for x, f in zip(leaves, frozen, strict=True) if not f]
    (loss, aux), part = jax.value_and_grad(trained_loss, has_aux=True)(trained)
    if axis_name is not None:
        part, loss, aux = jax.lax.psum((part, loss, aux), axis_name)
    grads = merged(part, [jnp.zeros_like(x) for x in fixed])
    new_state = state.apply_gradients(grads=grads)
    # The optimizer's update of a frozen leaf is 0; taking the leaf as it was (rather than leaf + 0 out of
    # apply_if_finite's conditional, which XLA does not see through) leaves no pass over it in the program.
    new_leaves = jax.tree.leaves(new_state.params)
    it = iter(fixed)
    params = jax.tree.unflatten(tree, [next(it) if f else x for x, f in zip(new_leaves, frozen, strict=True)])
    return new_state.replace(params=params), loss, aux, grads


def _frozen_flags(state: Any) -> list[bool]:
    """Per leaf of state.params (flattening order): whether optim.freeze names it."""
    patterns = getattr(state, "frozen", ())
    if not patterns:
        return [False] * len(jax.tree.leaves(state.params))
    return [label == "frozen" for label in jax.tree.leaves(frozen_labels(state.params, patterns))]


def loss_fn_for(task: Task, state: train_state.TrainState, batch: Batch, rng: jax.Array | None,
                axis_name: str | None = None) -> LossFn:
    """params -> (mean loss over the real items of the whole batch, this device's sums).

    A mean of per-device means would weight a shard with fewer real items (padding) too much, so each
    device divides its loss sum by the whole batch's count; summing the per-device gradients then gives
    the single-device gradient of the same batch, whatever the split.
    """

    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        sums = task.sums(task.apply(state.apply_fn, params, batch, train=True, rng=rng), batch)
        count = sums["count"] if axis_name is None else jax.lax.psum(sums["count"], axis_name)
        return sums["loss_sum"] / jnp.maximum(count, 1), sums

    return loss_fn


def train_step(
    task: Task, state: Any, batch: Batch, rng: jax.Array, axis_name: str | None = None
) -> tuple[Any, Metrics]:
    """One optimizer update of a train/loop/state.py TrainState. rng is this step's dropout key (fold the
    step into a run key). Metrics: the task's (loss first), grad_norm, lr, non-finite counters, tokens."""
    task.check_batch(batch)
    new_state, loss, sums, grads = gradient_step(state, loss_fn_for(task, state, batch, rng, axis_name), axis_name)
    grad_norm = optax.tree.norm(grads)
    metrics = {
        **task.metrics(sums),
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": jnp.asarray(state.lr_schedule(state.step), jnp.float32),
        "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
        "nonfinite_consecutive": new_state.opt_state.notfinite_count,
        "nonfinite_total": new_state.opt_state.total_notfinite,
        "tokens": jnp.sum(batch["valid_tokens"], dtype=jnp.int32),
    }
    if axis_name is not None:
        metrics["tokens"] = jax.lax.psum(metrics["tokens"], axis_name)
    return new_state, metrics


def eval_step(task: Task, state: Any, batch: Batch, axis_name: str | None = None) -> Metrics:
    """Inference mode: train=False (no dropout) and no gradients. Returns the task's sums, which an
    evaluation adds over batches (train/evaluation.py)."""
    task.check_batch(batch)
    sums = task.sums(task.apply(state.apply_fn, state.params, batch, train=False, rng=None), batch)
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    return sums
