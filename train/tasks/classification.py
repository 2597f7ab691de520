"""Classification: one label per example (per segment slot for packed rows), from a labelled source
(the vaderSentiment sets, a local file, a synthetic task; train/data/labelled.py), softmax cross-entropy,
accuracy, class probabilities for prediction."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxblock.config import EncoderConfig
from jaxblock.model import Classifier
from train.config import STREAMED_SOURCES, Config, ConfigError, config_from_dict
from train.data import labelled as data
from train.data.batches import BatchSource, InMemoryBatches
from train.data.tokenizer import Tokenizer
from train.tasks.base import Batch, Exported, Sums, TaskData, ratio


class ClassificationTask:
    """One label per example (per segment slot for packed rows): softmax cross-entropy over the C
    classes, accuracy, probabilities for prediction. Labels < 0 mark padding examples."""

    name = "classification"
    target_keys: tuple[str, ...] = ("labels",)
    count_name = "examples"
    pad_values: Mapping[str, int] = {"labels": -1, "segment_ids": -1}
    higher_is_better: Mapping[str, bool] = {"loss": False, "accuracy": True}
    main_metric = "accuracy"
    renamed_metrics: Mapping[str, str] = {}
    predicts_labels = True

    @classmethod
    def from_config(cls, config: Config) -> ClassificationTask:
        return cls()

    def build_model(self, config: EncoderConfig) -> nn.Module:
        return Classifier(config)

    def target_shapes(self, rows: int, length: int, segments: int | None) -> dict[str, jax.ShapeDtypeStruct]:
        return {"labels": jax.ShapeDtypeStruct((rows,) if segments is None else (rows, segments), jnp.int32)}

    def exported(self, config: EncoderConfig, params: Any) -> Exported:
        """Logits, probabilities and the embeddings: the encoder's output pooled as the head reads it, before
        any pooler dense."""
        from jaxblock.model import Encoder, pool_tokens

        classifier = Classifier(config)

        def classify(p: Any, tokens: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
            logits, state = classifier.apply(
                {"params": p}, tokens, valid, mutable=["intermediates"],
                capture_intermediates=lambda mdl, method: isinstance(mdl, Encoder) and method == "__call__")
            hidden = state["intermediates"]["encoder"]["__call__"][0]  # [b, l, D]
            return {"logits": logits, "probabilities": jax.nn.softmax(logits, axis=-1),
                    "embeddings": pool_tokens(config.pooler.pooling, hidden, valid)}

        return Exported("classifier", classify, params,
                        f"{config.pooler.pooling} (the encoder's output as the head reads it, before any pooler)")

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

    # --- the data ---

    def check_config(self, config: Config) -> None:
        if config.data.source in STREAMED_SOURCES:
            raise ConfigError(f"data.source={config.data.source} is unlabelled text: set task=mlm, or pick a "
                              "labelled source")

    def load_data(self, config: Config, *, tokenizer_dir: Path | None, tokenizer: Tokenizer | None = None
                  ) -> data.Dataset:
        have_own = tokenizer_dir is not None and tokenizer_dir.is_dir()
        return data.load_dataset(config.data, tokenizer_dir=tokenizer_dir if have_own else None,
                                 tokenizer=tokenizer if not have_own else None)

    def resolve(self, config: Config, dataset: TaskData) -> Config:
        """The config with what the data decides: vocabulary size (tokenizer) and number of classes."""
        return resolve_labelled(config, dataset, num_classes=len(dataset.label_names))

    def resolve_shapes(self, config: Config, vocab_size: int, labels: list[str]) -> Config:
        return self.resolve(config, _StandIn(vocab_size, labels))

    def make_batches(self, dataset: TaskData, config: Config, share: tuple[int, int] = (0, 1),
                     *, training: bool = True) -> BatchSource:
        assert isinstance(dataset, data.Dataset)
        return InMemoryBatches(dataset, config, share)

    def run_record(self, dataset: TaskData, batches: BatchSource) -> dict[str, Any]:
        return {}


class _StandIn:
    """What `resolve_labelled` reads of a data set, given without one (ahead-of-time compiles)."""

    def __init__(self, vocab_size: int, labels: list[str]):
        self.tokenizer: Any = type("Vocabulary", (), {"vocab_size": vocab_size})()
        self.label_names = labels
        self.truncated: dict[str, int] = {}

    def summary(self) -> str:
        return f"vocabulary {self.tokenizer.vocab_size}, classes {self.label_names} (no data read)"


def resolve_labelled(config: Config, dataset: TaskData, num_classes: int) -> Config:
    """A labelled run's config with the tokenizer's vocabulary, `num_classes` outputs and data.path made
    absolute (evaluate and resume work from any directory); packing and bucket settings checked."""
    raw = config.model_dump(mode="json")
    raw["model"].update(vocab_size=dataset.tokenizer.vocab_size, num_classes=num_classes)
    if raw["data"].get("path"):
        raw["data"]["path"] = str(Path(raw["data"]["path"]).expanduser().absolute())
    resolved = config_from_dict(raw)
    if resolved.data.packing and resolved.model.pooler.pooling != "mean":
        raise ConfigError(f"data.packing=true pools each packed example by its mean, but model.pooler.pooling="
                          f"'{resolved.model.pooler.pooling}': set data.packing=false (or model.pooler.pooling=mean)")
    if resolved.data.buckets[-1] > resolved.model.max_len:
        raise ConfigError(
            f"model.max_len={resolved.model.max_len} is shorter than the largest bucket {resolved.data.buckets[-1]} "
            f"in data.buckets: raise model.max_len to >= {resolved.data.buckets[-1]} or drop that bucket"
        )
    return resolved


def classification_sums(logits: jax.Array, labels: jax.Array) -> Sums:
    """Cross-entropy and correct-prediction sums over real examples (label >= 0) of logits [E, C]."""
    chex.assert_rank(logits, 2)
    real = labels >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    return {"loss_sum": jnp.sum(jnp.where(real, losses, 0.0)),
            "correct": jnp.sum(jnp.where(real, jnp.argmax(logits, -1) == labels, False)),
            "count": jnp.sum(real)}


CLASSIFICATION = ClassificationTask()
TASK = ClassificationTask  # what train/tasks/__init__.py registers
