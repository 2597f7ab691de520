"""The compile table: configs x targets x layouts through `python -m train compile`, written as a record.

    python -m bench.compile_grid                                    # every config, the six targets, its own layout
    python -m bench.compile_grid --layouts all                      # ... its own and every named layout
    python -m bench.compile_grid --configs bert_base_mlm_l128 --targets v5e-8,h100-8 --layouts dp,fsdp
    python -m bench.compile_grid --configs tiny --targets v5e-256 train.batch_size=256   # key=value: every cell
    python -m bench.compile_grid --layouts all --targets v5e-8 --layers 3     # each config cut to its first 3 layers
    python -m bench.compile_grid --layouts all --layers 1 --cells grid.jsonl  # resumable: run it again to go on

Each cell is one `python -m train compile --json` process (the chip's own compiler on this host, no chip):
compiled or not, the peak memory per chip against the chip's usable memory, fits, the kernel per layer and
whether the compiled program holds it, the collectives, the compile time. TPU targets run in this
interpreter (libtpu: the `[tpu]` extra); GPU targets in the GPU compiler's venv (`--gpu-python`, made by
bench/gpu_compiler_venv.sh). The table goes to bench/records/compile-grid-<date>.md (or --out). Exit codes:
0 every cell compiled and fits with its kernels, 1 some did not, 2 bad usage (one line).

`--cells FILE` keeps each cell as it ends, one JSON line, and a later run with the same FILE compiles only the
cells not in it (same config, target, layout and overrides): a grid of hundreds of cells, minutes each on a
small host, runs in pieces and survives an interrupted run; the table is written from every cell of the grid.
`--kept-only` compiles nothing and writes the table of the cells the file holds so far (exit 1 while some of
the grid's cells are not there yet).

`--layouts all` is each config's own layout (`config`: its `parallel` section and mesh as written) and then
every named layout of train/aot/shapes.py: the cells the slow test tests/train/aot/test_compile_every_config.py
compiles.

`--layers N` compiles each config with its first N layers (`model.num_layers=N` and each per-layer list of
`model.layers` cut to its first N entries): every layer kind, kernel and layout of the full model, at a
fraction of the compile time (a 12-layer BERT-base train step is minutes a cell; the deep configs' memory per
chip is in their headers, from `python -m train compile` at full depth).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.record_files import free_name

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("v5e-8", "v5p-8", "v6e-8", "v5e-256", "h100-8", "h200-8")
GPU_PYTHON = ROOT / ".venv-gpu" / "bin" / "python"


@dataclass
class Cell:
    config: str
    target: str
    layout: str
    code: int
    report: dict | None
    problem: str
    seconds: float
    overrides: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def key(self) -> tuple[str, str, str, tuple[str, ...]]:
        return self.config, self.target, self.layout, self.overrides

    def to_json(self) -> str:
        return json.dumps({"config": self.config, "target": self.target, "layout": self.layout,
                           "overrides": list(self.overrides), "code": self.code, "report": self.report,
                           "problem": self.problem, "seconds": self.seconds})


class CellsFileError(ValueError):
    """A --cells file that is not this command's (one line names the file, the line and the fix)."""


def load_cells(path: Path) -> dict[tuple[str, str, str, tuple[str, ...]], Cell]:
    """The cells a --cells file holds, by key; a missing file holds none."""
    if not path.exists():
        return {}
    cells = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            cell = Cell(d["config"], d["target"], d["layout"], int(d["code"]), d["report"], d["problem"],
                        float(d["seconds"]), tuple(d["overrides"]))
        except (ValueError, KeyError, TypeError) as err:
            raise CellsFileError(f"{path}:{number} is not a cell of python -m bench.compile_grid ({err}): pass "
                                 "--cells a file this command wrote, or a new path") from None
        cells[cell.key] = cell
    return cells


