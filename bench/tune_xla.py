"""python -m bench.tune_xla: measure XLA's CPU compiler options on this machine once, and keep the winner.

    python -m bench.tune_xla              # both CPU benchmark shapes, ~3 min; saves the choice
    python -m bench.tune_xla --dry-run    # measure and print, save nothing

Each candidate of bench/options.py XLA_CANDIDATES is compiled into the Pre-LN training step at every CPU
benchmark shape and timed interleaved with XLA's defaults (your own XLA_FLAGS, if any, stay under both).
A candidate wins only if it is at least --margin faster at every shape; the fastest winner (geometric mean
over the shapes) is kept, or XLA's defaults when none wins. The choice goes to
~/.cache/jaxblock/xla-options-measured.json under this CPU model and jaxlib version, and from then on
`jaxblock.xla_options.apply()` (python -m train, python -m bench) uses it instead of the CPU kind's table:
a measurement of this machine beats a guess from its kind. Rerun it after changing jaxlib or machine.
Exit codes: 0 measured (and saved), 1 the choice could not be saved, 2 bad usage, 130 interrupted (nothing saved).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from typing import Any

import numpy as np

from bench.arguments import checked, count, exit_process


def decide(speedups: dict[str, list[float]], margin: float) -> str | None:
    """The candidate to keep: at least `margin` faster than the defaults at every shape, fastest by geometric
    mean; None (keep XLA's defaults) when no candidate is."""
    winners = {name: math.exp(float(np.mean(np.log(s)))) for name, s in speedups.items()
               if s and min(s) >= margin}
    return max(winners, key=lambda name: winners[name]) if winners else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tune_xla", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=count, default=7, help="timed steps per variant and shape (default 7)")
    p.add_argument("--warmup", type=count, default=2, help="untimed steps first (default 2)")
    p.add_argument("--margin", type=_speedup, default=1.03,
                   help="how much faster than the defaults a candidate must be at every shape (default 1.03)")
    p.add_argument("--dry-run", action="store_true", help="measure and print; save nothing")
    p.add_argument("--quick", action="store_true", help="tiny shape, 2 repetitions: a smoke run (never saved)")
    return p


_speedup = checked(float, lambda v: 1.0 <= v < 10.0, "a speed ratio from 1.0 (e.g. 1.03 = 3% faster)")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    try:
        return _tune(args)
    except KeyboardInterrupt:
        print("python -m bench.tune_xla: interrupted; nothing saved", file=sys.stderr)
        return 130


def _tune(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxblock import xla_options  # apply() is not called: the baseline is XLA's defaults

    cpu = xla_options.read_cpu()
    user = os.environ.get("XLA_FLAGS", "").strip()
    print(f"machine: {cpu.model} [{cpu.kind}], jaxlib {xla_options.jaxlib_version()}"
          + (f"; your XLA_FLAGS under every variant: {user}" if user else ""), flush=True)

    from bench.context import CPU_SHAPES, QUICK_SHAPES
    from bench.measure import time_interleaved
    from bench.options import flag_spelling, usable_candidates
    from bench.workloads import OursTrain, init_params, make_inputs, stack_config

    shapes = QUICK_SHAPES if args.quick else CPU_SHAPES
    reps, warmup = (2, 1) if args.quick else (args.reps, args.warmup)
    usable, unknown = usable_candidates()
    candidates = {name.removeprefix("xla "): opts for name, opts in usable.items()}
    for name in unknown:
        print(f"{name}: unknown to this jaxlib, left out", flush=True)
    speedups: dict[str, list[float]] = {name: [] for name in candidates}
    rows: list[tuple[str, str, float, float]] = []
    for shape in shapes:
        x, valid = make_inputs(shape)
        cfg = stack_config(shape)
        params = init_params(cfg, shape)
        label = f"N{shape.n} L{shape.length} D{shape.d} B{shape.k}"
        print(f"{label}: compiling {1 + len(candidates)} variants", flush=True)
        steps: dict[str, Any] = {"XLA defaults": OursTrain(cfg, params, x, valid)}
        for name, opts in candidates.items():
            steps[name] = OursTrain(cfg, params, x, valid, compiler_options=opts)
        times = time_interleaved(dict(steps), reps=reps, warmup=warmup)
        base = float(np.median(times["XLA defaults"]))
        for name, ts in times.items():
            med = float(np.median(ts))
            rows.append((label, name, med, base / med))
            if name in speedups:
                speedups[name].append(base / med)
    width, lwidth = max(len(name) for _, name, _, _ in rows), max(len(label) for label, _, _, _ in rows)
    for label, name, med, ratio in rows:
        print(f"{label:{lwidth}s}  {name:{width}s}  {med * 1e3:9.1f} ms  {ratio:5.3f}x")
    best = decide(speedups, args.margin)
    options = flag_spelling(candidates[best]) if best else {}
    shown = xla_options.format_flags(options) or "XLA's defaults"
    why = (f"{', '.join(f'{s:.3f}x' for s in speedups[best])} at {len(shapes)} shape(s)" if best
           else f"no candidate was {args.margin:.2f}x faster at every shape")
    print(f"choice: {shown} ({why})")
    if args.dry_run or args.quick:
        print("not saved (--dry-run)" if args.dry_run else "not saved (--quick measures tiny shapes)")
        return 0
    entry = {"options": options, "measured_at": datetime.date.today().isoformat(), "margin": args.margin,
             "speedups": {name: [round(s, 4) for s in ss] for name, ss in speedups.items()},
             "shapes": [s.as_dict() for s in shapes], "user_xla_flags": user}
    try:
        path = xla_options.save_measured(cpu, None, entry)
    except OSError as err:
        print(f"python -m bench.tune_xla: could not save the choice ({err.strerror or err}); "
              f"make {xla_options.measured_path().parent} writable or set XDG_CACHE_HOME", file=sys.stderr)
        return 1
    print(f"saved to {path}: python -m train and python -m bench now use it on this machine")
    return 0


if __name__ == "__main__":
    from train.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()  # huge pages for XLA's per-step buffers (train/host_memory.py); before jax loads
    exit_process(main())
