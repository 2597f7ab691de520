"""bench/compile_grid.py without a compiler: the command each cell runs and the row it makes of the report (the
compiles themselves are `python -m bench.compile_grid`, minutes per cell, and the slow tests of train compile)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import compile_grid

REPORT = {
    "mesh": "data=8", "fits": True,
    "per_device_bytes": {"arguments": 2**30, "temporaries": 2 * 2**30, "total": 3 * 2**30, "usable": 15.75 * 2**30},
    "calls": [
        {"call": "train", "compiled": True, "collectives": {"all-reduce": 2, "all-gather": 0},
         "layers": [{"kernel": "splash", "ok": True}, {"kernel": "splash", "ok": False}]},
        {"call": "eval", "compiled": True, "collectives": {}, "layers": [{"kernel": "splash", "ok": True}]},
    ],
}


def test_a_cell_runs_train_compile_with_its_layout_and_overrides_and_makes_one_row(monkeypatch: Any) -> None:
    seen: list[list[str]] = []

    def fake_run(command: list[str], **kw: Any) -> subprocess.CompletedProcess:
        seen.append(command)
        return subprocess.CompletedProcess(command, 1, stdout=json.dumps(REPORT), stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    cell = compile_grid.run_cell(Path("configs/tiny.yaml"), "v5e-256", "fsdp", "python", 60, ("train.batch_size=256",))
    assert seen[0][1:] == ["-m", "train", "compile", "--config", "configs/tiny.yaml", "--target", "v5e-256", "--json",
                           "--layout", "fsdp", "train.batch_size=256"]
    assert cell.code == 1 and cell.problem == "a promised kernel is missing"
    assert compile_grid.row(cell) == (
        "| tiny | v5e-256 | fsdp: data=8 | yes | 1.00 / 2.00 / 3.00 of 15.75 | yes | "
        "train splash 1/2; eval splash 1/1 | all-reduce 2 | 0 |")


def test_a_compiler_crash_is_a_row_that_says_so(monkeypatch: Any) -> None:
    """`compile --json` answers a native abort with {"error", "crashed", "report"} (train/aot/isolate.py)."""
    crash = {"error": "error: the compiler crashed (SIGABRT) compiling: F1206 x.cc:1] Check failed: a <= b. ...",
             "crashed": "SIGABRT", "report": "/tmp/r.log"}
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, stdout=json.dumps(crash), stderr=crash["error"] + "\n"))
    cell = compile_grid.run_cell(Path("configs/tiny.yaml"), "v5e-8", "dp", "python", 60)
    assert cell.code == 1 and cell.report is None and "crashed (SIGABRT)" in cell.problem
    assert compile_grid.row(cell).startswith("| tiny | v5e-8 | dp | no | - | - | - | error: the compiler crashed")


def test_an_unknown_config_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_grid.main(["--configs", "nope"]) == 2
    assert "unknown config or layout 'nope'" in capsys.readouterr().err


def test_layouts_all_is_the_configs_own_and_every_named_one_the_cells_the_slow_test_compiles(
    monkeypatch: Any, tmp_path: Path
) -> None:
    from train.aot.shapes import LAYOUTS

    compiled: list[str] = []

    def fake_cell(config: Path, target: str, layout: str, python: str, timeout: int,
                  overrides: tuple[str, ...] = ()) -> compile_grid.Cell:
        compiled.append(layout)
        return compile_grid.Cell(config.stem, target, layout, 0, REPORT, "", 1.0, overrides)

    monkeypatch.setattr(compile_grid, "run_cell", fake_cell)
    argv = ["--configs", "tiny", "--targets", "v5e-8", "--layouts", "all", "--out", str(tmp_path / "grid.md")]
    assert compile_grid.main(argv) == 0
    assert compiled == ["config", *LAYOUTS]
    from tests.train.aot.test_compile_every_config import (
        test_every_config_on_every_layout_compiles_to_one_answer as slow,
    )

    marks = [m for m in slow.pytestmark if m.name == "parametrize" and m.args[0] == "layout"]  # type: ignore[attr-defined]
    assert list(marks[0].args[1]) == compiled  # the slow test's layouts, in its order


def test_layers_cuts_the_depth_and_every_per_layer_list_and_the_config_still_loads() -> None:
    from train.config import load_config

    configs = Path(__file__).resolve().parents[2] / "configs"
    cut = compile_grid.depth_overrides(configs / "modernbert_long.yaml", 3)
    assert cut[0] == "model.num_layers=3"
    assert "model.layers.window=[null, 64, 64]" in cut
    config = load_config(str(configs / "modernbert_long.yaml"), list(cut))
    assert config.model.num_layers == 3 and config.model.layers.window == (None, 64, 64)
    assert config.model.layers.rope_base is not None and len(config.model.layers.rope_base) == 3
    # No deeper than asked, or depth not in the file (a pretrained encoder's comes from its checkpoint): unchanged.
    assert compile_grid.depth_overrides(configs / "sentiment.yaml", 3) == ()
    assert compile_grid.depth_overrides(configs / "sentiment_pretrained_accel.yaml", 1) == ()


def test_layers_below_one_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_grid.main(["--layers", "-1"]) == 2
    assert "--layers -1: give a depth of at least 1" in capsys.readouterr().err


def test_cells_file_keeps_each_cell_and_a_second_run_compiles_only_the_rest(monkeypatch: Any, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    compiled: list[tuple[str, str]] = []

    def fake_cell(config: Path, target: str, layout: str, python: str, timeout: int,
                  overrides: tuple[str, ...] = ()) -> compile_grid.Cell:
        compiled.append((config.stem, target))
        if target == "v6e-8" and len(compiled) == 2:
            raise KeyboardInterrupt  # the first run stops in its second cell
        return compile_grid.Cell(config.stem, target, layout, 0, REPORT, "", 1.5, overrides)

    monkeypatch.setattr(compile_grid, "run_cell", fake_cell)
    cells, out = tmp_path / "grid.jsonl", tmp_path / "grid.md"
    argv = ["--configs", "tiny", "--targets", "v5e-8,v6e-8", "--cells", str(cells), "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        compile_grid.main(argv)
    assert [json.loads(line)["target"] for line in cells.read_text().splitlines()] == ["v5e-8"]
    assert compile_grid.main(argv) == 0
    assert compiled == [("tiny", "v5e-8"), ("tiny", "v6e-8"), ("tiny", "v6e-8")]  # v5e-8 not compiled again
    text = out.read_text()
    assert "| tiny | v5e-8 | config: data=8 |" in text and "| tiny | v6e-8 | config: data=8 |" in text
    assert "1 cells from an earlier run's --cells file" in text
    assert f"Written by `python -m bench.compile_grid {' '.join(argv)}`." in text  # the command, to run again
    assert len(cells.read_text().splitlines()) == 2
    # Another depth or override is another cell: compiled, not taken from the file; then kept like the rest.
    assert compile_grid.main([*argv, "--layers", "1"]) == 0 and len(compiled) == 5
    assert compile_grid.main([*argv, "--layers", "1"]) == 0 and len(compiled) == 5
    assert compile_grid.main([*argv, "train.batch_size=64"]) == 0 and len(compiled) == 7


def test_kept_only_writes_the_table_of_the_cells_so_far_and_compiles_nothing(monkeypatch: Any, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cells, out = tmp_path / "grid.jsonl", tmp_path / "grid.md"
    compile_grid.keep_cell(cells, compile_grid.Cell("tiny", "v5e-8", "config", 0, REPORT, "", 1.5, ()))
    monkeypatch.setattr(compile_grid, "run_cell", lambda *a, **k: pytest.fail("--kept-only compiled a cell"))
    argv = ["--configs", "tiny", "--targets", "v5e-8,v6e-8", "--cells", str(cells), "--out", str(out), "--kept-only"]
    assert compile_grid.main(argv) == 1  # a cell of the grid is not there yet
    text = out.read_text()
    assert "| tiny | v5e-8 | config: data=8 |" in text and "| tiny | v6e-8 |" not in text
    assert "Not compiled yet: 1 cells of this grid" in text
    assert compile_grid.main(["--configs", "tiny", "--kept-only"]) == 2
    assert "pass --cells FILE" in capsys.readouterr().err
    # it compiles nothing, so GPU targets need no GPU compiler's venv
    assert compile_grid.main([*argv, "--targets", "h100-8", "--gpu-python", str(tmp_path / "none")]) == 1


def test_a_cells_file_of_something_else_is_one_line_exit_2_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cells = tmp_path / "notes.txt"
    cells.write_text("my notes\n")
    assert compile_grid.main(["--configs", "tiny", "--targets", "v5e-8", "--cells", str(cells)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{cells}:1 is not a cell" in err[0]
    assert cells.read_text() == "my notes\n"


def test_a_gpu_target_without_the_gpu_compilers_venv_is_one_line_exit_2(
    monkeypatch: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compile_grid, "run_cell", lambda *a, **k: pytest.fail("compiled without the GPU venv"))
    absent = tmp_path / "no-venv" / "bin" / "python"
    assert compile_grid.main(["--configs", "tiny", "--targets", "h100-8", "--gpu-python", str(absent)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "h100-8 need the GPU compiler's venv" in err[0] and "gpu_compiler_venv.sh" in err[0]


def test_a_cells_file_that_cannot_be_written_is_one_line_exit_2_before_any_compile(
    monkeypatch: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compile_grid, "run_cell", lambda *a, **k: pytest.fail("compiled before checking --cells"))
    for bad in (tmp_path / "no" / "such" / "grid.jsonl", tmp_path):
        assert compile_grid.main(["--configs", "tiny", "--targets", "v5e-8", "--cells", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--cells {bad}:" in err[0] and "writable folder" in err[0]
