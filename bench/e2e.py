"""python -m bench.e2e: the main jobs end to end, several versions of this repository side by side, interleaved.

    python -m bench.e2e --side before=751c425 --side after=HEAD                      # the main job, 2 rounds
    python -m bench.e2e --side before=751c425 --side after=HEAD --job pretrained --peer
    python -m bench.e2e --side after=HEAD --side xla=HEAD:model.block.attention.kernel=xla

Each side is a git revision of this repository (a worktree of it is made under --scratch) with optional
key=value overrides or ENV=value settings after a colon, comma-separated (UPPER_CASE names are environment
variables). Each round runs the job once per side, in a fresh process and a fresh workdir, the sides in
turn (and the pretrained job's peer, `python -m bench.finetune_peer`, with --peer), so a machine whose
speed drifts affects every side alike. Recorded per run: the wall time, the CPU time of the process and its
children, and the job's result line. The table (medians per side, and each side against the first) goes
to stdout and to bench/records/e2e-<job>-<date>.md, or the next free -2, -3, ... (or --out).

Jobs: main (configs/sentiment.yaml, the README's first command) and pretrained
(configs/sentiment_pretrained.yaml, all-MiniLM-L6-v2 fine-tuned). Exit codes: 0 done, 1 a run failed (its
output is in the record), 2 bad usage.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.record_files import free_name

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"main": "configs/sentiment.yaml", "pretrained": "configs/sentiment_pretrained.yaml"}


@dataclass
class Side:
    name: str
    rev: str
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    checkout: Path | None = None


@dataclass
class Run:
    side: str
    round: int
    wall: float
    cpu: float
    code: int
    result: str


def parse_side(text: str) -> Side:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--side {text!r}: pass NAME=REV[:key=value,ENV=value,...]")
    rev, _, extra = rest.partition(":")
    side = Side(name, rev)
    for item in filter(None, extra.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"--side {text!r}: {item!r} is not key=value")
        if key.isupper():
            side.env[key] = value
        else:
            side.overrides.append(item)
    return side


def checkout(side: Side, scratch: Path) -> Path:
    """A worktree of the side's revision (this checkout itself for HEAD without local changes asked for)."""
    commit = subprocess.run(["git", "rev-parse", side.rev], cwd=ROOT, capture_output=True, text=True, check=True)
    sha = commit.stdout.strip()
    path = scratch / f"rev-{sha[:12]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, capture_output=True,
                       check=True)
    return path


def run_job(side: Side, job: str, round_: int, scratch: Path, python: str) -> Run:
    assert side.checkout is not None
    workdir = Path(tempfile.mkdtemp(prefix=f"e2e-{side.name}-", dir=scratch))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "PYTHONPATH")}
    env |= {"PYTHONPATH": str(side.checkout), **side.env}
    command = [python, "-m", "train", "--config", JOBS[job], "--workdir", str(workdir), "train.progress=false",
               *side.overrides]
    return _timed(side.name, round_, command, side.checkout, env)


def run_peer(round_: int, python: str) -> Run:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT)
    return _timed("peer (transformers + PyTorch)", round_, [python, "-m", "bench.finetune_peer"], ROOT, env)


def _timed(name: str, round_: int, command: list[str], cwd: Path, env: dict[str, str]) -> Run:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (proc.stdout.strip().splitlines() or [""]) if proc.returncode == 0 else \
        (proc.stderr.strip().splitlines() or ["(no output)"])
    return Run(name, round_, wall, cpu, proc.returncode, lines[-1][:300])


def _accuracy(result: str) -> str:
    m = re.search(r"test accuracy ([\d.]+)", result) or re.search(r"test[^\d]*([\d.]+)", result)
    return m[1] if m else "-"


def render(job: str, runs: list[Run], names: list[str], start_load: float) -> str:
    import platform

    from bench.machine import cpu_model

    lines = [f"# {job} job end to end, sides interleaved", "",
             f"Written by `python -m bench.e2e {' '.join(sys.argv[1:])}` on {datetime.date.today().isoformat()}.",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, {platform.machine()}; load average {start_load:.2f} "
             "at the start.", "",
             "| side | round | wall s | CPU s | exit | result |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r.side} | {r.round} | {r.wall:.1f} | {r.cpu:.1f} | {r.code} | {r.result} |")
    lines += ["", "| side | median wall s | median CPU s | test accuracy | first side / this side (wall) |",
              "| --- | --- | --- | --- | --- |"]
    first = statistics.median([r.wall for r in runs if r.side == names[0]] or [float("nan")])
    for name in names:
        mine = [r for r in runs if r.side == name]
        if not mine:
            continue
        wall = statistics.median(r.wall for r in mine)
        cpu = statistics.median(r.cpu for r in mine)
        lines.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {', '.join(_accuracy(r.result) for r in mine)} | "
                     f"{first / wall:.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n")[0])
    p.add_argument("--side", type=parse_side, action="append", required=True,
                   help="NAME=REV[:key=value,ENV=value,...]; the first side is the baseline")
    p.add_argument("--job", choices=list(JOBS), default="main")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, interleaved (default 2)")
    p.add_argument("--peer", action="store_true", help="the pretrained job's peer too (python -m bench.finetune_peer)")
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "jaxblock-e2e",
                   help="worktrees and workdirs go here")
    p.add_argument("--out", default="", help="the record (default bench/records/e2e-<job>-<date>[-n].md; - for none)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.rounds < 1:
        print("python -m bench.e2e: --rounds must be at least 1", file=sys.stderr)
        return 2
    args.scratch.mkdir(parents=True, exist_ok=True)
    try:
        for side in args.side:
            side.checkout = checkout(side, args.scratch)
    except subprocess.CalledProcessError as err:
        print(f"python -m bench.e2e: cannot check out a side ({(err.stderr or b'').decode().strip()[:200]}): pass "
              "a revision of this repository", file=sys.stderr)
        return 2
    names = [s.name for s in args.side] + (["peer (transformers + PyTorch)"] if args.peer else [])
    load = os.getloadavg()[0]
    runs: list[Run] = []
    for round_ in range(1, args.rounds + 1):
        for side in args.side:
            runs.append(run_job(side, args.job, round_, args.scratch, sys.executable))
            print(f"{runs[-1]}", file=sys.stderr, flush=True)
        if args.peer:
            runs.append(run_peer(round_, sys.executable))
            print(f"{runs[-1]}", file=sys.stderr, flush=True)
    text = render(args.job, runs, names, load)
    print(text)
    if args.out != "-":
        out = Path(args.out) if args.out else free_name(f"e2e-{args.job}-{datetime.date.today().isoformat()}")
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 1 if any(r.code for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
