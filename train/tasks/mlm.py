"""Masked-language modelling: pretraining on streamed unlabelled text (train/data/pretrain.py, stream.py),
cross-entropy at the masked positions, masked-token accuracy, the most likely ids for prediction."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock.config import EncoderConfig
from jaxblock.mlm import MaskedLM, cross_entropy, select_positions
from train.config import STREAMED_SOURCES, Config, ConfigError, config_from_dict
from train.data.batches import BatchSource, StreamBatches
from train.data.masking import prediction_slots
from train.data.pretrain import CorpusData, load_corpus
from train.data.tokenizer import Tokenizer
from train.tasks.base import Batch, Exported, Sums, TaskData, ratio


class MaskedLMTask:
    """Masked-language modelling: predict the original id of each chosen token (train/data/masking.py corrupts
    the batch on the host). Batch keys beyond the inputs: mlm_targets int32[N, L] (original ids) and
    mlm_weights float32[N, L] (1.0 on chosen real tokens, else 0). The model predicts only at P chosen
    positions per row (`jaxblock.mlm.select_positions`); loss and accuracy count chosen tokens only, so
    padding, unchosen tokens and the rows added to split a batch over devices (weights 0) count nowhere.

    Packed rows (segment_ids) attend within their example. Outputs of `apply`: {"logits": float32[N, P, V],
    "positions": int32[N, P], "weights": bool[N, P]}; `sums`/`loss` also take full logits float32[N, L, V]
    (what the diagnostics' plain forward pass returns). In training with mlm.loss_chunks the model computes the
    loss itself: {"losses": float32[N, P], "predicted": int32[N, P], "targets": int32[N, P], "weights"}.
    """

    name = "mlm"
    target_keys: tuple[str, ...] = ("mlm_targets", "mlm_weights")
    count_name = "tokens"
    pad_values: Mapping[str, int] = {"mlm_targets": 0, "mlm_weights": 0, "segment_ids": -1}
    # Runs saved before the metric had its own name logged it as "accuracy"; their config names
    # checkpoint.best_metric=val_accuracy, refused with the new name (train/tasks/base.py check_ranking).
    higher_is_better: Mapping[str, bool] = {"loss": False, "masked_accuracy": True}
    main_metric = "masked_accuracy"
    renamed_metrics: Mapping[str, str] = {"accuracy": "masked_accuracy"}
    predicts_labels = False

    def __init__(self, *, rate: float = 0.15, tie_embeddings: bool = True, transform: bool = True,
                 predictions_per_row: int | None = None, loss_chunks: int = 0):
        self.rate, self.tie_embeddings, self.transform = rate, tie_embeddings, transform
        self.predictions_per_row, self.loss_chunks = predictions_per_row, loss_chunks

    @classmethod
    def from_config(cls, config: Config) -> MaskedLMTask:
        m = config.mlm
        return cls(rate=m.rate, tie_embeddings=m.tie_embeddings, transform=m.transform,
                   predictions_per_row=m.predictions_per_row, loss_chunks=m.loss_chunks)

    def build_model(self, config: EncoderConfig) -> nn.Module:
        return MaskedLM(config, tie_embeddings=self.tie_embeddings, transform=self.transform)

    def predictions(self, length: int) -> int:
        """P for rows of `length` tokens (train/data/masking.py's prediction_slots; the masking chooses at
        most P tokens a row, so every chosen token has a slot)."""
        return prediction_slots(self.rate, length, self.predictions_per_row)

    def target_shapes(self, rows: int, length: int, segments: int | None) -> dict[str, jax.ShapeDtypeStruct]:
        return {"mlm_targets": jax.ShapeDtypeStruct((rows, length), jnp.int32),
                "mlm_weights": jax.ShapeDtypeStruct((rows, length), jnp.float32)}

    def exported(self, config: EncoderConfig, params: Any) -> Exported:
        """The encoder's embeddings: its output averaged over real tokens."""
        from jaxblock.model import Encoder, masked_mean

        encoder = Encoder(config)

        def embed(p: Any, tokens: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
            hidden: jax.Array = encoder.apply({"params": p["encoder"]}, tokens, valid)  # type: ignore[assignment]
            return {"embeddings": masked_mean(hidden, valid)}

        return Exported("encoder", embed, {"encoder": params["encoder"]}, "mean over real tokens")

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
        inputs = (batch["tokens"], batch["valid_tokens"])
        kw = {"positions": positions, "segment_ids": batch.get("segment_ids"), "train": train, "rngs": rngs}
        if train and self.loss_chunks:  # the loss in the model, its logits remade in the backward pass
            targets = jnp.take_along_axis(batch["mlm_targets"], positions, axis=1)  # [N, P]
            losses, predicted = apply_fn({"params": params}, *inputs, targets=targets, chunks=self.loss_chunks, **kw)
            return {"losses": losses, "predicted": predicted, "targets": targets, "weights": weights}
        logits = apply_fn({"params": params}, *inputs, **kw)  # [N, P, V]
        return {"logits": logits, "positions": positions, "weights": weights}

    def sums(self, outputs: Any, batch: Batch) -> Sums:
        if isinstance(outputs, dict) and "losses" in outputs:  # mlm.loss_chunks: the model's own losses
            losses, predicted, targets = outputs["losses"], outputs["predicted"], outputs["targets"]
            weights = outputs["weights"]
        else:
            if isinstance(outputs, dict):
                logits, weights = outputs["logits"], outputs["weights"]
                targets = jnp.take_along_axis(batch["mlm_targets"], outputs["positions"], axis=1)  # [N, P]
            else:  # full logits [N, L, V]
                logits, targets = outputs, batch["mlm_targets"]
                weights = (batch["mlm_weights"] > 0) & batch["valid_tokens"]
            chex.assert_rank(logits, 3)
            losses, predicted = cross_entropy(logits, targets), jnp.argmax(logits, -1)
        # where, not multiply: a filler slot's non-finite loss must not reach the sum (0 * NaN = NaN).
        return {"loss_sum": jnp.sum(jnp.where(weights, losses, 0.0)),
                "correct": jnp.sum(jnp.where(weights, predicted == targets, False)),
                "count": jnp.sum(weights)}

    def metrics(self, sums: Sums) -> dict[str, Any]:
        """loss: mean cross-entropy per chosen token; masked_accuracy: of the chosen tokens, the share whose
        original id is the most likely prediction."""
        return {"loss": ratio(sums["loss_sum"], sums["count"]),
                "masked_accuracy": ratio(sums["correct"], sums["count"])}

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

    # --- the data ---

    def check_config(self, config: Config) -> None:
        if config.data.source not in STREAMED_SOURCES:
            raise ConfigError("task=mlm reads unlabelled text: set data.source to one of "
                              f"{', '.join(STREAMED_SOURCES)}")
        if config.model.init_from:
            raise ConfigError("model.init_from starts a fine-tuning run; a task=mlm run pretrains from scratch: "
                              "drop model.init_from")
        slots = prediction_slots(config.mlm.rate, config.data.max_len, config.mlm.predictions_per_row)
        if config.mlm.loss_chunks > slots:
            raise ConfigError(f"mlm.loss_chunks={config.mlm.loss_chunks} is more groups than the head's {slots} "
                              f"prediction slots a row: set it to at most {slots}")

    def load_data(self, config: Config, *, tokenizer_dir: Path | None, tokenizer: Tokenizer | None = None
                  ) -> CorpusData:
        return load_corpus(config, tokenizer_dir=tokenizer_dir if tokenizer_dir and tokenizer_dir.is_dir() else None)

    def resolve(self, config: Config, corpus: TaskData) -> Config:
        """The config with what the corpus decides: the embedding rows the masking needs (the tokenizer's
        vocabulary, plus a mask row when the tokenizer has no spare id) and rows of data.max_len."""
        assert isinstance(corpus, CorpusData)
        return self._rows(config, corpus.masking.model_vocab_size)

    def resolve_shapes(self, config: Config, vocab_size: int, labels: list[str]) -> Config:
        """The masking's embedding rows without the corpus: the vocabulary plus the mask id appended after it
        (train/data/masking.py; a pretrained tokenizer's own mask token is within its vocabulary)."""
        return self._rows(config, vocab_size if config.model.init_from else vocab_size + 1)

    def _rows(self, config: Config, model_vocab_size: int) -> Config:
        raw = config.model_dump(mode="json")
        raw["model"].update(vocab_size=model_vocab_size)
        raw["data"].update(buckets=[config.data.max_len])
        resolved = config_from_dict(raw)
        if resolved.data.max_len > resolved.model.max_len:
            raise ConfigError(f"model.max_len={resolved.model.max_len} is shorter than the rows of data.max_len="
                              f"{resolved.data.max_len} tokens: raise model.max_len or lower data.max_len")
        if config.train.batch_size % config.data.stream_shards:
            raise ConfigError(f"train.batch_size={config.train.batch_size} does not divide among data.stream_shards="
                              f"{config.data.stream_shards}: make the batch a multiple of the shard count")
        return resolved

    def make_batches(self, corpus: TaskData, config: Config, share: tuple[int, int] = (0, 1),
                     *, training: bool = True) -> BatchSource:
        if not training:  # evaluation reads the held-out text only: no prefetching worker for training rows
            config = config.model_copy(update={"data": config.data.model_copy(update={"prefetch": "none"})})
        return StreamBatches(corpus, config, share)

    def run_record(self, corpus: TaskData, batches: BatchSource) -> dict[str, Any]:
        """What the masked-token accuracy must beat: always predicting the most frequent training token."""
        assert isinstance(batches, StreamBatches)
        return {"unigram_baseline_accuracy": batches.unigram_accuracy()}


TASK = MaskedLMTask  # what train/tasks/__init__.py registers
