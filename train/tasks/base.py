"""What a task is: the objective-specific part of training, evaluation and inference, behind one interface.

A task owns the batch keys beyond the inputs, the model (encoder plus its head), the forward pass on a
batch, the loss and the metrics it declares (which is its main one and whether higher is better), the
data it reads and how its batches are made. The step (train/loop/step.py), the loop
(train/loop/trainer.py), the run (train/run.py), evaluation (train/evaluation.py) and the inference API
(train/inference.py) call only these methods, so a new objective is one more module in train/tasks/.

Every batch carries the inputs tokens int32[N, L] and valid_tokens bool[N, L] (True = a real token, real
tokens first); packed rows add segment_ids int32[N, L] (-1 on padding). A task adds its targets, e.g.
classification: labels int32[N] (int32[N, S] for packed rows, one per segment slot; < 0 = counts nowhere);
masked-language modelling: mlm_targets int32[N, L] and mlm_weights float32[N, L] (1 on chosen tokens).

Losses are returned as *sums* with a *count* (`loss_sum`, `count`, plus metric sums such as `correct`):
with data parallelism each device divides its own sum by the global count, so the gradient is that of
the whole batch whatever the split, and an evaluation adds sums over batches before dividing once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax

from jaxblock.config import EncoderConfig
from train.config import Config, ConfigError
from train.data.batches import BatchSource
from train.data.tokenizer import Tokenizer

Batch = Mapping[str, Any]
Sums = dict[str, Any]  # float or int arrays, reduced by summation (over devices, then over batches)


def ratio(total: Any, count: Any) -> Any:
    """total / max(count, 1) for a count >= 0, on Python numbers and traced arrays alike."""
    return total / (count + (count == 0))


class TaskData(Protocol):
    """What a task's `load_data` returns: the run's data, with what the run files and the log need."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def label_names(self) -> list[str]:
        """The classes a prediction chooses from; [] for a task without classes."""
        ...

    @property
    def truncated(self) -> dict[str, int]:
        """Examples cut to data.max_len, per split."""
        ...

    def summary(self) -> str:
        """One line for the run log: sizes, tokenizer, truncation."""
        ...


class Task(Protocol):
    """The objective-specific part of training, evaluation and inference."""

    name: str  # the `task:` config value that selects it
    target_keys: tuple[str, ...]  # batch keys beyond tokens/valid_tokens/segment_ids, e.g. ("labels",)
    count_name: str  # what `count` counts, e.g. "examples" or "tokens"
    pad_values: Mapping[str, int]  # fill of each batch key in rows added to split a batch over devices
    # The metrics `metrics` returns ("loss" first), and for each whether higher is better; `main_metric`
    # is the one progress lines, summaries and keep-best use unless checkpoint.best_metric names another.
    higher_is_better: Mapping[str, bool]
    main_metric: str
    renamed_metrics: Mapping[str, str]  # old name -> new name, for the message refusing an old run's setting
    predicts_labels: bool  # whether `predict` gives class probabilities (the `predict` command)

    # --- the model and the objective ---

    def build_model(self, config: EncoderConfig) -> nn.Module:
        """The encoder with this task's head, taking (tokens, valid_tokens, ...)."""
        ...

    def check_batch(self, batch: Batch) -> None:
        """Raise (chex) on missing keys, wrong ranks or dtypes; traced, costs nothing at run time."""
        ...

    def target_shapes(self, rows: int, length: int, segments: int | None) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape and dtype of each of `target_keys` in a batch of `rows` rows of `length` tokens (`segments`
        examples per row when packed, else None): what a step compiled ahead of time takes."""
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

    def exported(self, config: EncoderConfig, params: Any) -> Exported:
        """What `python -m train export` writes for a run of this task: its kind, the forward function on
        (params, tokens, valid_tokens), the parameters it takes, and how it pools (ConfigError when the task
        has no export)."""
        ...

    # --- the data ---

    def check_config(self, config: Config) -> None:
        """Raise ConfigError (one line) for settings this task cannot run with (e.g. its data source)."""
        ...

    def load_data(self, config: Config, *, tokenizer_dir: Path | None, tokenizer: Tokenizer | None = None
                  ) -> TaskData:
        """The run's data; a saved tokenizer in `tokenizer_dir` is reused, else `tokenizer` (a pretrained
        checkpoint's) when given, else one is built. Writes nothing; raises DataError (one line)."""
        ...

    def resolve(self, config: Config, data: TaskData) -> Config:
        """The config with what the data decides (vocabulary size, classes, row lengths)."""
        ...

    def resolve_shapes(self, config: Config, vocab_size: int, labels: list[str]) -> Config:
        """`resolve` without the data, for compiling ahead of time: the tokenizer's vocabulary size and the
        class names stand for what the data would say."""
        ...

    def make_batches(self, data: TaskData, config: Config, share: tuple[int, int] = (0, 1),
                     *, training: bool = True) -> BatchSource:
        """The batch source over `data` for this process's `share` (index, count); `training` False
        builds one for evaluation only (no prefetching workers)."""
        ...

    def run_record(self, data: TaskData, batches: BatchSource) -> dict[str, Any]:
        """Entries for run.json beyond the label names, e.g. a baseline the main metric must beat."""
        ...


class Exported(NamedTuple):
    """A task's inference as an export holds it (train/export.py)."""

    kind: str  # "classifier" (logits, probabilities, embeddings) or "encoder" (embeddings)
    forward: Any  # (params, tokens int32[b, l], valid_tokens bool[b, l]) -> {output name: array}
    params: Any  # the parameters forward takes
    pooling: str  # how the embeddings pool, in words


def metric_names(task: Task) -> tuple[str, ...]:
    """The task's metrics in display order: the main one first, then the loss, then the others."""
    rest = [m for m in task.higher_is_better if m != task.main_metric]
    return (task.main_metric, *rest)


def ranking(task: Task, config: Config) -> tuple[str, bool]:
    """(metric, higher is better) that ranks validations: checkpoint.best_metric (val_<metric>) when set,
    else the task's main metric; checkpoint.best_mode when set, else the metric's own direction."""
    ckpt = config.checkpoint
    name = ckpt.best_metric.removeprefix("val_") if ckpt.best_metric else task.main_metric
    higher = task.higher_is_better[name] if ckpt.best_mode is None else ckpt.best_mode == "max"
    return name, higher


def check_ranking(task: Task, config: Config) -> None:
    """checkpoint.best_metric must name one of the task's metrics (ConfigError, one line)."""
    best = config.checkpoint.best_metric
    if best is None:
        return
    known = [f"val_{m}" for m in task.higher_is_better]
    if best not in known:
        new = task.renamed_metrics.get(best.removeprefix("val_"))
        legacy = f" (runs saved before it was renamed call val_{new} {best})" if new else ""
        raise ConfigError(f"checkpoint.best_metric={best} is not a metric of task={task.name}{legacy}: set it to "
                          f"one of {', '.join(known)}")


def with_ranking(config: Config, task: Task) -> Config:
    """The config with checkpoint.best_metric and best_mode spelled out (saved so in the run's config.yaml)."""
    name, higher = ranking(task, config)
    ckpt = config.checkpoint.model_copy(update={"best_metric": f"val_{name}", "best_mode": "max" if higher else "min"})
    return config.model_copy(update={"checkpoint": ckpt})
