"""train/inference.py: a trained run loaded from Python predicts and evaluates as the run itself did, and
loading it logs nothing."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from train.checkpoints.restore import restore_run
from train.checkpoints.store import CheckpointError
from train.data.labelled import DataError, encode_texts
from train.inference import TrainedRun
from train.tasks import CLASSIFICATION


@pytest.fixture(scope="module")
def trained(reference_run) -> TrainedRun:
    return TrainedRun.load(reference_run[0])


def test_loading_logs_no_warnings(reference_run, caplog):
    with caplog.at_level(logging.DEBUG, logger="absl"):
        TrainedRun.load(reference_run[0])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_evaluate_reproduces_the_runs_own_test_result(trained, reference_run):
    summary = reference_run[1]
    result = trained.evaluate("test")
    assert list(result) == ["loss", "accuracy", "examples"]
    assert result["accuracy"] == summary["test_accuracy"]
    assert result["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    assert result["examples"] == len(trained.dataset.test)


def test_predict_is_the_softmax_of_the_classifier(trained, reference_run):
    texts = ["3 5 7 3", "4 6 8", "1"]
    predictions = trained.predict(texts)
    restored = restore_run(reference_run[0])
    config, params, tokenizer, labels = restored.config, restored.params, restored.tokenizer, restored.label_names
    batch = encode_texts(tokenizer, texts, config.data.max_len, config.data.buckets)
    logits = CLASSIFICATION.build_model(config.model).apply({"params": params}, batch["tokens"], batch["valid_tokens"])
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))  # [N, C]
    for p, got in zip(probs, predictions, strict=True):
        assert got.label == labels[int(p.argmax())]
        assert got.probability == pytest.approx(float(p.max()), rel=1e-5)
        assert list(got.probabilities) == labels
        assert sum(got.probabilities.values()) == pytest.approx(1.0, rel=1e-6)


def test_bad_requests_are_one_line_errors(trained, tmp_path):
    with pytest.raises(DataError, match="text 2 is empty"):
        trained.predict(["3 4", ""])
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        trained.evaluate("dev")
    with pytest.raises(CheckpointError, match="does not exist"):
        TrainedRun.load(tmp_path / "missing")


class _WhitespaceGivesTokens:
    """The run's id tokenizer, except that a text of spaces gives tokens, as the byte and BPE tokenizers' do."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text) or [self.inner.offset + 1] * len(text)


def test_blank_text_is_refused_as_empty_text_is(trained):
    blank = ["   ", "\t\n", "\u3000"]
    run = TrainedRun(trained.workdir, trained.config, trained.params, _WhitespaceGivesTokens(trained.tokenizer),
                     trained.label_names, trained.step)
    assert all(len(run.tokenizer.encode(text)) > 0 for text in blank)
    predictions = run.predict(["3 4", *blank, ""], strict=False)
    assert predictions[0].error is None and predictions[0].label in trained.label_names
    assert [p.error for p in predictions[1:]] == ["empty text"] * 4
    assert all(p.label == "" and p.probabilities == {} for p in predictions[1:])
    with pytest.raises(DataError, match="text 2 is empty or only whitespace"):
        run.predict(["3 4", "   "])
