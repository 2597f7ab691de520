"""Slow: every config of configs/ on every layout, compiled for v5e-8, v5p-8, v6e-8 (libtpu) and h100-8 (XLA's GPU
compiler, in its own venv), each cut to its first layer (bench/compile_grid.py's `--layers 1`: every layer
kind, kernel and layout at a fraction of the compile time; the full depths' memory is in the configs' headers).

Each cell is one `python -m train compile --json` process (bench/compile_grid.run_cell) and must give one of the
command's answers, never a crash or a traceback: exit 0 with a report that fits and holds every promised kernel;
exit 1 with a report that says what does not fit or which kernel is missing; or exit 2 with one line naming
the bad input (a layout the config cannot take). 13 configs x 9 layouts x 4 targets: hours on a 2-core host;
`python -m bench.compile_grid --layouts all --layers 1 --cells FILE` runs the same cells resumably and writes
the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import compile_grid
from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TARGETS = ("v5e-8", "v5p-8", "v6e-8", "h100-8")


@pytest.mark.slow
@pytest.mark.parametrize("layout", compile_grid.every_layout())
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_on_every_layout_compiles_to_one_answer(config: Path, target: str, layout: str,
                                                             request: pytest.FixtureRequest) -> None:
    python = request.getfixturevalue("gpu_python") if target.startswith("h") else sys.executable
    cell = compile_grid.run_cell(config, target, layout, python, 1800, compile_grid.depth_overrides(config, 1))
    assert cell.code in (0, 1, 2), (cell.code, cell.problem)
    if cell.code == 2:
        assert cell.report is None and cell.problem.startswith("error: ") and "Traceback" not in cell.problem
        return
    report = cell.report
    assert report is not None, cell.problem  # not a crash: the command's own report
    assert all(call["compiled"] or call.get("error") for call in report["calls"]), report["calls"]
    if cell.code == 0:
        assert report["fits"] and report["ok"]
        assert all(layer["ok"] for call in report["calls"] for layer in call["layers"])
    else:
        assert not report["fits"] or not report["ok"], "exit 1 with a report that fits and holds its kernels"
