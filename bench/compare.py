"""Sections that compare: the machine's matmul peak, and ours vs PyTorch on training and inference.

peak   jitted [n, n] x [n, n] matmuls (n = 1024, 2048, 4096; bf16 too where the hardware has it);
       the practical peak is the best median FLOP/s over the sizes. PyTorch's own matmul is measured
       beside it, so a ratio against PyTorch can be read against what each library gets from the chip.
       On a shared machine the peak moves with the load, so every later step is timed interleaved with
       the 2048² matmul (8192² on a GPU) and `fraction_of_peak` divides by that probe's FLOP/s.
train  one optimizer step of the layer stack at each benchmark shape, both placements: ours,
       PyTorch eager and torch.compile (where it compiles), interleaved on the same weights and batch.
infer  eval-mode forward on a batch with 25% padding: ours vs PyTorch's fast path (inference_mode,
       a key padding mask, nested tensors where PyTorch allows them: Post-LN only).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.context import Context, cpu_has_bf16
from bench.flops import forward_flops, train_flops
from bench.measure import Record, time_interleaved
from bench.workloads import (
    OursInfer,
    OursTrain,
    TorchInfer,
    TorchTrain,
    init_params,
    make_inputs,
    max_abs_diff,
    stack_config,
    torch_module,
)
from jaxblock.attention import choose_implementation

PROBE = "peak matmul"


def peak(ctx: Context) -> list[Record]:
    sizes = (128, 256) if ctx.quick else (4096, 8192) if ctx.gpu else (1024, 2048, 4096)
    dtypes = ["float32"] + (["bfloat16"] if ctx.gpu or cpu_has_bf16() else [])
    records = []
    for dtype in dtypes:
        best = 0.0
        for size in sizes:
            a = jax.random.normal(jax.random.key(0), (size, size), dtype)
            b = jax.random.normal(jax.random.key(1), (size, size), dtype)
            matmul = jax.jit(jnp.matmul).lower(a, b).compile()

            def run(matmul: Any = matmul, a: jax.Array = a, b: jax.Array = b) -> None:
                matmul(a, b).block_until_ready()

            fns: dict[str, Any] = {"jax": run}
            if ctx.torch_device == "cpu" and dtype == "float32":
                import torch

                ta, tb = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))
                fns["torch"] = lambda ta=ta, tb=tb: torch.matmul(ta, tb)
            times = time_interleaved(fns, reps=ctx.reps, warmup=ctx.warmup)
            flops = 2 * size**3
            for lib, ts in times.items():
                rec = Record.from_times("peak", f"{lib} matmul {dtype} {size}", {"size": size, "dtype": dtype},
                                        ts, gflop_per_s=flops / float(np.median(ts)) / 1e9)
                records.append(rec)
                if lib == "jax":
                    best = max(best, flops / rec.median)
                    if size == sizes[-2 if len(sizes) > 2 else -1]:  # CPU 2048 (4096 takes seconds); GPU 8192
                        ctx.probe[dtype] = (flops, run)
        ctx.peak[dtype] = best
        ctx.log(f"peak {dtype}: {best / 1e9:,.1f} GFLOP/s (best median over sizes {sizes})")
    return records


def needs_peak(ctx: Context) -> list[Record]:
    """The peak section's records if it has not run yet (ratios to the peak need its probe)."""
    return [] if ctx.peak else peak(ctx)


def _impl(cfg: Any, compiled: Any, *, train: bool, length: int) -> dict[str, str]:
    """Which attention ran, and why: the library's choice, checked against the compiled program."""
    impl, reason = choose_implementation(cfg.block, train=train, length=length)
    text = compiled.as_text() if hasattr(compiled, "as_text") else ""
    if "cudnn" in text and "fmha" in text:
        ran = "cudnn"
    else:
        ran = impl if impl != "cudnn" else "xla (cuDNN absent from the compiled program)"
    return {"impl": ran, "impl_reason": reason}


