"""The lowering table: every config of configs/ x layout x platform through `python -m train lower`'s checks.

    python -m bench.lowering                                   # the whole grid -> docs/accelerators-lowering.md
    python -m bench.lowering --configs tiny,sentiment_tpu --layouts dp,tp --platforms tpu --out -

For each cell it exports the train step and the inference for the platform on an abstract mesh of --devices
accelerator devices (train/aot/lower.py: no device, no weights, no data needed) and records whether both
lowered, the kernel each layer got and whether the lowered module holds it, and the memory per device of
parameters, gradients and optimizer state. The collectives are left out here (they need a CPU compile per
cell: `python -m train lower` prints them). Exit codes: 0 every cell lowered with every promised kernel
found, 1 some did not, 2 bad usage (one line).
"""

from __future__ import annotations

import argparse
import datetime
import platform as host_platform
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "accelerators-lowering.md"


@dataclass
class Cell:
    config: str
    layout: str
    platform: str
    lowered: bool
    ok: bool
    kernels: str  # e.g. "train splash 6/6; eval splash 6/6"
    memory: str  # per device, e.g. "32.3 MiB (params 10.9 MiB)"
    mesh: str
    problem: str  # why not ok, one line ("" when ok)
    seconds: float


def layouts_for(devices: int) -> list[str]:
    from train.aot.lower import LAYOUTS

    return [name for name in LAYOUTS if name == "single" or devices % _multiple(name) == 0]


def _multiple(layout: str) -> int:
    from train.aot.lower import LAYOUT_MULTIPLE

    return max(2, LAYOUT_MULTIPLE.get(layout, 1))


def configs_in(directory: Path = ROOT / "configs") -> list[Path]:
    return sorted(directory.glob("*.yaml"))


def _kernels(report: object) -> str:
    from train.aot.lower import Report

    assert isinstance(report, Report)
    parts = []
    for call in report.calls:
        if not call.lowered:
            parts.append(f"{call.call}: not lowered")
            continue
        counts: dict[str, list[int]] = {}
        for layer in call.layers:
            name = f"{layer.kernel}→{layer.substitute}" if layer.substitute else layer.kernel
            found = counts.setdefault(name, [0, 0])
            found[0] += int(layer.ok)
            found[1] += 1
        parts.append(f"{call.call} " + ", ".join(f"{k} {ok}/{n}" for k, (ok, n) in counts.items()))
    return "; ".join(parts)


def check(config: Path, layout: str, platform: str, devices: int) -> Cell:
    """One cell of the grid (bad input, e.g. a batch the mesh cannot split, is a cell that did not lower)."""
    from train.aot.lower import lower, mesh_text, one_line_error, resolve, size
    from train.errors import ONE_LINE_ERRORS

    start = time.perf_counter()
    name = config.stem
    try:
        target = resolve(str(config), [], platform, None if layout == "single" else devices, layout)
        report = lower(target, str(config), compile_collectives=False)
    except ONE_LINE_ERRORS as err:  # what the command refuses in one line (exit 2)
        return Cell(name, layout, platform, False, False, "-", "-", "-", f"refused: {err}",
                    time.perf_counter() - start)
    except Exception as err:  # a failure outside the two exports: the table says so and goes on
        return Cell(name, layout, platform, False, False, "-", "-", "-", f"crashed: {one_line_error(err)}",
                    time.perf_counter() - start)
    m = report.memory
    memory = f"{size(m['total'])} (params {size(m['parameters'])})"
    by_error: dict[str, list[str]] = {}
    for c in report.calls:
        if not c.lowered:
            by_error.setdefault(str(c.error), []).append(c.call)
    problems = [f"{' and '.join(calls)} not lowered: {error}" for error, calls in by_error.items()]
    problems += [f"{c.call} layer {x.layer}: {x.kernel} not found" for c in report.calls if c.lowered
                 for x in c.layers if not x.ok]
    return Cell(name, layout, platform, all(c.lowered for c in report.calls), report.ok, _kernels(report), memory,
                mesh_text(report.mesh), "; ".join(problems), time.perf_counter() - start)


