"""What a benchmark run knows about itself: mode, repetitions, hardware, and the shapes it measures."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.workloads import Shape

# The two CPU shapes (targets: ours >= 1.5x PyTorch eager, >= 55% of the matmul peak at D=512).
CPU_SHAPES = (Shape(16, 128, 256, 4, 1024, 4), Shape(8, 256, 512, 8, 2048, 4))
# The GPU block: D=2048, L=2048 (target: bf16 MFU >= 60%).
GPU_SHAPES = (Shape(8, 2048, 2048, 16, 8192, 4),)
# Seconds, not minutes: shapes small enough for the smoke test.
QUICK_SHAPES = (Shape(2, 16, 32, 2, 64, 1),)


@dataclass
class Context:
    """Run-wide settings. `peak` holds the measured matmul peak (FLOP/s) per dtype once `peak` ran."""

    quick: bool
    reps: int
    warmup: int
    threads: int
    backend: str
    dtype: str
    torch_device: str | None
    torch_compile: bool
    spec_peak_flops: float | None = None
    peak: dict[str, float] = field(default_factory=dict)
    # dtype -> (FLOPs, call) of the matmul that set the peak: timed again beside each training step, so
    # the step and its peak see the same load from other processes.
    probe: dict[str, tuple[int, Callable[[], None]]] = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)

    @property
    def gpu(self) -> bool:
        """An accelerator run (GPU or TPU): bf16 and the accelerator shapes."""
        return self.backend in ("gpu", "tpu")

    @property
    def shapes(self) -> tuple[Shape, ...]:
        if self.quick:
            return QUICK_SHAPES
        return GPU_SHAPES if self.gpu else CPU_SHAPES

    @property
    def small(self) -> Shape:
        """The shape for the option and scaling sweeps (the first benchmark shape)."""
        return self.shapes[0]

    def torch_autocast(self) -> Any:
        """PyTorch's counterpart of our bf16 compute policy (float32 params, bf16 matmuls)."""
        if self.dtype != "bfloat16":
            return None
        import torch

        return torch.bfloat16

    def fraction(self, flop_per_s: float, peak: float | None = None) -> dict[str, float]:
        """Achieved FLOP/s as a fraction of the measured peak (`peak` if given: the probe timed in the same
        interleaved run; else the peak section's) and of the spec peak when given (MFU)."""
        out: dict[str, float] = {}
        peak = peak or self.peak.get(self.dtype)
        if peak:
            out["fraction_of_peak"] = flop_per_s / peak
        if self.spec_peak_flops:
            out["mfu"] = flop_per_s / self.spec_peak_flops
        return out


def cpu_has_bf16() -> bool:
    """bf16 matmul hardware on x86 (AVX512-BF16 or AMX); elsewhere assume emulation, so not measured."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def torch_device(gpu: bool) -> str | None:
    """Where PyTorch runs: the CPU; on a GPU run, CUDA if this torch build has it, else nowhere."""
    try:
        import torch
    except ImportError:
        return None
    if not gpu:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None