def keep_cell(path: Path, cell: Cell) -> None:
    """Append one cell to the --cells file and flush it to disk, so an interrupted run loses no finished cell."""
    with path.open("a") as f:
        f.write(cell.to_json() + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_cell(
    config: Path, target: str, layout: str, python: str, timeout: int, overrides: tuple[str, ...] = ()
) -> Cell:
    command = [python, "-m", "train", "compile", "--config", str(config), "--target", target, "--json"]
    if layout != "config":
        command += ["--layout", layout]
    command += list(overrides)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Cell(config.stem, target, layout, 1, None, f"timed out after {timeout}s", time.perf_counter() - start,
                    overrides)
    seconds = time.perf_counter() - start
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    if report is not None and "crashed" in report:  # the compiler's native code aborted (train/aot/isolate.py)
        return Cell(config.stem, target, layout, proc.returncode, None, report["error"][:300], seconds, overrides)
    problem = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["(no message)"])[-1][:200]
    if report is not None and proc.returncode == 1:
        problem = "does not fit" if not report["fits"] else "a promised kernel is missing"
    return Cell(config.stem, target, layout, proc.returncode, report, problem, seconds, overrides)


def every_layout() -> list[str]:
    """`--layouts all`: each config's own layout, then every named one (the slow every-config test's list)."""
    from train.aot.shapes import LAYOUTS

    return ["config", *LAYOUTS]


def depth_overrides(config: Path, layers: int) -> tuple[str, ...]:
    """The overrides that cut `config` to its first `layers` layers: none when it has no more than that, or when
    its depth is not in the file (a pretrained encoder's comes from its checkpoint)."""
    data: Any = yaml.safe_load(config.read_text()) or {}
    model = data.get("model") or {}
    if int(model.get("num_layers", 0)) <= layers:
        return ()
    cut = [f"model.num_layers={layers}"]
    for key, value in (model.get("layers") or {}).items():
        if isinstance(value, list):
            cut.append(f"model.layers.{key}={json.dumps(value[:layers])}")
    return tuple(cut)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _kernels(report: dict) -> str:
    parts = []
    for call in report["calls"]:
        counts: dict[str, list[int]] = {}
        for layer in call["layers"]:
            entry = counts.setdefault(layer["kernel"], [0, 0])
            entry[0] += int(layer["ok"])
            entry[1] += 1
        parts.append(f"{call['call']} " + ", ".join(f"{k} {ok}/{n}" for k, (ok, n) in counts.items()))
    return "; ".join(parts)


def row(cell: Cell) -> str:
    if cell.report is None:
        return (f"| {cell.config} | {cell.target} | {cell.layout} | no | - | - | - | {cell.problem} | "
                f"{cell.seconds:.0f} |")
    r = cell.report
    per = r["per_device_bytes"]
    train = r["calls"][0]
    collectives = ", ".join(f"{k} {v}" for k, v in train["collectives"].items() if v) or "none"
    compiled = "yes" if all(c["compiled"] for c in r["calls"]) else "refused"
    fits = "yes" if r["fits"] else "**no**"
    # The layout's name with its mesh: on 4 chips dp+fsdp+tp is dp+tp's mesh (data=2 tensor=2), a cell of its own
    return (f"| {cell.config} | {cell.target} | {cell.layout}: {r['mesh']} | {compiled} | {_gib(per['arguments'])} / "
            f"{_gib(per['temporaries'])} / {_gib(per['total'])} of {_gib(per['usable'])} | {fits} | "
            f"{_kernels(r)} | {collectives} | {cell.seconds:.0f} |")