def grid(configs: Iterable[Path], layouts: list[str], platforms: list[str], devices: int,
         progress: bool = True) -> list[Cell]:
    cells = []
    for config in configs:
        for platform in platforms:
            for layout in layouts:
                cell = check(config, layout, platform, devices)
                cells.append(cell)
                if progress:
                    state = "ok" if cell.ok else "FAILED"
                    print(f"{cell.config:<28} {platform:<5} {layout:<11} {state:<6} {cell.seconds:5.1f}s "
                          f"{cell.kernels} {cell.problem}", file=sys.stderr, flush=True)
    return cells


def markdown(cells: list[Cell], devices: int, seconds: float) -> str:
    import jax

    rows = ["| config | layout (mesh) | platform | lowered | kernel found per layer (train; eval) | "
            "memory per device |", "| --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        lowered = "yes" if c.lowered else "**no**"
        kernels = (c.kernels if c.ok else f"{c.kernels} — **{c.problem}**").replace("|", "\\|")
        rows.append(f"| {c.config} | {c.layout} ({c.mesh}) | {c.platform} | {lowered} | {kernels} | {c.memory} |")
    bad = [c for c in cells if not c.ok]
    causes: dict[str, list[Cell]] = {}
    for c in bad:
        causes.setdefault(c.problem.split(" not lowered: ")[-1], []).append(c)
    summary = [f"- {len(group)} cell{'s' if len(group) > 1 else ''} ("
               f"{', '.join(f'{c.config} {c.layout} {c.platform}' for c in group)}): {cause}"
               for cause, group in causes.items()]
    today = datetime.date.today().isoformat()
    return "\n".join([
        "# Lowering every config for TPU and CUDA, on a CPU host",
        "",
        "Generated by `python -m bench.lowering` (do not edit by hand). Each cell exports the config's train step",
        "and its inference (the eval step) with `jax.export` for the platform, on an abstract mesh of "
        f"{devices} accelerator",
        "devices (one for `single`) with the run's shardings, exactly as `python -m train lower` does",
        "(train/aot/lower.py), and checks that every layer's lowered module holds the attention kernel the dispatch",
        "promised (`ok/n`: layers where it was found, of n). `cudnn→xla`: cuDNN cannot be traced without the",
        "CUDA plugin, so that call was lowered with the kernel the dispatch picks without cuDNN (XLA's);",
        "`unfused` is attention-weight dropout in training (no fused kernel has it). Memory per device is",
        "parameters + gradients + optimizer state from the shardings (no activations); the vocabulary is the",
        "config's (a BPE's at most data.bpe_vocab_size). Nothing here ran on an accelerator: lowering proves",
        "the programs are well formed for the target and the kernels are in them, not that they are fast.",
        "",
        f"Run {today} on {host_platform.machine()} with jax {jax.__version__}: {len(cells)} cells, "
        f"{len(cells) - len(bad)} ok, {len(bad)} not, {seconds / 60:.0f} minutes.",
        *(["", "What did not lower, or lowered without its kernel:", "", *summary] if summary else []),
        "",
        *rows,
        "",
    ])


def _parser() -> argparse.ArgumentParser:
    from train.cli import Parser

    p = Parser(prog="python -m bench.lowering", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="", help="comma-separated config names of configs/ (default: every one)")
    p.add_argument("--layouts", default="", help="comma-separated layouts (default: every one that fits)")
    p.add_argument("--platforms", default="tpu,cuda", help="comma-separated: tpu, cuda")
    p.add_argument("--devices", type=int, default=8, help="devices in the mesh (default 8)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"Markdown file, or - for stdout (default {DEFAULT_OUT})")
    return p


def main(argv: list[str] | None = None) -> int:
    from train.aot.lower import LAYOUTS, PLATFORMS

    parser = _parser()
    args = parser.parse_args(argv)
    every = {p.stem: p for p in configs_in()}
    names = [n for n in args.configs.split(",") if n] or list(every)
    layouts = [n for n in args.layouts.split(",") if n] or layouts_for(args.devices)
    platforms = [n for n in args.platforms.split(",") if n]
    for kind, chosen, known in (("config", names, every), ("layout", layouts, LAYOUTS), ("platform", platforms,
                                                                                             PLATFORMS)):
        unknown = [n for n in chosen if n not in known]
        if unknown:
            parser.error(f"unknown {kind} {unknown[0]!r}: use some of {', '.join(known)}")
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    start = time.perf_counter()
    cells = grid([every[n] for n in names], layouts, platforms, args.devices)
    text = markdown(cells, args.devices, time.perf_counter() - start)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(c.ok for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
