"""python -m bench.cpu_report: every speed measurement of this repository on this machine, as one Markdown record.

    python -m bench.cpu_report                      # ~13-15 min on a 2-core CPU; writes bench/records/<cpu>-<date>.md
                                                    # (or <cpu>-<date>-2.md, ...: an earlier record is never replaced)
    python -m bench.cpu_report --out record.md      # somewhere else
    python -m bench.cpu_report --quick              # tiny shapes: a smoke run of a minute or two

It runs, one after the other, each in its own process:

    python -m bench --only peak,train,infer,bert,options --no-torch-compile   # ours vs PyTorch, the options
    python -m bench --only bert --malloc keep --no-torch-compile              # BERT again, no page faults
    python -m bench.profile --shape 1                                         # where the D=512 step's time goes
    python -m bench.profile --bert                                            # the same for the BERT step
    python -m bench.ab                                                        # each change vs its absence

and writes the machine (`lscpu`'s model name, cores, the vector and matrix ISA flags, XLA_FLAGS),
the versions (Python, jax, jaxlib, flax, torch, transformers, the git commit and whether the tree was
clean), the load average before and after each command, and each command's whole output with its wall
time and exit status. A command that fails is recorded with its output and the others still run. Its
progress streams to stderr as it runs. Records go to bench/records/.
Exit codes: 0 every command succeeded, 1 one or more failed (the record says which), 2 bad usage,
130 interrupted (the record so far is written).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from bench.record_files import RECORDS, free_name

ROOT = Path(__file__).resolve().parent.parent
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16",
             "amx_tile", "amx_int8", "asimd", "sve")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers")
TIMEOUT_S = 1800  # per command: a hung command is recorded as such, and the rest still run


@dataclass
class Outcome:
    title: str
    argv: list[str]
    output: str
    code: int | None  # None: timed out
    wall_s: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]


def commands(quick: bool) -> list[tuple[str, list[str]]]:
    """(what it measures, argv after `python`) of each command the record holds, in order."""
    q = ["--quick"] if quick else []
    return [
        ("ours vs PyTorch eager and transformers, and what each option buys",
         ["-m", "bench", "--only", "peak,train,infer,bert,options", "--no-torch-compile", *q]),
        ("the BERT step against transformers again, glibc keeping what the process frees: neither side "
         "page-faults", ["-m", "bench", "--only", "bert", "--malloc", "keep", "--no-torch-compile", *q]),
        ("where the Pre-LN training step's time goes" + ("" if quick else " at N8 L256 D512")
         + " (the trace slows the step)", ["-m", "bench.profile", "--shape", "1", *q]),
        ("where the BERT fine-tuning step's time goes", ["-m", "bench.profile", "--bert", *q]),
        ("this round's changes, each against its absence, interleaved", ["-m", "bench.ab", *q]),
    ]


def lscpu() -> dict[str, str]:
    """`lscpu`'s fields (empty where there is no lscpu), with /proc/cpuinfo's flags as a fallback."""
    fields: dict[str, str] = {}
    if shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, check=False,
                                 env={**os.environ, "LC_ALL": "C"}).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    if "Flags" not in fields:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
        flags = next((line.partition(":")[2] for line in cpuinfo.splitlines() if line.startswith("flags")), "")
        fields["Flags"] = " ".join(sorted(flags.split()))
    return fields


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_state() -> str:
    """'<short commit>' plus ', uncommitted changes' when the tracked files differ from it; 'unknown' outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return commit + (", with uncommitted changes" if dirty else "")