def train(ctx: Context) -> list[Record]:
    records = needs_peak(ctx)
    for shape in ctx.shapes:
        for norm in ("pre", "post"):
            cfg = stack_config(shape, norm, dtype=ctx.dtype)
            params = init_params(cfg, shape)
            x, valid = make_inputs(shape)
            config = {**shape.as_dict(), "norm": norm, "dtype": ctx.dtype, "threads": ctx.threads}
            ctx.log(f"train {shape.label} {norm}: compiling")
            ours = OursTrain(cfg, params, x, valid)
            fns: dict[str, Any] = {"ours": ours}
            notes: dict[str, str] = {}
            if ctx.torch_device:
                fns["torch eager"] = TorchTrain(torch_module(cfg, params), x, device=ctx.torch_device,
                                                autocast=ctx.torch_autocast())
                if ctx.torch_compile:
                    try:
                        tc = TorchTrain(torch_module(cfg, params), x, compiled=True, device=ctx.torch_device,
                                        autocast=ctx.torch_autocast())
                        start = time.perf_counter()
                        tc()  # compiles forward and backward graphs
                        notes["torch compile"] = f"compiled in {time.perf_counter() - start:.1f} s"
                        fns["torch compile"] = tc
                    except Exception as err:  # torch.compile needs a working C++ toolchain; say why not
                        notes["ours"] = f"torch.compile unavailable: {type(err).__name__}: {str(err)[:120]}"
            else:
                notes["ours"] = "no PyTorch build for this device: ours only"
            if "torch eager" in fns:  # same weights, same batch: the first steps' losses agree
                ours()
                fns["torch eager"]()
                a, b = float(ours.loss), float(fns["torch eager"].loss)
                notes["first_loss"] = f"{a:.6g} vs {b:.6g}"
                first_loss_diff = abs(a - b) / max(abs(b), 1e-12)
            if ctx.dtype in ctx.probe:
                fns[PROBE] = ctx.probe[ctx.dtype][1]
            times = time_interleaved(fns, reps=ctx.reps, warmup=ctx.warmup)
            flops = train_flops(cfg, shape.n, shape.length)
            med = {k: float(np.median(v)) for k, v in times.items()}
            peak_now = ctx.probe[ctx.dtype][0] / med.pop(PROBE) if PROBE in med else None
            for name, ts in times.items():
                if name == PROBE:
                    records.append(Record.from_times("train", f"{PROBE} beside {norm}-LN {shape.label}", config, ts,
                                                     gflop_per_s=(peak_now or 0.0) / 1e9))
                    continue
                m: dict[str, Any] = {"tokens_per_s": shape.n * shape.length / med[name],
                                     "gflop_per_s": flops / med[name] / 1e9, "flops": flops,
                                     **ctx.fraction(flops / med[name], peak_now)}
                if name == "ours":
                    m |= _impl(cfg, ours.compiled, train=True, length=shape.length)
                    if "first_loss" in notes:
                        m["first_loss_vs_torch"] = notes.pop("first_loss")
                        m["first_loss_rel_diff"] = first_loss_diff
                    for other in ("torch eager", "torch compile"):
                        if other in med:
                            m["ratio" if other == "torch eager" else "ratio_vs_torch_compile"] = med[other] / med[name]
                if name in notes:
                    m["note"] = notes[name]
                if isinstance(fns[name], TorchTrain):
                    m["optimizer"] = fns[name].optimizer
                records.append(Record.from_times("train", f"{name} {norm}-LN {shape.label}", config, ts, **m))
    return records


def infer(ctx: Context, padding: float = 0.25) -> list[Record]:
    records = needs_peak(ctx)
    for shape in ctx.shapes:
        for norm in ("pre", "post"):
            cfg = stack_config(shape, norm, dtype=ctx.dtype)
            params = init_params(cfg, shape)
            x, valid = make_inputs(shape, padding=padding)
            real = int(valid.sum())
            config = {**shape.as_dict(), "norm": norm, "dtype": ctx.dtype, "padding": padding,
                      "threads": ctx.threads}
            ctx.log(f"infer {shape.label} {norm}: compiling")
            ours = OursInfer(cfg, params, x, valid)
            fns: dict[str, Any] = {"ours": ours}
            extra: dict[str, dict[str, Any]] = {"ours": _impl(cfg, ours.compiled, train=False, length=shape.length)}
            if ctx.torch_device:
                theirs = TorchInfer(torch_module(cfg, params, nested=True), x, valid, device=ctx.torch_device,
                                    autocast=ctx.torch_autocast())
                theirs()
                fns["torch fast path"] = theirs
                extra["torch fast path"] = {"note": theirs.nested[1]}
                extra["ours"]["max_abs_diff_vs_torch"] = max_abs_diff(ours.out, theirs.out, valid)
            if ctx.dtype in ctx.probe:
                fns[PROBE] = ctx.probe[ctx.dtype][1]
            times = time_interleaved(fns, reps=ctx.reps, warmup=ctx.warmup)
            flops = forward_flops(cfg, shape.n, shape.length)  # what the dense (padded) kernels execute
            med = {k: float(np.median(v)) for k, v in times.items()}
            peak_now = ctx.probe[ctx.dtype][0] / med.pop(PROBE) if PROBE in med else None
            times.pop(PROBE, None)
            for name, ts in times.items():
                m = {"tokens_per_s": real / med[name], **extra[name]}
                if name == "ours":
                    m |= {"gflop_per_s": flops / med[name] / 1e9, **ctx.fraction(flops / med[name], peak_now)}
                    if "torch fast path" in med:
                        m["ratio"] = med["torch fast path"] / med[name]
                records.append(Record.from_times("infer", f"{name} {norm}-LN {shape.label}", config, ts, **m))
    return records
