"""Tasks: what differs between training objectives, behind one interface the step and the loop use.

A task owns the batch keys beyond the inputs, the model (encoder plus its head), the forward pass on a
batch, the loss and the metrics, how an evaluation is reduced and what a prediction returns. The step
(train/loop/step.py), the loop (train/loop/trainer.py), the runner (train/devices/runners.py) and the inference API
(train/inference.py) call only these methods, so a new objective plugs in as one more class.

Every batch carries the inputs tokens int32[N, L] and valid_tokens bool[N, L] (True = a real token, real
tokens first); packed rows add segment_ids int32[N, L] (-1 on padding). A task adds its targets, e.g.
classification: labels int32[N] (int32[N, S] for packed rows, one per segment slot; < 0 = counts nowhere);
masked-language modelling: mlm_targets int32[N, L] and mlm_weights float32[N, L] (1 on chosen tokens).

Losses are returned as *sums* with a *count* (`loss_sum`, `count`, plus metric sums such as `correct`):
with data parallelism each device divides its own sum by the global count, so the gradient is that of
the whole batch whatever the split, and an evaluation adds sums over batches before dividing once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxblock.config import EncoderConfig
from jaxblock.mlm import MaskedLM, select_positions
from jaxblock.model import Classifier

Batch = Mapping[str, Any]
Sums = dict[str, Any]  # float or int arrays, reduced by summation (over devices, then over batches)


def ratio(total: Any, count: Any) -> Any:
    """total / max(count, 1) for a count >= 0, on Python numbers and traced arrays alike."""
    return total / (count + (count == 0))


class Task(Protocol):
    """The objective-specific part of training, evaluation and inference."""

    name: str  # e.g. "classification"; recorded nowhere, for messages
    target_keys: tuple[str, ...]  # batch keys beyond tokens/valid_tokens/segment_ids, e.g. ("labels",)
    count_name: str  # what `count` counts, e.g. "examples" or "tokens"
    pad_values: Mapping[str, int]  # fill of each batch key in rows added to split a batch over devices

    def build_model(self, config: EncoderConfig) -> nn.Module:
        """The encoder with this task's head, taking (tokens, valid_tokens, ...)."""
        ...

    def check_batch(self, batch: Batch) -> None:
        """Raise (chex) on missing keys, wrong ranks or dtypes; traced, costs nothing at run time."""
        ...

    def apply(self, apply_fn: Any, params: Any, batch: Batch, *, train: bool, rng: jax.Array | None) -> Any:
        """The model's outputs on `batch` (e.g. logits), dropout on when `train` with key `rng`."""
        ...

    def sums(self, outputs: Any, batch: Batch) -> Sums:
        """`loss_sum`, `count` and the sums behind each metric, over this batch's real items."""
        ...

    def metrics(self, sums: Sums) -> dict[str, Any]:
        """Averages from (possibly accumulated) sums: "loss" first, then the task's metrics."""
        ...

    def loss(self, outputs: Any, batch: Batch) -> jax.Array:
        """The mean loss of `outputs` on `batch`: the form jaxblock.diagnostics takes (loss_fn)."""
        ...

    def predict(self, outputs: Any) -> dict[str, jax.Array]:
        """What a prediction returns per row, e.g. probabilities [N, C]."""
        ...


class ClassificationTask:
    """One label per example (per segment slot for packed rows): softmax cross-entropy over the C
    classes, accuracy, probabilities for prediction. Labels < 0 mark padding examples."""

    name = "classification"
    target_keys: tuple[str, ...] = ("labels",)
    count_name = "examples"
    pad_values: Mapping[str, int] = {"labels": -1, "segment_ids": -1}

    def build_model(self, config: EncoderConfig) -> nn.Module:
        return Classifier(config)

    def check_batch(self, batch: Batch) -> None:
        packed = "segment_ids" in batch
        chex.assert_rank([batch["tokens"], batch["valid_tokens"], batch["labels"]], [2, 2, 2 if packed else 1])
        chex.assert_type([batch["tokens"], batch["valid_tokens"], batch["labels"]], [jnp.int32, jnp.bool_, jnp.int32])
        chex.assert_equal_shape([batch["tokens"], batch["valid_tokens"]])
        chex.assert_equal_shape_prefix([batch["tokens"], batch["labels"]], 1)
        if packed:
            chex.assert_equal_shape([batch["tokens"], batch["segment_ids"]])
            chex.assert_type(batch["segment_ids"], jnp.int32)

    def apply(self, apply_fn: Any, params: Any, batch: Batch, *, train: bool, rng: jax.Array | None) -> jax.Array:
        """Logits [N, C], or [N*S, C] for packed rows (the classifier pools per segment)."""
        rngs = {"dropout": rng} if rng is not None else None
        if "segment_ids" not in batch:
            return apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], train=train, rngs=rngs)
        logits = apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], train=train, rngs=rngs,
                          segment_ids=batch["segment_ids"], num_segments=batch["labels"].shape[1])  # [N, S, C]
        return logits.reshape(-1, logits.shape[-1])

    def sums(self, outputs: jax.Array, batch: Batch) -> Sums:
        return classification_sums(outputs, batch["labels"].reshape(-1))

    def metrics(self, sums: Sums) -> dict[str, Any]:
        return {"loss": ratio(sums["loss_sum"], sums["count"]), "accuracy": ratio(sums["correct"], sums["count"])}

    def loss(self, outputs: jax.Array, batch: Batch) -> jax.Array:
        sums = self.sums(outputs, batch)
        return ratio(sums["loss_sum"], sums["count"])

    def predict(self, outputs: jax.Array) -> dict[str, jax.Array]:
        return {"probabilities": jax.nn.softmax(outputs, axis=-1)}  # [N, C]


