"""python -m bench.ab: this machine's before/after of the CPU-independent speed changes, timed interleaved.

    python -m bench.ab                         # every change: about 5 minutes on a 2-core CPU
    python -m bench.ab --only freeze            # some of them
    python -m bench.ab --reps 9 --rounds 3     # more timed calls (in-process) / more alternations (processes)
    python -m bench.ab --quick                 # tiny shapes: a smoke run of a minute

Each change is measured against its own absence in the same run, so the ratio holds on a busy machine:

- freeze: the fine-tuning step of the pretrained job (all-MiniLM-L6-v2's shape, N32 L48, dropout 0.1, AdamW,
  clipping) with `optim.freeze: [embedding]`, as configs/sentiment_pretrained.yaml trains it, against the
  same step training the [30522, 384] token table. Both compiled in this process, timed A, B, A, B.
- huge_pages: the same step and the N8 L256 D512 Pre-LN training step of `python -m bench`, each in its own
  process, alternately with transparent huge pages for malloc's large blocks (`JAXBLOCK_HUGE_PAGES=on`,
  train/host_memory.py) and with glibc's defaults; malloc's setting is fixed when a process starts, hence
  processes, not calls.

The model is randomly initialised at MiniLM's shape (the speed does not depend on the weights' values).
Prints one table with both medians and after/before (>1: the change is faster), the CPU model and the
load average. Exit codes: 0 success, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.arguments import exit_process

CHANGES = ("freeze", "huge_pages")
QUICK = os.environ.get("JAXBLOCK_BENCH_AB_QUICK") == "1"  # --quick, passed on to the huge_pages children


def _bert_step(freeze: tuple[str, ...] = ()) -> Callable[[], None]:
    """The compiled fine-tuning step (bench.bert.OursFineTune) on a random MiniLM-shaped checkpoint, with the
    bench bert section's batch (N32 L48)."""
    from bench.bert import OursFineTune, checkpoint, make_batch

    with tempfile.TemporaryDirectory(prefix="jaxblock-bench-ab-") as tmp:
        checkpoint(Path(tmp), QUICK, None)
        vocab = int(json.loads((Path(tmp) / "config.json").read_text())["vocab_size"])
        n, length = (4, 16) if QUICK else (32, 48)
        return OursFineTune(Path(tmp), make_batch(n, length, vocab), freeze=freeze)


def _d512_step() -> Callable[[], None]:
    from bench.context import CPU_SHAPES, QUICK_SHAPES
    from bench.workloads import OursTrain, init_params, make_inputs, stack_config

    shape = QUICK_SHAPES[0] if QUICK else CPU_SHAPES[1]
    cfg = stack_config(shape, "pre")
    x, valid = make_inputs(shape)
    return OursTrain(cfg, init_params(cfg, shape), x, valid)


def _interleaved(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    from bench.measure import time_interleaved

    return {k: statistics.median(v) for k, v in time_interleaved(fns, reps=reps, warmup=2).items()}


def freeze(reps: int, rounds: int) -> list[tuple[str, float, float]]:
    del rounds
    med = _interleaved({"before": _bert_step(), "after": _bert_step(freeze=("embedding",))}, reps)
    return [("freeze: MiniLM fine-tune step, token table trained -> frozen", med["before"], med["after"])]


def huge_pages(reps: int, rounds: int) -> list[tuple[str, float, float]]:
    times: dict[str, dict[str, list[float]]] = {"bert": {"before": [], "after": []},
                                                "d512": {"before": [], "after": []}}
    for _ in range(rounds):
        for when, switch in (("before", "off"), ("after", "on")):
            env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXBLOCK_HUGE_PAGES")}
            env["JAXBLOCK_HUGE_PAGES"] = switch
            out = subprocess.run([sys.executable, "-m", "bench.ab", "--child", "--reps", str(reps)], env=env,
                                 check=True, capture_output=True, text=True).stdout
            child = json.loads(out.strip().splitlines()[-1])
            for step in times:
                times[step][when].append(child[step])
    return [(f"huge pages: {label}, glibc's malloc -> transparent huge pages (alternating processes)",
             statistics.median(times[step]["before"]), statistics.median(times[step]["after"]))
            for step, label in (("bert", "MiniLM fine-tune step"), ("d512", "N8 L256 D512 Pre-LN train step"))]


def _child(reps: int) -> None:
    """One huge_pages process: both steps' medians as one JSON line on stdout."""
    med = _interleaved({"bert": _bert_step(), "d512": _d512_step()}, reps)
    print(json.dumps(med), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(CHANGES), help=f"comma-separated changes of {', '.join(CHANGES)}")
    p.add_argument("--reps", type=int, default=7, help="timed calls per step after 2 warm-ups (default 7)")
    p.add_argument("--rounds", type=int, default=2, help="huge_pages: before/after process pairs (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.reps < 1 or args.rounds < 1:
        print("python -m bench.ab: --reps and --rounds must be positive integers", file=sys.stderr)
        return 2
    if args.quick:
        global QUICK
        QUICK = True
        os.environ["JAXBLOCK_BENCH_AB_QUICK"] = "1"
    if args.child:
        _child(args.reps)
        return 0
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CHANGES))
    if unknown or not chosen:
        print(f"python -m bench.ab: unknown change {', '.join(unknown) or '(none)'}: choose from "
              f"{', '.join(CHANGES)}", file=sys.stderr)
        return 2
    from bench.machine import describe
    from train.host_memory import status

    print(f"machine: {describe()}; {status()}; load average "
          f"{os.getloadavg()[0]:.2f} at the start", flush=True)
    rows = []
    try:
        for change in chosen:
            print(f"== {change}", file=sys.stderr, flush=True)
            rows += globals()[change](args.reps, args.rounds)
    except KeyboardInterrupt:
        print("python -m bench.ab: interrupted", file=sys.stderr)
        return 130
    print("| change | before (ms) | after (ms) | after / before speed |")
    print("| --- | --- | --- | --- |")
    for name, before, after in rows:
        print(f"| {name} | {before * 1e3:.1f} | {after * 1e3:.1f} | {before / after:.2f}x |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:  # each child chooses for itself (JAXBLOCK_HUGE_PAGES, set by huge_pages)
        from train.host_memory import reexec_with_huge_pages

        reexec_with_huge_pages()
    exit_process(main())
