"""task=regression (train/tasks/regression.py): a score per example. Its sums and metrics against numpy on
hand-made outputs, its batches against its data, and (slow) a training run through the command line that
must beat predicting the mean score."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from train.config import ConfigError
from train.tasks import registry, task_for
from train.tasks.regression import RegressionTask, ScoredData, synthetic_scores, vader_ratings

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/tiny.yaml")
TASK = RegressionTask()


def numpy_metrics(p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    return {"loss": float(np.mean((p - y) ** 2)), "mae": float(np.mean(np.abs(p - y))),
            "correlation": float(np.corrcoef(p, y)[0, 1])}


def test_metrics_are_mse_mae_and_pearson_over_real_examples_only():
    rng = np.random.default_rng(0)
    p, y = rng.normal(size=12).astype(np.float32), rng.normal(size=12).astype(np.float32)
    labels = np.arange(12, dtype=np.int32)
    labels[[3, 7]] = -1  # padding examples: count nowhere, whatever their outputs and scores
    real = labels >= 0
    sums = TASK.sums(jnp.asarray(p[:, None]), {"labels": jnp.asarray(labels), "scores": jnp.asarray(y)})
    assert int(sums["count"]) == 10
    got = {k: float(v) for k, v in TASK.metrics({k: float(v) for k, v in sums.items()}).items()}
    want = numpy_metrics(p[real], y[real])
    assert got == pytest.approx(want, rel=1e-4)
    assert float(TASK.loss(jnp.asarray(p[:, None]), {"labels": labels, "scores": y})) == pytest.approx(want["loss"])


def test_sums_of_two_halves_give_the_metrics_of_the_whole():
    rng = np.random.default_rng(1)
    p = rng.normal(size=10).astype(np.float32)
    y = rng.normal(size=10).astype(np.float32) + 0.5 * p
    halves = [TASK.sums(jnp.asarray(p[s, None]), {"labels": jnp.arange(5, dtype=jnp.int32), "scores": y[s]})
              for s in (slice(0, 5), slice(5, 10))]
    total = {k: float(halves[0][k]) + float(halves[1][k]) for k in halves[0]}
    assert TASK.metrics(total) == pytest.approx(numpy_metrics(p, y), rel=1e-4)


def test_a_constant_prediction_has_correlation_zero_not_nan():
    sums = TASK.sums(jnp.zeros((4, 1)), {"labels": jnp.arange(4, dtype=jnp.int32), "scores": jnp.arange(4.0)})
    assert float(TASK.metrics(sums)["correlation"]) == 0.0


def test_the_registry_finds_the_task_and_it_declares_its_metrics(tiny):
    assert registry()["regression"] is RegressionTask
    task = task_for(tiny("task=regression", "checkpoint.best_metric=val_mae"))
    assert task.main_metric == "correlation" and dict(task.higher_is_better) == {
        "loss": False, "mae": False, "correlation": True}
    with pytest.raises(ConfigError, match=r"not a metric of task=regression: set it to one of val_loss, val_mae, "
                                          r"val_correlation$"):
        task_for(tiny("task=regression", "checkpoint.best_metric=val_accuracy"))
    with pytest.raises(ConfigError, match=r"task=regression reads scored examples, and data.source=file"):
        task_for(tiny("task=regression", "data.source=file", "data.path=x.csv"))


def test_batches_carry_each_example_score_and_zero_on_padding(tiny):
    config = tiny("task=regression", "data.synthetic_task=majority", "train.batch_size=32")
    data = TASK.load_data(config, tokenizer_dir=None)
    assert isinstance(data, ScoredData) and data.label_names == []
    texts = data.dataset.train.texts
    np.testing.assert_array_equal(data.scores[data.dataset.train.labels], synthetic_scores(texts, 16))
    config = TASK.resolve(config, data)
    assert config.model.num_classes == 1
    batches = TASK.make_batches(data, config)
    batch = batches.batch(3)
    np.testing.assert_array_equal(batch["scores"], data.scores[batch["labels"]])
    last = list(batches.eval_batches("validation"))[-1]
    padding = last["labels"] < 0
    assert padding.any() and (last["scores"][padding] == 0).all()
    TASK.check_batch(batch)


def test_vader_ratings_keep_every_sentence_with_its_mean_rating(tmp_path):
    path = tmp_path / "ground_truth.txt"
    path.write_bytes(b"1\t2.5\tgreat fun\r\n2\t0.0\tit is a film\r\n3\t-1.75\tdull\r\n")
    texts, ratings = vader_ratings(path)
    assert texts == ["great fun", "it is a film", "dull"]
    np.testing.assert_array_equal(ratings, np.asarray([2.5, 0.0, -1.75], np.float32))


@pytest.mark.slow
def test_regression_trains_through_the_command_line_and_beats_the_mean(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    work = tmp_path / "w"
    done = subprocess.run([sys.executable, "-m", "train", "--config", TINY, "--workdir", str(work), "task=regression",
                           "data.synthetic_task=majority", "train.steps=40", "train.eval_every=20",
                           "checkpoint.every=20", "train.progress=false"],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "best validation correlation" in done.stdout
    summary = json.loads((work / "summary.json").read_text())
    baseline = json.loads((work / "run.json").read_text())["mean_baseline_mse"]
    assert summary["best_metric"] == "val_correlation"
    assert summary["test_loss"] < 0.5 * baseline and summary["test_correlation"] > 0.8, (summary, baseline)
    evaluated = subprocess.run([sys.executable, "-m", "train", "evaluate", "--workdir", str(work), "--split", "test"],
                               env=env, capture_output=True, text=True, cwd=ROOT)
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith(f"test: correlation {summary['test_correlation']:.4f} loss "
                                       f"{summary['test_loss']:.4f} mae {summary['test_mae']:.4f} (100 examples")
    refused = subprocess.run([sys.executable, "-m", "train", "predict", "--workdir", str(work), "1 2 3"],
                             env=env, capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "task=regression run, which predicts no class labels" in refused.stderr


@pytest.mark.slow
def test_diagnose_runs_the_checks_on_the_regression_model_with_its_loss(tmp_path, capsys):
    from train import diagnose

    argv = ["--config", TINY, "task=regression", "data.synthetic_task=majority", "--batch-size", "4"]
    assert diagnose.main([*argv, "--out", str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out.startswith("diagnose: all ")
    assert diagnose.main([*argv, "--random", "--out", str(tmp_path / "r")]) == 2
    assert "drop --random" in capsys.readouterr().err and not (tmp_path / "r").exists()
