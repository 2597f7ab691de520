"""`python -m train verify`: every checkpoint of a workdir read back, damage named per step, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.faults.stress import DAMAGE_KINDS, damage
from train.__main__ import main


def snapshot(workdir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and directory of the workdir with its mode and content: what 'nothing written' compares."""
    return {str(p.relative_to(workdir)): (p.stat().st_mode, p.read_bytes() if p.is_file() else b"")
            for p in sorted(workdir.rglob("*"))}


@pytest.fixture
def copy(reference_run, tmp_path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    return workdir


def test_a_good_workdir_reports_every_step_and_exits_0(copy, capsys):
    before = snapshot(copy)
    assert main(["verify", "--workdir", str(copy)]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith("checkpoint 5: ok (params ") and lines[1].startswith("checkpoint 10: ok (")
    assert lines[-1] == "all 2 checkpoints restore" and out.err == ""
    assert snapshot(copy) == before


@pytest.mark.parametrize("kind", [k if k == DAMAGE_KINDS[0] else pytest.param(k, marks=pytest.mark.slow)
                                  for k in DAMAGE_KINDS])  # one kind by default, every kind with -m slow
def test_damage_of_every_kind_is_named_per_step_and_nothing_moves(copy, capsys, kind):
    damage(copy / "checkpoints" / "10", kind)
    before = snapshot(copy)
    assert main(["verify", "--workdir", str(copy), "--json"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["ok"]) for r in rows] == [(5, True), (10, False)]
    assert rows[1]["damage"].startswith("params"), rows[1]
    assert snapshot(copy) == before  # read-only: nothing moved, nothing written
    assert main(["verify", "--workdir", str(copy)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("checkpoint 10: damaged (params")
    assert out[-1].startswith("1 of 2 checkpoints damaged (10); a training run resumes from 5")


def test_unfinished_saves_and_earlier_moves_are_listed(copy, capsys):
    (copy / "checkpoints" / "15.orbax-checkpoint-tmp-123").mkdir()
    (copy / "checkpoints.damaged" / "20-x").mkdir(parents=True)
    assert main(["verify", "--workdir", str(copy)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "1 unfinished save(s) never used (15.orbax-checkpoint-tmp-123)" in last
    assert "1 moved aside earlier in checkpoints.damaged/" in last


def test_a_checkpoint_of_another_model_does_not_pass(copy, capsys):
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace("num_layers: 2", "num_layers: 3"))
    assert main(["verify", "--workdir", str(copy)]) == 1
    assert "does not match the run's config.yaml: checkpoint in" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "empty", "file"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    workdir = tmp_path / "w"
    if case == "empty":
        workdir.mkdir()
    elif case == "file":
        workdir.write_text("x")
    assert main(["verify", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and ("does not exist" in err or "no checkpoint" in err)
    assert not (workdir / "checkpoints").exists() if case == "empty" else True
    assert os.path.exists(workdir) == (case != "missing")