def default_out(model: str, today: datetime.date, records: Path = RECORDS) -> Path:
    """records/<cpu>-<date>.md, or the first of <cpu>-<date>-2.md, -3.md, ... not yet taken: a second report on
    the same day never replaces the first."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower().replace("(r)", "").replace("(tm)", "")).strip("-") or "cpu"
    return free_name(f"{slug}-{today.isoformat()}", records)


def run_one(title: str, argv: list[str], log: TextIO | None = None) -> Outcome:
    """Run `python argv` from the checkout, streaming its output to `log` (stderr) line by line and keeping
    it; killed after TIMEOUT_S."""
    log = log or sys.stderr
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    load_before = os.getloadavg()
    start = time.perf_counter()
    lines: list[str] = []
    print(f"== python {' '.join(argv)}", file=log, flush=True)
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", file=log, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code: int | None
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:  # timed out, or interrupted: the command goes with us
            proc.kill()
            proc.wait()
    reader.join(timeout=30)
    return Outcome(title, argv, "".join(lines), code, time.perf_counter() - start, load_before, os.getloadavg())


def render(cpu: dict[str, str], vers: dict[str, str], git: str, xla: str, outcomes: list[Outcome],
           today: datetime.date, quick: bool, complete: bool = True, malloc: str = "") -> str:
    """The Markdown record."""
    model = cpu.get("Model name", "unknown CPU")
    flags = set(cpu.get("Flags", "").split())
    isa = [f for f in ISA_FLAGS if f in flags]
    cores = cpu.get("CPU(s)", str(os.cpu_count() or "?"))
    load = outcomes[0].load_before if outcomes else os.getloadavg()
    lines = [
        f"# {model}, {cores} CPUs, measured {today.isoformat()} on {git}"
        + (" (--quick: tiny shapes)" if quick else ""),
        "",
        f"Machine: `lscpu` \"{model}\""
        # One model name ("AMD EPYC") covers machines whose XLA matmuls differ by nearly 2x (bench/records).
        + (f" (vendor {cpu['Vendor ID']}, family {cpu['CPU family']}, model {cpu['Model']})"
           if all(k in cpu for k in ("Vendor ID", "CPU family", "Model")) else "")
        + f"; {cores} CPUs"
        + (f", {cpu['Thread(s) per core']} thread(s) per core" if "Thread(s) per core" in cpu else "")
        + (f"; hypervisor {cpu['Hypervisor vendor']}" if "Hypervisor vendor" in cpu else "")
        + f"; flags include {', '.join(isa) if isa else 'none of ' + ', '.join(ISA_FLAGS[:4])}.",
        f"Versions: {', '.join(f'{k} {v}' for k, v in vers.items())}.",
        f"XLA_FLAGS: {xla}." + (f" {malloc[0].upper()}{malloc[1:]}." if malloc else ""),
        f"Written by `python -m bench.cpu_report{' --quick' if quick else ''}`: each block is one run of the named "
        f"command, one after the other; the load average (1, 5, 15 min) at the start was "
        f"{', '.join(f'{x:.2f}' for x in load)}. Absolute times move from run to run and with the machine's "
        "load; the ratios within one run are what to compare.",
    ]
    if not complete:
        lines += ["", "**Interrupted: the commands below are those that had finished.**"]
    for o in outcomes:
        status = "exit 0" if o.code == 0 else ("timed out" if o.code is None else f"**exit {o.code}**")
        lines += [
            "",
            f"## python {' '.join(o.argv)}",
            "",
            f"{o.title}. {o.wall_s:,.0f} s wall, {status}; load average "
            f"{o.load_before[0]:.2f} before, {o.load_after[0]:.2f} after.",
            "",
            "```",
            o.output.rstrip("\n"),
            "```",
        ]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_report", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="the Markdown record to write (default bench/records/<cpu model>-<date>.md)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and 2 repetitions: a smoke run")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    cpu = lscpu()
    today = datetime.date.today()
    if "Model name" not in cpu:
        from bench.machine import cpu_model

        cpu["Model name"] = cpu_model()
    out: Path = args.out or default_out(cpu["Model name"], today)
    if out.exists() and out.is_dir():
        print(f"python -m bench.cpu_report: --out {out} is a directory: pass a file name such as "
              f"{out / 'record.md'}", file=sys.stderr)
        return 2
    if out.exists():
        print(f"python -m bench.cpu_report: --out {out} already exists (an earlier record): pass a new file name, "
              "or leave out --out for the next free name in bench/records/", file=sys.stderr)
        return 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a"):
            pass
        out.unlink()  # only a check that it can be written: a report interrupted before its end leaves no empty file
    except OSError as err:
        print(f"python -m bench.cpu_report: cannot write {out} ({err.strerror or err}): pass a writable --out",
              file=sys.stderr)
        return 2
    xla = os.environ.get("XLA_FLAGS") or "XLA's defaults"
    from train import host_memory

    malloc = host_memory.status() + ", except the second BERT run: glibc keeping what is freed (`--malloc keep`)"
    vers, git = versions(), git_state()
    outcomes: list[Outcome] = []
    complete = True
    try:
        for title, command in commands(args.quick):
            outcomes.append(run_one(title, command))
    except KeyboardInterrupt:
        complete = False
    out.write_text(render(cpu, vers, git, xla, outcomes, today, args.quick, complete, malloc))
    if not complete:
        print(f"python -m bench.cpu_report: interrupted; the finished commands are in {out}", file=sys.stderr)
        return 130
    failed = [o for o in outcomes if o.code != 0]
    print(f"wrote {out}" + (f" ({len(failed)} command(s) failed: see the record)" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
