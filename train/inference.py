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
import orbax.checkpoint as ocp

from train.checkpoints.repair import committed_steps, describe_damage, quiet_stderr, restore_newest_good
from train.checkpoints.store import (
    CHECKPOINT_DIR,
    TOKENIZER_DIR,
    CheckpointError,
    _reader,
    best_or_latest,
    check_compatible,
    inference_state,
    read_run_config,
)
from train.config import Config, apply_overrides, config_from_dict
from train.data import labelled as data
from train.data.batches import InMemoryBatches
from train.data.tokenizer import Tokenizer
from train.devices.runners import make_runner
from train.loop.state import init_params
from train.loop.trainer import evaluate
from train.tasks import CLASSIFICATION, Task, task_for


@dataclass(frozen=True)
class Prediction:
    """The most probable label of one text, its probability, and every class's probability."""

    label: str
    probability: float
    probabilities: dict[str, float]
    truncated: bool = False  # the text had more than data.max_len tokens; only the first max_len were read
    error: str | None = None  # why there is no prediction (e.g. an empty text); label "" and probability 0


def restore_for_inference(workdir: Path, step: int | None = None, overrides: list[str] | None = None
                          ) -> tuple[Config, Any, list[str], int, list[str]]:
    """(config, params, label names, step, notes) of a run's checkpoint, read-only (no lock, nothing moved),
    so it works while the run trains.

    `step` None: the best checkpoint when kept, else the latest; if that one is damaged, the newest that
    restores, with a note naming the damage. A missing `step` lists the steps that exist; a damaged one
    names the newest that restores. `overrides` (key=value) change the saved config, e.g. a moved
    data.path. Errors are one-line CheckpointErrors.
    """
    if not workdir.is_dir():
        raise CheckpointError(f"workdir {workdir} does not exist: pass the --workdir of a trained run")
    config = read_run_config(workdir)
    if overrides:
        config = config_from_dict(apply_overrides(config.model_dump(mode="json"), list(overrides)))
    directory = (workdir / CHECKPOINT_DIR).absolute()
    steps = committed_steps(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint in {workdir}: train first with python -m train "
                              f"--config CONFIG --workdir {workdir}")
    if step is not None and step not in steps:
        raise CheckpointError(f"no checkpoint {step} in {workdir}: it has checkpoints "
                              f"{', '.join(map(str, steps))}; pass one of them to --step")
    model = task_for(config).build_model(config.model)  # the run's own model (MaskedLM for task=mlm)
    shapes = jax.eval_shape(lambda: init_params(model, 0, config.data.buckets[-1]))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    with _reader(directory, config.checkpoint) as manager:
        chosen = step if step is not None else best_or_latest(manager, config.checkpoint)

        def restore(s: int) -> Any:
            check_compatible(workdir, s, shapes)
            return manager.restore(s, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))

        with quiet_stderr():
            try:
                restored = restore(chosen)
                return config, restored["params"], list(restored["meta"]["label_names"]), chosen, []
            except Exception as err:
                reason = describe_damage(err, directory / str(chosen))
                if reason is None:
                    raise
        others = [s for s in steps if s != chosen]
        found = restore_newest_good(directory, restore, steps=others, primary=False, together=False) if others else None
        if found is None or found.step is None:
            raise CheckpointError(f"checkpoint {chosen} in {workdir} is damaged ({reason}) and no other "
                                  "checkpoint restores: train again in a new --workdir")
        if step is not None:
            raise CheckpointError(f"checkpoint {chosen} in {workdir} is damaged ({reason}): pass --step "
                                  f"{found.step}, the newest that restores")
        note = (f"checkpoint {chosen} is damaged ({reason}); using checkpoint {found.step} (the next training "
                "run on this workdir moves the damaged one aside)")
        return config, found.value["params"], list(found.value["meta"]["label_names"]), found.step, [note]


class TrainedRun:
    """A run's model, parameters and tokenizer, restored for inference (build with `TrainedRun.load`)."""

    def __init__(self, workdir: Path, config: Config, params: Any, tokenizer: Tokenizer, label_names: list[str],
                 step: int | None, task: Task = CLASSIFICATION, notes: list[str] | None = None):
        self.workdir, self.config, self.params = workdir, config, params
        self.tokenizer, self.label_names, self.step, self.task = tokenizer, label_names, step, task
        self.notes = list(notes or [])  # one line per thing the user should know (a damaged checkpoint)
        self.model = task.build_model(config.model)
        self._dataset: data.Dataset | None = None

    @classmethod
    def load(cls, workdir: str | Path, step: int | None = None, task: Task = CLASSIFICATION,
             overrides: list[str] | None = None) -> TrainedRun:
        """Restore checkpoint `step` of the run in `workdir` (default: the best when the run kept the
        best ones, else the latest; a damaged one is skipped, see `restore_for_inference`)."""
        workdir = Path(workdir)
        config, params, label_names, used, notes = restore_for_inference(workdir, step, overrides)
        tokenizer = data.load_tokenizer(workdir / TOKENIZER_DIR)
        task = task_for(config) if task is CLASSIFICATION else task  # a pretraining run (task=mlm) too
        return cls(workdir, config, params, tokenizer, label_names, used, task, notes)

    @functools.cached_property
    def _outputs(self) -> Any:
        task, apply_fn = self.task, self.model.apply
        return jax.jit(lambda params, batch: task.predict(task.apply(apply_fn, params, batch, train=False, rng=None)))

    def predict(self, texts: list[str], strict: bool = True) -> list[Prediction]:
        """One prediction per text (each truncated to data.max_len tokens: `truncated` says so). An empty
        text is a DataError when `strict`, else a Prediction with `error` set (the others still run)."""
        if self.config.task != "classification":
            raise data.DataError(f"the run in {self.workdir} is a {self.config.task} pretraining run with no classes: "
                                 "fine-tune it (model.init_from) and predict with that run")
        texts, max_len = list(texts), self.config.data.max_len
        lengths = [len(self.tokenizer.encode(t)) for t in texts]
        good = [i for i, n in enumerate(lengths) if n > 0]
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
            from train.data.batches import StreamBatches
            from train.data.pretrain import load_corpus

            corpus = load_corpus(config, tokenizer_dir=self.workdir / TOKENIZER_DIR)
            stream = StreamBatches(corpus, config.model_copy(
                update={"data": config.data.model_copy(update={"prefetch": "none"})}))
            return evaluate(self.task, runner, state, stream, split, config.train.sync_every)
        batches = InMemoryBatches(self.dataset, config)
        return evaluate(self.task, runner, state, batches, split, config.train.sync_every)
