"""Use a trained run from Python: load its workdir, predict texts, evaluate a split.

    from train.inference import TrainedRun
    run = TrainedRun.load("runs/tiny")            # best checkpoint if kept, else the latest
    run.predict(["a gripping film"])              # [Prediction(label='positive', probability=0.91, ...)]
    run.evaluate("test")                          # {'loss': ..., 'accuracy': ..., 'examples': ...}

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

from train import data
from train.batches import InMemoryBatches
from train.checkpoint import TOKENIZER_DIR, inference_state, load_for_inference
from train.config import Config
from train.loop import evaluate
from train.parallel import make_runner
from train.tasks import CLASSIFICATION, Task, task_for
from train.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prediction:
    """The most probable label of one text, its probability, and every class's probability."""

    label: str
    probability: float
    probabilities: dict[str, float]


class TrainedRun:
    """A run's model, parameters and tokenizer, restored for inference (build with `TrainedRun.load`)."""

    def __init__(self, workdir: Path, config: Config, params: Any, tokenizer: Tokenizer, label_names: list[str],
                 step: int | None, task: Task = CLASSIFICATION):
        self.workdir, self.config, self.params = workdir, config, params
        self.tokenizer, self.label_names, self.step, self.task = tokenizer, label_names, step, task
        self.model = task.build_model(config.model)
        self._dataset: data.Dataset | None = None

    @classmethod
    def load(cls, workdir: str | Path, step: int | None = None, task: Task = CLASSIFICATION) -> TrainedRun:
        """Restore checkpoint `step` of the run in `workdir` (default: the best when the run kept the
        best ones, else the latest)."""
        workdir = Path(workdir)
        config, params, tokenizer, label_names = load_for_inference(workdir, step)
        task = task_for(config) if task is CLASSIFICATION else task  # a pretraining run (task=mlm) too
        return cls(workdir, config, params, tokenizer, label_names, step, task)

    @functools.cached_property
    def _outputs(self) -> Any:
        task, apply_fn = self.task, self.model.apply
        return jax.jit(lambda params, batch: task.predict(task.apply(apply_fn, params, batch, train=False, rng=None)))

    def predict(self, texts: list[str]) -> list[Prediction]:
        """One prediction per text (each truncated to data.max_len tokens). DataError on no or empty text."""
        if self.config.task != "classification":
            raise data.DataError(f"the run in {self.workdir} is a {self.config.task} pretraining run with no classes: "
                                 "fine-tune it (model.init_from) and predict with that run")
        batch = data.encode_texts(self.tokenizer, list(texts), self.config.data.max_len, self.config.data.buckets)
        probs = np.asarray(self._outputs(self.params, batch)["probabilities"])  # [N, C]
        out = []
        for p in probs:
            k = int(np.argmax(p))
            out.append(Prediction(self.label_names[k], float(p[k]),
                                  {name: float(q) for name, q in zip(self.label_names, p, strict=True)}))
        return out

    @property
    def dataset(self) -> data.Dataset:
        """The run's data, split and tokenized as in training (loaded on first use)."""
        if self._dataset is None:
            self._dataset = data.load_dataset(self.config.data, tokenizer_dir=self.workdir / TOKENIZER_DIR)
        return self._dataset

    def evaluate(self, split: str = "test") -> dict[str, float]:
        """Loss, accuracy and example count over `split` ("train", "validation" or "test")."""
        if split not in ("train", "validation", "test"):
            raise ValueError(f"unknown split {split!r}: use train, validation or test")
        config = self.config.model_copy(
            update={"parallel": self.config.parallel.model_copy(update={"strategy": "single"})})
        state = inference_state(self.model, self.params)
        runner = make_runner(config, state, task=self.task)
        if config.task == "mlm":  # masked loss/accuracy on the held-out text
            from train.batches import StreamBatches
            from train.pretrain_data import load_corpus

            corpus = load_corpus(config, tokenizer_dir=self.workdir / TOKENIZER_DIR)
            stream = StreamBatches(corpus, config.model_copy(
                update={"data": config.data.model_copy(update={"prefetch": "none"})}))
            return evaluate(self.task, runner, state, stream, split, config.train.sync_every)
        batches = InMemoryBatches(self.dataset, config)
        return evaluate(self.task, runner, state, batches, split, config.train.sync_every)
