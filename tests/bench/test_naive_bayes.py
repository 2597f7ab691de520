"""bench/naive_bayes.py: the bag-of-words baseline runs on the model's split and reports real accuracy."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from bench.naive_bayes import main, naive_bayes_accuracy
from train.config import DataConfig
from train.data.labelled import load_dataset


def test_words_that_decide_the_label_give_perfect_accuracy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    filler = ["the", "a", "film", "plot", "actor", "scene", "and", "was"]
    rows = []
    for i in range(300):  # two positive rows to each negative one, so the majority class is 'pos'
        cue = ["great", "superb"] if i % 3 else ["awful", "dull"]
        words = [*rng.choice(filler, 6), rng.choice(cue)]
        rows.append(f"{' '.join(rng.permutation(words))},{'pos' if i % 3 else 'neg'}")
    path = tmp_path / "cues.csv"
    path.write_text("text,label\n" + "\n".join(rows) + "\n")
    ds = load_dataset(DataConfig(source="file", path=str(path)))
    acc = naive_bayes_accuracy(ds)
    assert acc["test_accuracy"] == 1.0 and acc["validation_accuracy"] == 1.0
    pos = ds.label_names.index("pos")
    assert np.mean(ds.train.labels == pos) > 0.6
    assert acc["test_majority"] == pytest.approx(np.mean(ds.test.labels == pos))  # the rate of 'pos' in test


def test_cli_on_the_synthetic_task_stays_near_chance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--source", "synthetic"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"test accuracy (\d\.\d+)", out)
    assert found and "on synthetic: train 4800, validation 600, test 600" in out
    assert abs(float(found.group(1)) - 0.5) < 0.07  # token counts carry no label signal


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--source", "file", f"data.path={tmp_path / 'absent.csv'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "absent.csv not found" in err
    assert main(["data.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.slow
def test_rotten_tomatoes_baseline_is_in_the_published_range(tmp_path: Path) -> None:
    ds = load_dataset(DataConfig(source="rotten_tomatoes", cache_dir=str(tmp_path)))
    acc = naive_bayes_accuracy(ds)
    assert 0.75 < acc["test_accuracy"] < 0.84, acc  # bag-of-words NB on this data: ~0.78-0.80
