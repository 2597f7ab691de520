"""Where a training step's time goes: XLA's per-op trace, grouped into matmuls, layout copies, reductions
and elementwise work.

    python -m bench.profile                 # the D=512 benchmark shape (N=8, L=256, H=8, F=2048, B=4)
    python -m bench.profile --shape 0       # the D=256 shape
    python -m bench.profile --attention chunked --length 4096 --batch 1
    python -m bench.profile --bert          # the BERT fine-tuning step of `python -m bench --only bert`
    python -m bench.profile --quick         # the tiny benchmark shape (with --bert: a tiny BERT): a smoke run

Runs the step under `jax.profiler.trace` with XLA's per-op trace events on, then maps each event
back to its HLO instruction: a fusion whose metadata names `dot_general` is a matmul, `copy` and
`transpose` fusions are layout changes, `reduce` ones are reductions, the rest elementwise. Prints
milliseconds per step per group and the heaviest single ops, plus the matmul FLOP/s the step reached.
Exit codes: 0 success, 2 bad usage.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # JAXBLOCK_HUGE_PAGES=on: huge pages for XLA's buffers (train/host_memory.py)
    from train.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()

# Per-op trace events must be switched on before XLA starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from typing import Any

import jax

from bench.context import CPU_SHAPES, QUICK_SHAPES
from bench.flops import train_flops
from bench.workloads import OursTrain, Shape, init_params, make_inputs, stack_config

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def describe(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (group, 'shape  source op') for the report."""
    kinds = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        found = _OP_NAME.search(line)
        op = found.group(1) if found else ""
        if "dot_general" in op or name.startswith("dot"):
            kind = "matmul"
        elif name.startswith(("copy", "transpose")):
            kind = "layout copy"
        elif "reduce" in op or name.startswith("reduce"):
            kind = "reduction"
        else:
            kind = "elementwise"
        shape = line.split(" = ", 1)[1].split(" ", 1)[0]
        kinds[name] = (kind, f"{shape}  {op.rsplit('/', 2)[-2:] if op else ''}")
    return kinds


def profile_step(step: Any, steps: int = 3) -> tuple[dict[str, float], list[tuple[float, str, str]]]:
    """(ms per step per group, every op as (ms, name, group and what it is), heaviest first) from `steps`
    traced calls."""
    step()  # warm
    described = describe(step.compiled.as_text() or "")
    kinds = {name: kind for name, (kind, _) in described.items()}
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - start) * 1e3 / steps
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    per_op: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e["name"] in kinds:
            per_op[e["name"]] += e["dur"] / 1e3 / steps
    groups: dict[str, float] = collections.defaultdict(float)
    for name, ms in per_op.items():
        groups[kinds[name]] += ms
    groups["step (wall)"] = wall
    top = sorted(((ms, name, "  ".join(described[name])) for name, ms in per_op.items()), reverse=True)
    return dict(groups), top


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=int, default=1, choices=range(len(CPU_SHAPES)), help="benchmark shape index")
    p.add_argument("--length", type=int, default=None, help="override L")
    p.add_argument("--batch", type=int, default=None, help="override N")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "unfused", "chunked", "dense"))
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--scan", action="store_true", help="scan over layers")
    p.add_argument("--bert", action="store_true", help="profile the BERT fine-tuning step (bench/bert.py) instead")
    p.add_argument("--xla", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compiler option for this compile, e.g. xla_cpu_experimental_ynn_fusion_type=")
    p.add_argument("--quick", action="store_true",
                   help="the tiny benchmark shape (with --bert, a one-layer BERT of vocabulary 500): seconds")
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.bert:
        return _bert(args.quick)
    base = QUICK_SHAPES[0] if args.quick else CPU_SHAPES[args.shape]
    shape = Shape(args.batch or base.n, args.length or base.length, base.d, base.h, base.f, base.k)
    cfg = stack_config(shape, scan=args.scan, remat=args.remat, attention={"kernel": args.attention}, dtype=args.dtype)
    x, valid = make_inputs(shape)
    options = dict(kv.split("=", 1) for kv in args.xla)
    step = OursTrain(cfg, init_params(cfg, shape), x, valid, compiler_options=options or None)
    _report(step, train_flops(cfg, shape.n, shape.length),
            f"{shape.label} H{shape.h} F{shape.f} attention={args.attention} remat={args.remat} scan={args.scan} "
            f"{args.dtype}")
    return 0


def _bert(quick: bool = False) -> int:
    """The BERT fine-tuning step (random MiniLM-shaped weights, batch 32 x 48, dropout 0.1; quick: the
    one-layer BERT of `python -m bench --quick`, batch 4 x 16)."""
    import json
    from pathlib import Path

    from bench.bert import OursFineTune, checkpoint, make_batch

    n, length = (4, 16) if quick else (32, 48)
    with tempfile.TemporaryDirectory() as d:
        checkpoint(Path(d), quick=quick, source=None)
        vocab = int(json.loads((Path(d) / "config.json").read_text())["vocab_size"])
        step = OursFineTune(Path(d), make_batch(n, length, vocab))
    block = step.config.block
    _report(step, train_flops(step.config, n, length),
            f"BERT {step.config.num_layers}x D{block.model_dim} N{n} L{length} dropout {block.residual_dropout}")
    return 0


def _report(step: Any, flops: int, title: str) -> None:
    groups, top = profile_step(step)
    wall = groups.pop("step (wall)")
    from bench.machine import describe
    from train.host_memory import status as malloc_status

    print(f"machine: {describe()}; {malloc_status()}")
    print(f"{title}: step {wall:,.1f} ms, {flops / wall / 1e6:,.1f} GFLOP/s overall")
    busy = sum(groups.values())
    for kind, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        rate = f"  {flops / ms / 1e6:,.1f} GFLOP/s inside matmuls" if kind == "matmul" else ""
        print(f"  {kind:12s} {ms:9,.1f} ms  {ms / busy:6.1%} of op time{rate}")
    for group in sorted(groups, key=lambda g: -groups[g]):
        print(f"heaviest {group} ops:")
        for ms, name, kind in [t for t in top if t[2].startswith(group)][:6]:
            print(f"  {ms:9,.1f} ms  {name:24s} {kind}")


if __name__ == "__main__":
    sys.exit(main())
