"""The pure train and eval steps: (state, batch, rng) -> (state, metrics).

Batch keys (DESIGN.md): tokens int32[N, L], valid_tokens bool[N, L], labels int32[N] (a label < 0
marks a padding example that counts nowhere). Packed rows (data.packing) add segment_ids int32[N, L]
and carry labels int32[N, S], one per segment slot: the classifier pools per segment and the loss is
taken over the N*S slots, so it is the same per-example loss as the padded batch of those examples.
Compiled in one place (train/parallel.py). With `axis_name` (pmap) gradients and metrics are
reduced over that axis (`loss_and_grads`); those `psum`s are the only collectives in the code base.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax

from train.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def check_batch(batch: Batch) -> None:
    packed = "segment_ids" in batch
    chex.assert_rank([batch["tokens"], batch["valid_tokens"], batch["labels"]], [2, 2, 2 if packed else 1])
    chex.assert_type([batch["tokens"], batch["valid_tokens"], batch["labels"]], [jnp.int32, jnp.bool_, jnp.int32])
    chex.assert_equal_shape([batch["tokens"], batch["valid_tokens"]])
    chex.assert_equal_shape_prefix([batch["tokens"], batch["labels"]], 1)
    if packed:
        chex.assert_equal_shape([batch["tokens"], batch["segment_ids"]])
        chex.assert_type(batch["segment_ids"], jnp.int32)


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy over real examples (label >= 0), and the sums needed to average across shards."""
    chex.assert_rank(logits, 2)
    real = labels >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    count = jnp.sum(real)
    loss_sum = jnp.sum(jnp.where(real, losses, 0.0))
    correct = jnp.sum(jnp.where(real, jnp.argmax(logits, -1) == labels, False))
    loss = loss_sum / jnp.maximum(count, 1)
    return loss, {"loss_sum": loss_sum, "correct": correct, "count": count}


def batch_loss(logits: jax.Array, batch: Mapping[str, Any]) -> jax.Array:
    """The mean cross-entropy of `logits` against the batch's labels (the diagnostics' loss_fn form)."""
    return classification_loss(logits, batch["labels"])[0]


def _forward(
    params: Any, state: TrainState, batch: Batch, train: bool, rng: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """(logits [E, C], labels [E]): E = N examples, or N*S segment slots for packed rows."""
    rngs = {"dropout": rng} if rng is not None else None
    if "segment_ids" not in batch:
        logits = state.apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], train=train, rngs=rngs)
        return logits, batch["labels"]
    logits = state.apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], train=train, rngs=rngs,
                            segment_ids=batch["segment_ids"], num_segments=batch["labels"].shape[1])  # [N, S, C]
    return logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)


def loss_and_grads(
    state: TrainState, batch: Batch, rng: jax.Array | None, axis_name: str | None = None
) -> tuple[jax.Array, Metrics, Any]:
    """(mean loss over the real examples of the whole batch, their sums, gradients of that loss).

    With `axis_name` each device holds one shard of the batch. A mean of per-device means would
    weight a shard with fewer real examples (label < 0 padding) too much, so each device divides its
    loss sum by the whole batch's real count and the per-device gradients are summed: the result is
    the single-device gradient of the same batch, whatever the split.
    """
    check_batch(batch)

    def loss_fn(params: Any) -> tuple[jax.Array, Metrics]:
        loss, sums = classification_loss(*_forward(params, state, batch, True, rng))
        if axis_name is not None:
            loss = sums["loss_sum"] / jnp.maximum(jax.lax.psum(sums["count"], axis_name), 1)
        return loss, sums

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    if axis_name is not None:
        grads, loss, sums = jax.lax.psum((grads, loss, sums), axis_name)
    return loss, sums, grads


def train_step(
    state: TrainState, batch: Batch, rng: jax.Array, axis_name: str | None = None
) -> tuple[TrainState, Metrics]:
    """One optimizer update. rng is this step's dropout key (fold the step into a run key)."""
    loss, sums, grads = loss_and_grads(state, batch, rng, axis_name)
    grad_norm = optax.tree.norm(grads)
    new_state = state.apply_gradients(grads=grads)
    metrics = {
        "loss": loss,
        "accuracy": sums["correct"] / jnp.maximum(sums["count"], 1),
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


def eval_step(state: TrainState, batch: Batch, axis_name: str | None = None) -> Metrics:
    """Inference mode: train=False (no dropout) and no gradients. Returns sums to aggregate a split."""
    check_batch(batch)
    _, sums = classification_loss(*_forward(state.params, state, batch, False, None))
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    return sums
