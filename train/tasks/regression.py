"""Regression: one real-valued score per example, predicted by the encoder with a one-output head.

Data: the vaderSentiment sets (data.source rotten_tomatoes, tweets, amazon, nyt) carry each sentence's mean
human rating (about -4 to +4; every sentence kept, neutral ones included), and data.source=synthetic
scores each row of integer symbols by the share of its symbols below synthetic_vocab / 2, in [0, 1] (a
bag-of-symbols target a mean-pooled encoder can learn). Batches are the labelled ones (train/data/
labelled.py, padded or packed) whose `labels` are example indices (-1 = padding); this task adds `scores`
float32 (the same shape) from them, so every batching, packing and resume rule of classification holds.

Loss: mean squared error. Metrics: loss (MSE), mae (mean absolute error) and correlation (Pearson's r
between predictions and scores; the main metric, higher is better). All three are ratios of sums, so an
evaluation adds sums over batches and devices before dividing once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.config import EncoderConfig
from jaxblock.model import Classifier
from train.config import STREAMED_SOURCES, Config, ConfigError
from train.data import labelled as data
from train.data.batches import BatchSource, InMemoryBatches
from train.data.datasets import VADER_FILES, Examples, synthetic_examples, vader_file
from train.data.tokenizer import Tokenizer
from train.errors import DataError
from train.tasks.base import Batch, Exported, Sums, TaskData
from train.tasks.classification import _StandIn, resolve_labelled


def vader_ratings(path: Path) -> tuple[list[str], np.ndarray]:
    """Every `id<TAB>mean rating<TAB>sentence` line of a vaderSentiment ground-truth file."""
    texts, ratings = [], []
    for lineno, line in enumerate(path.read_bytes().decode("utf-8").replace("\r\n", "\n").split("\n"), start=1):
        if not line.strip():
            continue
        parts = line.split("\t", 2)
        try:
            ratings.append(float(parts[1]))
        except (IndexError, ValueError):
            raise DataError(f"{path} line {lineno}: expected id<TAB>rating<TAB>text: delete the file to fetch it "
                            "again") from None
        texts.append(parts[2].strip() if len(parts) == 3 else "")
    return texts, np.asarray(ratings, np.float32)


def synthetic_scores(texts: list[str], vocab: int) -> np.ndarray:
    """The share of each row's symbols below vocab / 2."""
    return np.asarray([np.mean([int(s) < vocab / 2 for s in t.split()]) for t in texts], np.float32)


@dataclass(frozen=True)
class ScoredData:
    """A labelled dataset whose labels are example indices, and the score of every example."""

    dataset: data.Dataset
    scores: np.ndarray  # float32[E], indexed by the labels
    label_names: list[str] = field(default_factory=list)  # no classes

    @property
    def tokenizer(self) -> Tokenizer:
        return self.dataset.tokenizer

    @property
    def truncated(self) -> dict[str, int]:
        return self.dataset.truncated

    def summary(self) -> str:
        sizes = ", ".join(f"{name} {len(getattr(self.dataset, name))}" for name in ("train", "validation", "test"))
        return (f"data: {sizes}; scores {self.scores.min():.2f}..{self.scores.max():.2f} (mean "
                f"{self.scores.mean():.2f}); tokenizer {self.tokenizer.kind} (vocab {self.tokenizer.vocab_size})")


class ScoredBatches:
    """The labelled batches with `scores` float32 (0 where labels < 0) beside the index labels."""

    def __init__(self, inner: InMemoryBatches, scores: np.ndarray):
        self.inner, self.scores = inner, scores

    def _scored(self, batch: data.Batch) -> data.Batch:
        labels = batch["labels"]
        return {**batch, "scores": np.where(labels >= 0, self.scores[np.maximum(labels, 0)], 0.0).astype(np.float32)}

    def batch(self, step: int) -> data.Batch:
        return self._scored(self.inner.batch(step))

    def example_batch(self, step: int) -> data.Batch:
        return self._scored(self.inner.example_batch(step))

    def eval_batches(self, split: str) -> Iterator[data.Batch]:
        return (self._scored(b) for b in self.inner.eval_batches(split))

    def state(self) -> dict[str, Any] | None:
        return self.inner.state()

    def restore(self, state: dict[str, Any] | None) -> None:
        self.inner.restore(state)


