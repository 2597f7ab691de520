"""What the diagnostics return: small dataclasses with a readable `str`.

Checks have `passed`; measurements also have `as_metrics() -> dict[str, float]` (keys by layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxblock.diagnostics.reference import f64, fmt_list


@dataclass
class ResidualRatios:
    """||branch|| / ||residual input|| per layer over real tokens: Pre-LN ||branch(LN(x))||/||x||,
    Post-LN ||branch(x)||/||x||. A jump to tens of times signals a learning rate, init or numerics problem."""

    placement: str
    attn: list[float]
    ffn: list[float]
    limit: float
    passed: bool
    name: str = "residual_ratios"

    def as_metrics(self) -> dict[str, float]:
        out = {f"residual_ratio/attn/layer_{i}": r for i, r in enumerate(self.attn)}
        return out | {f"residual_ratio/ffn/layer_{i}": r for i, r in enumerate(self.ffn)}

    def summary(self) -> str:
        worst = max(self.attn + self.ffn, default=0.0)
        verdict = "ok" if self.passed else "above the limit: lower the learning rate or check the init"
        return f"largest ratio {worst:.3g} (limit {self.limit:g}): {verdict}"

    def __str__(self) -> str:
        return f"residual ratios ({self.placement}-LN)\n  attn: {fmt_list(self.attn)}\n  ffn:  {fmt_list(self.ffn)}"


@dataclass
class GradNorms:
    """Gradient norms by depth: at each layer's input, of each layer's parameters, and of each
    layer's FFN output kernel (ffn/linear2/kernel)."""

    loss: float
    input_grad: list[float]
    param_grad: list[float]
    ffn_out_kernel_grad: list[float]
    passed: bool
    name: str = "grad_norms_by_depth"

    def as_metrics(self) -> dict[str, float]:
        out = {f"grad_norm/input/layer_{i}": g for i, g in enumerate(self.input_grad)}
        return out | {f"grad_norm/params/layer_{i}": g for i, g in enumerate(self.param_grad)}

    def summary(self) -> str:
        if not self.passed:
            return "a gradient is non-finite: run first_nonfinite on the batch"
        ratio = self.input_grad[0] / max(self.input_grad[-1], 1e-30) if self.input_grad else 1.0
        return f"loss {self.loss:.4g}; input-gradient norm first/last layer = {ratio:.3g}"

    def __str__(self) -> str:
        return (
            f"gradient norms by depth (loss {self.loss:.4g})\n  at layer input: {fmt_list(self.input_grad)}\n"
            f"  layer params:   {fmt_list(self.param_grad)}\n  ffn/linear2:    {fmt_list(self.ffn_out_kernel_grad)}"
        )


@dataclass
class Stats:
    min: float
    max: float
    mean: float
    absmax: float
    nonfinite: int

    @classmethod
    def of(cls, x: Any) -> Stats:
        a = f64(x)
        fin = a[np.isfinite(a)]
        if not fin.size:
            return cls(np.nan, np.nan, np.nan, np.nan, int(a.size))
        return cls(float(fin.min()), float(fin.max()), float(fin.mean()), float(np.abs(fin).max()),
                   int(a.size - fin.size))

    def __str__(self) -> str:
        return (f"min {self.min:.4g}, max {self.max:.4g}, mean {self.mean:.4g}, absmax {self.absmax:.4g}, "
                f"non-finite {self.nonfinite}")


@dataclass
class NonFinite:
    """Where the forward pass first produced a non-finite value, and its input's statistics."""

    passed: bool
    layer: int | None = None
    sublayer: str | None = None  # attention | FFN | norm | residual add | embedding | output
    site: str | None = None
    count: int = 0
    input_stats: Stats | None = None
    name: str = "first_nonfinite"

    def summary(self) -> str:
        if self.passed:
            return "every recorded value is finite"
        where = f"layer {self.layer} " if self.layer is not None else ""
        return f"first non-finite value in {where}{self.sublayer} ({self.site}, {self.count} values)"

    def __str__(self) -> str:
        return self.summary() + (f"; its input: {self.input_stats}" if self.input_stats else "")


@dataclass
class CheckResult:
    """A check made of named parts, each with its measured error and tolerance."""

    name: str
    passed: bool
    parts: list[tuple[str, bool, str]] = field(default_factory=list)

    @classmethod
    def of(cls, name: str, parts: list[tuple[str, bool, str]]) -> CheckResult:
        return cls(name, all(ok for _, ok, _ in parts), parts)

    def summary(self) -> str:
        failed = [f"{n}: {d}" for n, ok, d in self.parts if not ok]
        return "; ".join(failed) if failed else f"{len(self.parts)} parts pass"

    def __str__(self) -> str:
        lines = [f"{self.name}: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  [{'ok' if ok else 'FAIL'}] {n}: {d}" for n, ok, d in self.parts]
        return "\n".join(lines)


@dataclass
class Diagnosis:
    """Every check and measurement on one model, variables and batch."""

    ratios: ResidualRatios
    grads: GradNorms
    nonfinite: NonFinite
    checks: list[CheckResult]

    @property
    def results(self) -> list[Any]:
        return [self.nonfinite, *self.checks, self.ratios, self.grads]

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if not r.passed]