def markdown(cells: list[Cell], seconds: float, arguments: tuple[str, ...] = (), kept: int = 0,
             missing: int = 0) -> str:
    """The record: `arguments`, the command's own (so the line that wrote it runs it again); `seconds`, the
    cells' compile time summed (those of an earlier run's --cells file included)."""
    import jax

    bad = [c for c in cells if not c.ok]
    lines = [
        "# Compiled for the chips on a CPU host: configs x targets x layouts",
        "",
        f"Written by `python -m bench.compile_grid{''.join(' ' + a for a in arguments)}`.",
        "Each cell: `python -m train compile --json` (the TPU compiler of",
        "libtpu, or XLA's GPU compiler with the chip's target configuration, on compile-only devices). Memory per",
        "chip in GiB from the compiler's analysis: arguments / temporaries / peak, of the chip's usable memory.",
        "Kernels: per call, the layers whose compiled program holds the kernel the dispatch promised, of all.",
        "",
        f"{datetime.date.today().isoformat()}, {platform.machine()}, jax {jax.__version__}: {len(cells)} cells, "
        f"{len(cells) - len(bad)} ok, {len(bad)} not, {seconds / 60:.0f} minutes"
        + (f" ({kept} cells from an earlier run's --cells file)." if kept else ".")
        + (f" Not compiled yet: {missing} cells of this grid (--kept-only; run the command without it to go on)."
           if missing else ""),
        "",
        "| config | target | layout: mesh | compiled | GiB per chip | fits | kernels | collectives (train) | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[row(c) for c in cells],
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from train.aot.shapes import LAYOUTS

    p = argparse.ArgumentParser(prog="python -m bench.compile_grid", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="", help="comma-separated config names of configs/ (default: every one)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated (default {','.join(TARGETS)})")
    p.add_argument("--layouts", default="config",
                   help="comma-separated layouts (config: each config's own), or 'all': its own and every named one "
                        "(default: config)")
    p.add_argument("--gpu-python", default=str(GPU_PYTHON), help="the GPU compiler venv's python")
    p.add_argument("--layers", type=int, default=0, metavar="N",
                   help="compile each config with its first N layers only (default: every layer)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    p.add_argument("--out", default="", help="Markdown file, or - (default bench/records/compile-grid-<date>.md)")
    p.add_argument("--cells", default="", metavar="FILE",
                   help="keep each cell in FILE (JSON lines) as it ends; cells already there are not compiled again")
    p.add_argument("--kept-only", action="store_true",
                   help="with --cells: compile nothing, write the table of the cells the file holds so far")
    p.add_argument("overrides", nargs="*", help="key=value for every cell (e.g. train.batch_size=256 for v5e-256)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    every = {c.stem: c for c in sorted((ROOT / "configs").glob("*.yaml"))}
    names = [n for n in args.configs.split(",") if n] or list(every)
    layouts = every_layout() if args.layouts == "all" else [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in every] + [n for n in layouts if n != "config" and n not in LAYOUTS]
    if unknown:
        print(f"python -m bench.compile_grid: unknown config or layout {unknown[0]!r}", file=sys.stderr)
        return 2
    if args.layers < 0:
        print(f"python -m bench.compile_grid: --layers {args.layers}: give a depth of at least 1 (0: every layer)",
              file=sys.stderr)
        return 2
    targets = [t for t in args.targets.split(",") if t]
    gpu = [t for t in targets if t.startswith(("h100", "h200", "a100", "b200"))]
    if args.kept_only and not args.cells:
        print("python -m bench.compile_grid: --kept-only writes the table of a --cells file: pass --cells FILE",
              file=sys.stderr)
        return 2
    if gpu and not args.kept_only and not Path(args.gpu_python).exists():  # --kept-only compiles nothing
        print(f"python -m bench.compile_grid: {', '.join(gpu)} need the GPU compiler's venv: run "
              "bench/gpu_compiler_venv.sh, or pass --gpu-python", file=sys.stderr)
        return 2
    cells_file = Path(args.cells) if args.cells else None
    try:
        done = load_cells(cells_file) if cells_file else {}
        if cells_file:
            cells_file.open("a").close()  # writable before the first compile, not after it
    except CellsFileError as err:
        print(f"python -m bench.compile_grid: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"python -m bench.compile_grid: --cells {cells_file}: {err.strerror or err}: give a file in a "
              "writable folder", file=sys.stderr)
        return 2
    cells, kept, missing = [], 0, 0
    for name in names:
        for target in targets:
            for layout in layouts:
                python = args.gpu_python if target in gpu else sys.executable
                cut = depth_overrides(every[name], args.layers) if args.layers else ()
                overrides = cut + tuple(args.overrides)
                cell = done.get((name, target, layout, overrides))
                if cell is not None:
                    kept += 1
                elif args.kept_only:
                    missing += 1
                    continue
                else:
                    cell = run_cell(every[name], target, layout, python, args.timeout, overrides)
                    if cells_file:
                        keep_cell(cells_file, cell)
                print(row(cell), file=sys.stderr, flush=True)
                cells.append(cell)
    if kept:
        print(f"{kept} of {len(cells)} cells from {cells_file}, not compiled again", file=sys.stderr)
    shown = tuple(argv if argv is not None else sys.argv[1:])
    text = markdown(cells, sum(c.seconds for c in cells), shown, kept, missing)
    out = args.out or str(free_name(f"compile-grid-{datetime.date.today().isoformat()}"))
    if out == "-":
        print(text)
    else:
        Path(out).write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0 if all(c.ok for c in cells) and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
