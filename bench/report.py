"""A Markdown summary of a `python -m bench` results file (for docs/performance.md).

    python -m bench.report runs/bench/results.json

One table per section with the headline figure of each record: ratios against PyTorch, fraction of
the matmul peak measured beside the step, memory, speedups. Exit codes: 0 success, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _mib(v: Any) -> str:
    return f"{v / 2**20:,.0f}" if isinstance(v, int | float) else ""


def _f(v: Any, fmt: str = ".2f") -> str:
    return format(v, fmt) if isinstance(v, int | float) else ""


def _ms(v: float) -> str:
    return f"{v * 1e3:,.0f}"


def summarize(data: dict[str, Any]) -> str:
    meta, records = data["meta"], data["records"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["section"], []).append(r)
    out = [f"`{meta['command'].strip()}` on {meta['processor']} ({meta['device']}), {meta['threads']} threads, "
           f"jax {meta['jax']}, torch {meta['torch']}; load average {meta['loadavg_start'][0]:.1f} at start, "
           f"{meta.get('loadavg_end', [0])[0]:.1f} at end. Medians of {meta['reps']} timed calls.", ""]
    # Under every table: the machine a figure came from (older results files have no CPU record).
    machine = f"CPU: {meta.get('cpu', meta['processor'])}; XLA_FLAGS: `{meta.get('xla_flags') or '(none)'}`"

    def table(title: str, head: list[str], rows: list[list[str]]) -> None:
        if rows:
            out.extend([f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)])
            out.extend("| " + " | ".join(row) + " |" for row in rows)
            out.extend(["", machine, ""])

    peak = [r for r in by.get("peak", []) if r["name"].startswith("jax")]
    table("Matmul peak (GFLOP/s)", ["matmul", "jax", "torch"], [
        [r["name"].removeprefix("jax matmul "), _f(r["metrics"]["gflop_per_s"], ".0f"),
         next((_f(t["metrics"]["gflop_per_s"], ".0f") for t in by["peak"]
               if t["name"] == r["name"].replace("jax", "torch")), "")] for r in peak])
    for section, label in (("train", "Training step"), ("infer", "Inference, 25% padding")):
        rows = []
        for r in by.get(section, []):
            if not r["name"].startswith("ours"):
                continue
            m, shape = r["metrics"], r["name"].removeprefix("ours ")  # "pre-LN N16 L128 D256 B4"
            theirs = "torch eager " if section == "train" else "torch fast path "
            other = next((t for t in by[section] if t["name"] == theirs + shape), None)
            rows.append([shape, _ms(r["median"]), _ms(other["median"]) if other else "", _f(m.get("ratio")),
                         _f(m.get("ratio_vs_torch_compile")), _f(m.get("fraction_of_peak")),
                         _f(m.get("load_1min"), ".1f")])
        table(f"{label} (ms; ratio = PyTorch time / ours)",
              ["placement, shape", "ours", "PyTorch", "ratio", "vs torch.compile", "of matmul peak", "load"], rows)
    table("Cost vs L, D, K (training step; memory in MiB)", ["point", "ms", "of peak", "XLA plan", "RSS peak"], [
        [f"{r['section']} {r['name']}", _ms(r["median"]), _f(r["metrics"].get("fraction_of_peak")),
         _mib(r["metrics"].get("xla_peak_bytes")), _mib(r["metrics"].get("rss_peak_bytes"))]
        for s in ("length", "width", "depth") for r in by.get(s, [])])
    table("Compile time (s)", ["B", "scan", "unrolled"], [
        [r["name"].split()[0], f"{r['median']:.1f}",
         next((f"{t['median']:.1f}" for t in by["compile"] if t["name"] == r["name"].replace("scan", "unrolled")), "")]
        for r in by.get("compile", []) if r["name"].endswith("scan")])
    table("BERT fine-tuning step (ms; ratio = transformers time / ours)",
          ["model, batch", "ours", "transformers", "ratio", "tokens/s ours", "of matmul peak"], [
        [r["name"].removeprefix("ours "), _ms(r["median"]),
         next((_ms(t["median"]) for t in by["bert"] if t["name"] == r["name"].replace("ours", "transformers")), ""),
         _f(r["metrics"].get("ratio")), _f(r["metrics"].get("tokens_per_s"), ",.0f"),
         _f(r["metrics"].get("fraction_of_peak"))]
        for r in by.get("bert", []) if r["name"].startswith("ours")])
    table("What each option buys (speedup vs the default; XLA plan MiB)", ["option", "ms", "speedup", "memory"], [
        [r["name"], _ms(r["median"]), _f(r["metrics"].get("speedup")), _mib(r["metrics"].get("xla_peak_bytes"))]
        for s in ("options", "packing") for r in by.get(s, [])])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_file():
        print("usage: python -m bench.report RESULTS.json (a file written by python -m bench)", file=sys.stderr)
        return 2
    try:
        print(summarize(json.loads(Path(args[0]).read_text())))
    except (KeyError, ValueError, TypeError) as err:
        print(f"python -m bench.report: {args[0]} is not a bench results file ({err!r})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
