"""Use a trained run from Python: load its workdir, predict texts, evaluate a split.

    from train.inference import TrainedRun
    run = TrainedRun.load("runs/tiny")            # best checkpoint if kept, else the latest
    run.predict(["a gripping film"])              # [Prediction(label='positive', probability=0.91, ...)]
    run.evaluate("test")                          # {'loss': ..., 'accuracy': ..., 'examples': ...}
    run.task.main_metric                          # 'accuracy': the metric the task ranks by

Everything comes from the workdir: the resolved config (`config.yaml`), the tokenizer (`tokenizer/`) and a
checkpoint (`checkpoints/<step>`). Inference runs on one device. Errors are one-line
`CheckpointError`/`DataError`s, as on the command line (`python -m train evaluate|predict`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.checkpoints.restore import RestoredRun, restore_run
from train.checkpoints.store import TOKENIZER_DIR, inference_state
from train.config import Config
from train.data import labelled as data
from train.data.tokenizer import Tokenizer
from train.devices.runners import make_runner
from train.errors import DataError
from train.evaluation import evaluate
from train.tasks import Task, TaskData, task_for


@dataclass(frozen=True)
class Prediction:
    """The most probable label of one text, its probability, and every class's probability."""

    label: str
    probability: float
    probabilities: dict[str, float]
    truncated: bool = False  # the text had more than data.max_len tokens; only the first max_len were read
    error: str | None = None  # why there is no prediction (an empty or blank text); label "" and probability 0


class TrainedRun:
    """A run's model, parameters and tokenizer, restored for inference (build with `TrainedRun.load`)."""

    def __init__(self, workdir: Path, config: Config, params: Any, tokenizer: Tokenizer, label_names: list[str],
                 step: int | None, task: Task | None = None, notes: list[str] | None = None):
        self.workdir, self.config, self.params = workdir, config, params
        self.tokenizer, self.label_names, self.step = tokenizer, label_names, step
        self.task = task if task is not None else task_for(config)
        self.notes = list(notes or [])  # one line per thing the user should know (a damaged checkpoint)
        self.model = self.task.build_model(config.model)
        self._dataset: TaskData | None = None

    @classmethod
    def load(cls, workdir: str | Path, step: int | None = None, task: Task | None = None,
             overrides: list[str] | None = None) -> TrainedRun:
        """Restore checkpoint `step` of the run in `workdir` (default: the best when the run kept the
        best ones, else the latest; a damaged one is skipped, see train.checkpoints.restore)."""
        return cls.from_restored(restore_run(workdir, step, overrides=overrides), task)

    @classmethod
    def from_restored(cls, run: RestoredRun, task: Task | None = None) -> TrainedRun:
        """The run the task its config names (or `task`) makes of a restored checkpoint."""
        return cls(run.workdir, run.config, run.params, run.tokenizer, run.label_names, run.step, task, run.notes)

    @functools.cached_property
    def _outputs(self) -> Any:
        task, apply_fn = self.task, self.model.apply
        return jax.jit(lambda params, batch: task.predict(task.apply(apply_fn, params, batch, train=False, rng=None)))

    def predict(self, texts: list[str], strict: bool = True) -> list[Prediction]:
        """One prediction per text (each truncated to data.max_len tokens: `truncated` says so). An empty
        text (no tokens, or only whitespace, which some tokenizers give tokens for) is a DataError when
        `strict`, else a Prediction with `error` set (the others still run)."""
        if not self.task.predicts_labels:
            raise DataError(f"the run in {self.workdir} is a task={self.task.name} run, which predicts no class "
                            "labels: evaluate reports its metrics; to predict labels, fine-tune a classification run "
                            "from it (model.init_from)")
        texts, max_len = list(texts), self.config.data.max_len
        lengths = [len(self.tokenizer.encode(t)) for t in texts]
        good = [i for i, n in enumerate(lengths) if n > 0 and texts[i].strip()]
        if strict or not texts:
            data.encode_texts(self.tokenizer, texts, max_len, self.config.data.buckets)  # raises the DataError
        out = [Prediction("", 0.0, {}, error="empty text") for _ in texts]
        if not good:
            return out
        batch = data.encode_texts(self.tokenizer, [texts[i] for i in good], max_len, self.config.data.buckets)
        probs = np.asarray(self._outputs(self.params, batch)["probabilities"])  # [N, C]
        for i, p in zip(good, probs, strict=True):
            k = int(np.argmax(p))
            out[i] = Prediction(self.label_names[k], float(p[k]),
                                {name: float(q) for name, q in zip(self.label_names, p, strict=True)},
                                truncated=lengths[i] > max_len)
        return out

    @property
    def dataset(self) -> TaskData:
        """The run's data, as the task loads it for training (loaded on first use)."""
        if self._dataset is None:
            self._dataset = self.task.load_data(self.config, tokenizer_dir=self.workdir / TOKENIZER_DIR)
        return self._dataset

    def evaluate(self, split: str = "test") -> dict[str, float]:
        """The task's metrics (e.g. loss and accuracy) and its count (e.g. examples) over `split` ("train",
        "validation" or "test"; a streamed corpus has "validation" and "test")."""
        if split not in ("train", "validation", "test"):
            raise ValueError(f"unknown split {split!r}: use train, validation or test")
        config = self.config.model_copy(
            update={"parallel": self.config.parallel.model_copy(update={"strategy": "single"})})
        state = inference_state(self.model, self.params)
        runner = make_runner(config, state, task=self.task)
        batches = self.task.make_batches(self.dataset, config, training=False)
        return evaluate(self.task, runner, state, batches, split, config.train.sync_every)