def classification_sums(logits: jax.Array, labels: jax.Array) -> Sums:
    """Cross-entropy and correct-prediction sums over real examples (label >= 0) of logits [E, C]."""
    chex.assert_rank(logits, 2)
    real = labels >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    return {"loss_sum": jnp.sum(jnp.where(real, losses, 0.0)),
            "correct": jnp.sum(jnp.where(real, jnp.argmax(logits, -1) == labels, False)),
            "count": jnp.sum(real)}


CLASSIFICATION = ClassificationTask()


class MaskedLMTask:
    """Masked-language modelling: predict the original id of each chosen token (train/data/masking.py corrupts
    the batch on the host). Batch keys beyond the inputs: mlm_targets int32[N, L] (original ids) and
    mlm_weights float32[N, L] (1.0 on chosen real tokens, else 0). The model predicts only at P chosen
    positions per row (`jaxblock.mlm.select_positions`); loss and accuracy count chosen tokens only, so
    padding, unchosen tokens and the rows added to split a batch over devices (weights 0) count nowhere.

    Packed rows (segment_ids) attend within their example. Outputs of `apply`: {"logits": float32[N, P, V],
    "positions": int32[N, P], "weights": bool[N, P]}; `sums`/`loss` also take full logits float32[N, L, V]
    (what the diagnostics' plain forward pass returns).
    """

    name = "mlm"
    target_keys: tuple[str, ...] = ("mlm_targets", "mlm_weights")
    count_name = "tokens"
    pad_values: Mapping[str, int] = {"mlm_targets": 0, "mlm_weights": 0, "segment_ids": -1}

    def __init__(self, *, rate: float = 0.15, tie_embeddings: bool = True, transform: bool = True,
                 predictions_per_row: int | None = None):
        self.rate, self.tie_embeddings, self.transform = rate, tie_embeddings, transform
        self.predictions_per_row = predictions_per_row

    def build_model(self, config: EncoderConfig) -> nn.Module:
        return MaskedLM(config, tie_embeddings=self.tie_embeddings, transform=self.transform)

    def predictions(self, length: int) -> int:
        """P for rows of `length` tokens: enough for whole-word masking's spread around rate * L."""
        p = self.predictions_per_row or math.ceil(1.6 * self.rate * length) + 2
        return max(1, min(p, length))

    def check_batch(self, batch: Batch) -> None:
        keys = [batch["tokens"], batch["valid_tokens"], batch["mlm_targets"], batch["mlm_weights"]]
        chex.assert_rank(keys, 2)
        chex.assert_type(keys, [jnp.int32, jnp.bool_, jnp.int32, jnp.float32])
        chex.assert_equal_shape(keys)
        if "segment_ids" in batch:
            chex.assert_equal_shape([batch["tokens"], batch["segment_ids"]])
            chex.assert_type(batch["segment_ids"], jnp.int32)

    def apply(self, apply_fn: Any, params: Any, batch: Batch, *, train: bool, rng: jax.Array | None) -> dict[str, Any]:
        rngs = {"dropout": rng} if rng is not None else None
        chosen = (batch["mlm_weights"] > 0) & batch["valid_tokens"]
        positions, weights = select_positions(chosen, self.predictions(chosen.shape[1]))  # [N, P]
        logits = apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], positions=positions,
                          segment_ids=batch.get("segment_ids"), train=train, rngs=rngs)  # [N, P, V]
        return {"logits": logits, "positions": positions, "weights": weights}

    def sums(self, outputs: Any, batch: Batch) -> Sums:
        if isinstance(outputs, dict):
            logits, weights = outputs["logits"], outputs["weights"]
            targets = jnp.take_along_axis(batch["mlm_targets"], outputs["positions"], axis=1)  # [N, P]
        else:  # full logits [N, L, V]
            logits, targets = outputs, batch["mlm_targets"]
            weights = (batch["mlm_weights"] > 0) & batch["valid_tokens"]
        chex.assert_rank(logits, 3)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        # where, not multiply: a filler slot's non-finite loss must not reach the sum (0 * NaN = NaN).
        return {"loss_sum": jnp.sum(jnp.where(weights, losses, 0.0)),
                "correct": jnp.sum(jnp.where(weights, jnp.argmax(logits, -1) == targets, False)),
                "count": jnp.sum(weights)}

    def metrics(self, sums: Sums) -> dict[str, Any]:
        """loss: mean cross-entropy per chosen token; accuracy: masked-token accuracy."""
        return {"loss": ratio(sums["loss_sum"], sums["count"]), "accuracy": ratio(sums["correct"], sums["count"])}

    def loss(self, outputs: Any, batch: Batch) -> jax.Array:
        sums = self.sums(outputs, batch)
        return ratio(sums["loss_sum"], sums["count"])

    def predict(self, outputs: Any) -> dict[str, jax.Array]:
        """The most likely original id at each predicted position: predicted_ids int32[N, P] (-1 in filler
        slots) and its probability [N, P]."""
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs
        probs = jax.nn.softmax(logits, axis=-1)
        ids = jnp.argmax(logits, -1).astype(jnp.int32)
        if isinstance(outputs, dict):
            ids = jnp.where(outputs["weights"], ids, -1)
        return {"predicted_ids": ids, "probability": jnp.max(probs, -1)}


def task_for(config: Any) -> Task:
    """The task a train/config.py Config names (`task`, `mlm.*`)."""
    if config.task == "mlm":
        m = config.mlm
        return MaskedLMTask(rate=m.rate, tie_embeddings=m.tie_embeddings, transform=m.transform,
                            predictions_per_row=m.predictions_per_row)
    return CLASSIFICATION
