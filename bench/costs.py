"""How cost grows: step time and peak memory vs length L, width D and the number of layers; compile time
vs the number of layers (records name it B, as the benchmark tables do).

length  L = 128 ... 4096 for one sequence (N=1), B=2 blocks: projections, FFN and activations grow as L,
        attention's FLOPs and its [L, L] scores as L². Four attention/memory settings: XLA attention,
        XLA + remat, chunked (flash-style, [L, J] blocks), chunked + remat (remat always with scan over
        layers), and on a GPU 'auto' (cuDNN).
        On a CPU, 'auto' itself picks chunked from L = 4 * attention.chunk_size = 2048 on.
width   D = 128 ... 1024 (H = D/64, F = 4D) at N=8, L=128, B=2.
depth   1 ... 8 layers at the first benchmark shape.
compile time to trace and compile the training step vs the number of layers, with and without scan over layers.

Memory is reported twice: XLA's static plan for the compiled step (`memory_analysis`: arguments +
outputs + temporaries - donated) and this process's resident memory sampled while the step runs.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np

from bench.compare import PROBE, needs_peak
from bench.context import Context
from bench.flops import executed_train_flops, train_flops
from bench.measure import Record, compiled_memory, peak_rss, time_interleaved
from bench.workloads import OursTrain, Shape, init_params, make_inputs, stack_config


def measure_train_point(ctx: Context, section: str, name: str, cfg: Any, shape: Shape,
                        config: dict[str, Any], *, reps: int | None = None) -> Record:
    """Compile one training step, time it and sample its memory."""
    gc.collect()
    params = init_params(cfg, shape)
    x, valid = make_inputs(shape)
    start = time.perf_counter()
    step = OursTrain(cfg, params, x, valid)
    compile_s = time.perf_counter() - start
    fns: dict[str, Any] = {name: step}
    if ctx.dtype in ctx.probe:  # the peak matmul, timed beside the step under the same load
        fns[PROBE] = ctx.probe[ctx.dtype][1]
    with peak_rss() as rss:
        all_times = time_interleaved(fns, reps=reps or ctx.reps, warmup=ctx.warmup)
    times = all_times[name]
    med = float(np.median(times))
    peak_now = ctx.probe[ctx.dtype][0] / float(np.median(all_times[PROBE])) if PROBE in all_times else None
    flops = train_flops(cfg, shape.n, shape.length)
    metrics: dict[str, Any] = {
        "tokens_per_s": shape.n * shape.length / med, "gflop_per_s": flops / med / 1e9,
        "executed_gflop_per_s": executed_train_flops(cfg, shape.n, shape.length) / med / 1e9,
        **ctx.fraction(flops / med, peak_now), **compiled_memory(step.compiled),
        "rss_peak_bytes": rss["peak"], "rss_growth_bytes": rss["peak"] - rss["start"], "compile_s": compile_s,
    }
    del step
    return Record.from_times(section, name, {**shape.as_dict(), **config}, times, **metrics)


def _sweep_reps(ctx: Context) -> int:
    return min(ctx.reps, 3)


def length(ctx: Context) -> list[Record]:
    records = needs_peak(ctx)
    base = ctx.small
    lengths = (16, 32, 64) if ctx.quick else (512, 1024, 2048, 4096, 8192) if ctx.gpu else (
        128, 256, 512, 1024, 2048, 4096)
    chunk = 16 if ctx.quick else 512
    settings = {
        "xla": {"attention": "xla"},
        "xla+remat": {"attention": "xla", "remat": "full"},
        "chunked": {"attention": "chunked"},
        "chunked+remat": {"attention": "chunked", "remat": "full"},  # remat with scan: see options.py
    }
    if ctx.gpu:  # 'auto' is cuDNN's flash attention there
        settings = {"auto": {"attention": "auto"}, **settings}
    for L in lengths:
        shape = Shape(1, L, base.d, base.h, base.f, 2)
        for label, opt in settings.items():
            remat = opt.get("remat", "none")
            scan = remat != "none"  # XLA's CPU scheduler saves no memory with remat unless layers are scanned
            attention = {"kernel": opt["attention"], "chunk_size": chunk}
            cfg = stack_config(shape, scan=scan, remat=remat, attention=attention, dtype=ctx.dtype)
            ctx.log(f"length L={L} {label}")
            records.append(measure_train_point(ctx, "length", f"L={L} {label}", cfg, shape,
                                               {"attention": opt["attention"], "remat": remat, "scan": scan,
                                                "dtype": ctx.dtype},
                                               reps=_sweep_reps(ctx)))
    return records


def width(ctx: Context) -> list[Record]:
    widths = (16, 32) if ctx.quick else (512, 1024, 2048) if ctx.gpu else (128, 256, 512, 1024)
    n, L = (2, 16) if ctx.quick else (8, 2048) if ctx.gpu else (8, 128)
    records = needs_peak(ctx)
    for d in widths:
        h = max(d // 64, 1) if d >= 64 else 2
        shape = Shape(n, L, d, h, 4 * d, 2)
        ctx.log(f"width D={d}")
        records.append(measure_train_point(ctx, "width", f"D={d}", stack_config(shape, dtype=ctx.dtype), shape,
                                           {"dtype": ctx.dtype}, reps=_sweep_reps(ctx)))
    return records


def depth(ctx: Context) -> list[Record]:
    base = ctx.small
    records = needs_peak(ctx)
    for k in (1, 2) if ctx.quick else (1, 2, 4, 8):
        shape = Shape(base.n, base.length, base.d, base.h, base.f, k)
        ctx.log(f"depth B={k}")
        records.append(measure_train_point(ctx, "depth", f"B={k}", stack_config(shape, dtype=ctx.dtype), shape,
                                           {"dtype": ctx.dtype}, reps=_sweep_reps(ctx)))
    return records


def _compile_seconds(cfg: Any, shape: Shape) -> tuple[float, float]:
    """(trace + lower, compile) seconds for a fresh training step: nothing is reused between calls."""
    params = init_params(cfg, shape)
    x, valid = make_inputs(shape)
    step = OursTrain(cfg, params, x, valid)
    return step.lower_s, step.compile_s


def compile_time(ctx: Context) -> list[Record]:
    base = ctx.small
    depths = (1, 2) if ctx.quick else (2, 4, 8, 16, 24)
    reps = 1 if ctx.quick else 2
    shape0 = Shape(base.n, base.length, base.d, base.h, base.f, 1)
    _compile_seconds(stack_config(shape0), shape0)  # one-time JAX start-up costs, not counted below
    records = []
    for scan in (True, False):
        first: float | None = None
        for k in depths:
            shape = Shape(base.n, base.length, base.d, base.h, base.f, k)
            cfg = stack_config(shape, scan=scan, dtype=ctx.dtype)
            ctx.log(f"compile B={k} scan={scan}")
            runs = [_compile_seconds(cfg, shape) for _ in range(reps)]
            totals = [lower + comp for lower, comp in runs]
            med = float(np.median(totals))
            first = first or med
            records.append(Record.from_times(
                "compile", f"B={k} {'scan' if scan else 'unrolled'}", {**shape.as_dict(), "scan": scan}, totals,
                lower_s=float(np.median([r[0] for r in runs])), compile_s=float(np.median([r[1] for r in runs])),
                ratio_vs_first=med / first,
            ))
    return records
