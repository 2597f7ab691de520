"""Runs saved before the model keys were grouped (jaxblock.config.RENAMED) still load, evaluate, resume and
seed a new run; a config file or override of that layout is refused in one line naming the new key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import STANDARD, TINY, tiny_config
from train import run
from train.__main__ import main
from train.checkpoints.store import CONFIG_FILE, read_run_config
from train.config import ConfigError, load_config

OLD = Path(__file__).with_name("old_layout_config.yaml")  # written by main 56fd89a for tiny.yaml + STANDARD


@pytest.fixture
def old_run(reference_run, tmp_path) -> Path:
    """The shared reference run with its config.yaml as the flat layout wrote it (the same run: the
    checkpoints do not depend on how the config names its keys)."""
    workdir = tmp_path / "old"
    shutil.copytree(reference_run[0], workdir)
    shutil.copyfile(OLD, workdir / CONFIG_FILE)
    return workdir


def test_the_fixture_is_the_flat_layout_of_the_reference_runs_config(reference_run):
    old = yaml.safe_load(OLD.read_text())
    assert {"pooling", "positions", "embed_dropout"} <= set(old["model"])  # the flat layout, as written
    assert {"attn_dropout", "attention", "rope"} <= set(old["model"]["block"])
    saved = yaml.safe_load((reference_run[0] / CONFIG_FILE).read_text())
    assert saved["model"]["block"]["attention"]["kernel"] == "auto"  # the grouped layout, as written now


def test_an_old_config_yaml_reads_as_the_same_config(old_run, reference_run):
    migrated = read_run_config(old_run)
    assert migrated == read_run_config(reference_run[0])
    assert migrated.model_dump(mode="json") == yaml.safe_load((reference_run[0] / CONFIG_FILE).read_text())


def test_an_old_run_evaluates_and_resumes_with_no_model_key_changed(old_run, reference_run, capsys):
    summary = reference_run[1]
    assert main(["evaluate", "--workdir", str(old_run)]) == 0
    test_line = capsys.readouterr().out.splitlines()[1]
    assert test_line.startswith(f"test: accuracy {summary['test_accuracy']:.4f} loss {summary['test_loss']:.4f}")
    assert main(["--workdir", str(old_run), "train.steps=11"]) == 0
    captured = capsys.readouterr()
    assert "resuming from step 10" in captured.err and "done: 11 steps (1 this session" in captured.out
    record = json.loads((old_run / "run.json").read_text())
    assert record["sessions"][-1]["changed"] == ["train.steps: 10 -> 11"]  # the old keys read as the new
    rewritten = yaml.safe_load((old_run / CONFIG_FILE).read_text())
    assert "pooler" in rewritten["model"] and "pooling" not in rewritten["model"]  # saved in the new layout


def test_an_old_run_seeds_a_new_one_as_init_from(old_run, tmp_path):
    plan = run.plan_run(tiny_config(f"model.init_from={old_run}"), tmp_path / "new")
    assert plan.config.model.model_dump(exclude={"init_from"}) == read_run_config(old_run).model.model_dump(
        exclude={"init_from"})
    assert plan.init is not None and plan.init.encoder is not None


@pytest.mark.parametrize(("override", "line"), [
    ("model.block.attn_dropout=0.1", "unknown key 'model.block.attn_dropout': it is now model.block.attention.dropout"),
    ("model.block.attention=xla", "unknown key 'model.block.attention': it is now model.block.attention.kernel"),
    ("model.pooler=dense", "unknown key 'model.pooler': it is now model.pooler.dense=true"),
    ("model.positions=rope",
     "unknown key 'model.positions': it is now model.embedding.positions=none and model.block.attention.rope=true"),
    ("model.layer_windows=[1,null]", "unknown key 'model.layer_windows': it is now model.layers.window"),
])
def test_an_old_override_is_refused_with_its_new_key(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [*STANDARD, override])
    assert str(err.value) == f"config: {line}"


def test_an_old_config_file_is_refused_before_its_overrides(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  pooler: dense\n  block:\n    attn_dropout: 0.1\n")
    with pytest.raises(ConfigError) as err:  # the override writes below `pooler`, a string in this file
        load_config(path, ["model.pooler.bias=false"])
    assert str(err.value) == (f"config file {path}: unknown key 'model.pooler': it is now model.pooler.dense=true: "
                              "rename it in the file")


def test_the_cli_exits_2_on_an_old_key(tmp_path, capsys):
    assert main(["--config", str(TINY), "--workdir", str(tmp_path / "w"), "model.embed_dropout=0.1"]) == 2
    assert "it is now model.embedding.dropout" in capsys.readouterr().err