class RegressionTask:
    """A score per example (per segment slot for packed rows): squared error, MAE, Pearson correlation."""

    name = "regression"
    target_keys: tuple[str, ...] = ("labels", "scores")
    count_name = "examples"
    pad_values: Mapping[str, int] = {"labels": -1, "scores": 0, "segment_ids": -1}
    higher_is_better: Mapping[str, bool] = {"loss": False, "mae": False, "correlation": True}
    main_metric = "correlation"
    renamed_metrics: Mapping[str, str] = {}
    predicts_labels = False

    @classmethod
    def from_config(cls, config: Config) -> RegressionTask:
        return cls()

    def build_model(self, config: EncoderConfig) -> nn.Module:
        # One output, the score, whatever model.num_classes says (resolve sets it to 1 for the run's config).
        return Classifier(config.model_copy(update={"num_classes": 1}))

    def target_shapes(self, rows: int, length: int, segments: int | None) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (rows,) if segments is None else (rows, segments)
        return {"labels": jax.ShapeDtypeStruct(shape, jnp.int32), "scores": jax.ShapeDtypeStruct(shape, jnp.float32)}

    def check_batch(self, batch: Batch) -> None:
        packed = "segment_ids" in batch
        per_example = 2 if packed else 1
        chex.assert_rank([batch["tokens"], batch["labels"], batch["scores"]], [2, per_example, per_example])
        chex.assert_type([batch["tokens"], batch["labels"], batch["scores"]], [jnp.int32, jnp.int32, jnp.float32])
        chex.assert_equal_shape([batch["labels"], batch["scores"]])

    def apply(self, apply_fn: Any, params: Any, batch: Batch, *, train: bool, rng: jax.Array | None) -> jax.Array:
        """Predicted scores [N] ([N*S] for packed rows)."""
        rngs = {"dropout": rng} if rng is not None else None
        if "segment_ids" not in batch:
            out = apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], train=train, rngs=rngs)
        else:
            out = apply_fn({"params": params}, batch["tokens"], batch["valid_tokens"], train=train, rngs=rngs,
                           segment_ids=batch["segment_ids"], num_segments=batch["labels"].shape[1])
        return out.reshape(-1)

    def sums(self, outputs: jax.Array, batch: Batch) -> Sums:
        real = batch["labels"].reshape(-1) >= 0
        p = jnp.where(real, outputs.reshape(-1).astype(jnp.float32), 0.0)
        y = jnp.where(real, batch["scores"].reshape(-1), 0.0)
        return {"loss_sum": jnp.sum((p - y) ** 2), "abs_sum": jnp.sum(jnp.abs(p - y)), "count": jnp.sum(real),
                "p_sum": jnp.sum(p), "y_sum": jnp.sum(y), "pp_sum": jnp.sum(p * p), "yy_sum": jnp.sum(y * y),
                "py_sum": jnp.sum(p * y)}

    def metrics(self, sums: Sums) -> dict[str, Any]:
        n = sums["count"]
        safe = n + (n == 0)
        cov = sums["py_sum"] / safe - sums["p_sum"] * sums["y_sum"] / safe**2
        var_p = sums["pp_sum"] / safe - (sums["p_sum"] / safe) ** 2
        var_y = sums["yy_sum"] / safe - (sums["y_sum"] / safe) ** 2
        denominator = (var_p * var_y) ** 0.5
        return {"loss": sums["loss_sum"] / safe, "mae": sums["abs_sum"] / safe,
                "correlation": cov / (denominator + (denominator == 0))}

    def loss(self, outputs: jax.Array, batch: Batch) -> jax.Array:
        sums = self.sums(outputs, batch)
        return sums["loss_sum"] / jnp.maximum(sums["count"], 1)

    def exported(self, config: EncoderConfig, params: Any) -> Exported:
        raise ConfigError("a task=regression run has no export yet (it writes classifiers and encoders): use "
                          "TrainedRun (train/inference.py) for its scores")

    def predict(self, outputs: jax.Array) -> dict[str, jax.Array]:
        return {"scores": outputs}  # [N]

    # --- the data ---

    def check_config(self, config: Config) -> None:
        if config.data.source not in (*VADER_FILES, "synthetic"):
            kind = "unlabelled text" if config.data.source in STREAMED_SOURCES else "a labelled file without scores"
            raise ConfigError(f"task=regression reads scored examples, and data.source={config.data.source} is {kind}: "
                              f"set data.source to synthetic or one of {', '.join(VADER_FILES)}")

    def load_data(self, config: Config, *, tokenizer_dir: Path | None, tokenizer: Tokenizer | None = None
                  ) -> ScoredData:
        cfg = config.data
        if cfg.source == "synthetic":
            texts = synthetic_examples(cfg.synthetic_task, cfg.synthetic_size, cfg.synthetic_vocab, cfg.synthetic_len,
                                       cfg.split_seed).texts
            scores = synthetic_scores(texts, cfg.synthetic_vocab)
        else:
            cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None
            texts, scores = vader_ratings(vader_file(cfg.source, cache))
        examples = Examples(texts, np.arange(len(texts), dtype=np.int32), [])
        have_own = tokenizer_dir is not None and tokenizer_dir.is_dir()
        dataset = data.load_dataset(cfg, tokenizer_dir=tokenizer_dir if have_own else None,
                                    tokenizer=tokenizer if not have_own else None, examples=examples)
        return ScoredData(dataset, scores)

    def resolve(self, config: Config, scored: TaskData) -> Config:
        return resolve_labelled(config, scored, num_classes=1)

    def resolve_shapes(self, config: Config, vocab_size: int, labels: list[str]) -> Config:
        return resolve_labelled(config, _StandIn(vocab_size, labels), num_classes=1)

    def make_batches(self, scored: TaskData, config: Config, share: tuple[int, int] = (0, 1),
                     *, training: bool = True) -> BatchSource:
        assert isinstance(scored, ScoredData)
        return ScoredBatches(InMemoryBatches(scored.dataset, config, share), scored.scores)

    def run_record(self, scored: TaskData, batches: BatchSource) -> dict[str, Any]:
        """What the MSE must beat: predicting the training scores' mean for every validation example."""
        assert isinstance(scored, ScoredData)
        train = scored.scores[scored.dataset.train.labels]
        val = scored.scores[scored.dataset.validation.labels]
        return {"mean_baseline_mse": float(np.mean((val - train.mean()) ** 2))}


TASK = RegressionTask  # what train/tasks/__init__.py registers
