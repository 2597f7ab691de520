"""The rough edges a new user meets: misspellings, the program's name, a closed pipe, predict's inputs and
outputs, a moved data file, a resumed run with changed settings, the first log row after a resume."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys

import pytest
import yaml

from tests.conftest import signal_at
from train import run
from train.__main__ import main, program
from train.workdir.metrics_log import read_jsonl

TINY = "configs/tiny.yaml"


def test_a_misspelt_command_or_key_gets_a_suggestion(capsys):
    assert main(["evalute", "--workdir", "w"]) == 2
    assert capsys.readouterr().err == "python -m train: unknown command 'evalute' (did you mean 'evaluate'?)\n"
    assert main(["--config", TINY, "--workdir", "w", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'optim.lrr'" in err and "(did you mean 'optim.lr'?)" in err


def test_a_config_directory_is_named_as_one_with_a_file_to_pass(tmp_path, capsys):
    assert main(["--config", "configs", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    yamls = sorted(p.name for p in (tmp_path.cwd() / "configs").glob("*.yaml"))
    assert err == (f"error: --config configs is a directory: pass one YAML file in it, e.g. --config "
                   f"configs/{yamls[0]} ({len(yamls)} there)\n")
    (tmp_path / "empty").mkdir()
    assert main(["--config", str(tmp_path / "empty"), "--workdir", str(tmp_path / "w")]) == 2
    assert "is a directory with no YAML file in it" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no workdir made


def test_usage_names_the_program_as_invoked(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/jaxblock", "--help"])
    assert program() == "jaxblock"
    monkeypatch.setattr(sys, "argv", ["/x/train/__main__.py"])
    assert program() == "python -m train"


def test_schema_into_a_closed_pipe_is_quiet(monkeypatch, capfd):
    read, write = os.pipe()
    os.close(read)  # the reader (`head`) is gone
    out = io.TextIOWrapper(os.fdopen(write, "wb", buffering=0), write_through=True)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["schema"]) == 0
    monkeypatch.undo()
    assert "Traceback" not in capfd.readouterr().err


def test_predict_reads_stdin_reports_empty_and_truncated_texts_and_writes_json(reference_run, monkeypatch, capsys):
    workdir = str(reference_run[0])
    long_text = " ".join(["3"] * 40)  # 40 ids, past data.max_len=16
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"1 2 3\n\n{long_text}\n"))
    assert main(["predict", "--workdir", workdir, "--json", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == ["1 2 3", "", long_text]
    assert rows[1]["error"] == "empty text" and rows[0]["error"] is None and rows[2]["error"] is None
    assert [r["truncated"] for r in (rows[0], rows[2])] == [False, True]
    assert abs(sum(rows[0]["probabilities"].values()) - 1) < 1e-5

    assert main(["predict", "--workdir", workdir]) == 2
    assert "no text to classify" in capsys.readouterr().err


@pytest.mark.slow
def test_relative_data_path_is_saved_absolute_and_evaluate_takes_overrides(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy("configs/own_file.csv", data / "mine.csv")
    config = os.path.abspath("configs/own_file.yaml")
    monkeypatch.chdir(data)
    argv = ["--config", config, "--workdir", str(tmp_path / "run"), "data.path=mine.csv", "train.steps=4",
            "checkpoint.every=4", "train.eval_every=4", "train.progress=false", "parallel.strategy=single"]
    assert main(argv) == 0
    saved = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert saved["data"]["path"] == str(data / "mine.csv")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["evaluate", "--workdir", "run", "--split", "test"]) == 0
    assert capsys.readouterr().out.startswith("test: accuracy")
    (data / "mine.csv").rename(tmp_path / "moved.csv")
    assert main(["evaluate", "--workdir", "run", "--split", "test"]) == 2
    capsys.readouterr()
    assert main(["evaluate", "--workdir", "run", "--split", "test", f"data.path={tmp_path / 'moved.csv'}"]) == 0


@pytest.mark.slow
def test_resuming_with_a_changed_setting_says_so_and_keeps_every_config(reference_run, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    assert main(["--workdir", str(workdir), "train.steps=12", "optim.lr=0.001", "train.progress=false"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [x for x in err if "settings changed" in x] == [
        "settings changed since the last session: optim.lr: 0.003 -> 0.001; train.steps: 10 -> 12 "
        "(earlier configs kept in config.history/)"]
    assert any(x.endswith("resuming from step 10") for x in err), err
    history = sorted(p.name for p in (workdir / "config.history").iterdir())
    assert history == ["from-step-0.yaml", "from-step-10.yaml"]
    assert yaml.safe_load((workdir / "config.history/from-step-0.yaml").read_text())["optim"]["lr"] == 0.003
    sessions = json.loads((workdir / "run.json").read_text())["sessions"]
    assert [s["config"] for s in sessions] == ["config.history/from-step-0.yaml", "config.history/from-step-10.yaml"]


@pytest.mark.slow
def test_the_first_log_row_after_a_resume_equals_the_uninterrupted_run(tiny, tmp_path):
    # Rows every 4 steps, checkpoints every 5: the stop after step 6 falls inside the row window 5..8, so
    # the resumed run's first row (step 8) averages steps of both sessions.
    cfg = tiny("train.log_every=4", "checkpoint.every=5")
    assert (cfg.train.log_every, cfg.checkpoint.every) == (4, 5)  # the test's overrides beat the standard ones
    run.train(cfg, tmp_path / "whole")
    stopped = run.train(cfg, tmp_path / "cut", batches=signal_at(5))
    assert stopped["preempted"] and stopped["step"] == 6
    run.train(cfg, tmp_path / "cut")

    def rows(path):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_jsonl(path / "metrics.jsonl")
                if r["split"] == "train"]

    assert [r["step"] for r in rows(tmp_path / "cut")] == [4, 8, 10]
    assert rows(tmp_path / "cut") == rows(tmp_path / "whole")
