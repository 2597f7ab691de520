"""The debugging path as functions: residual ratios, gradient norms by depth, the first non-finite
sublayer, padding invariance, sublayer ablation, structure, train/eval determinism.

Shapes: N batch, L length, D width, B blocks. Mask convention: `valid_tokens: bool[N, L]`, True = real.

Every function takes a model, its variables and a batch, never a config, so a variant model class
can be examined as easily as the library's own:

- Classifier / Encoder: `batch["tokens"]` int32[N, L]; EncoderStack or any stack-like module:
  `batch["x"]` float[N, L, D]. Both with `batch["valid_tokens"]` bool[N, L].
- The model has a `config` (EncoderConfig / StackConfig) whose placement selects the wiring the
  blocks must follow (jaxblock.wiring). Its blocks are the `EncoderBlock` modules (subclasses
  included) it calls, found by module structure (tracing.py); the stack is their parent module.
- A scanned or rematerialized stack is examined through its unrolled twin (same parameters,
  unstacked): the mathematics is identical and every layer's values become visible.
- `variables` may be boxed (LogicallyPartitioned) or plain; `{"params": ...}` or the params alone.
- A `loss_fn(outputs, batch)` returns a scalar or `(scalar, aux)`.

Modules: tracing (running a model with block boundaries visible), reference (float64 NumPy norms
and error measures), report (result dataclasses), measures and checks.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from jaxblock.diagnostics.checks import (
    padding_invariance,
    structure,
    sublayer_ablation,
    train_eval_determinism,
)
from jaxblock.diagnostics.measures import Batch, LossFn, first_nonfinite, grad_norms_by_depth, residual_ratios
from jaxblock.diagnostics.report import CheckResult, Diagnosis, GradNorms, NonFinite, ResidualRatios, Stats
from jaxblock.diagnostics.tracing import Trace, block_paths, prepare, trace


def run_all(model: nn.Module, variables: Any, batch: Batch, loss_fn: LossFn, *,
            residual_ratio_limit: float = 10.0) -> Diagnosis:
    """Every check on one model: the whole debugging path in one call."""
    checks = [fn(model, variables, batch) for fn in
              (padding_invariance, sublayer_ablation, structure, train_eval_determinism)]
    return Diagnosis(
        residual_ratios(model, variables, batch, limit=residual_ratio_limit),
        grad_norms_by_depth(model, variables, batch, loss_fn),
        first_nonfinite(model, variables, batch),
        checks,
    )


__all__ = [
    "Batch",
    "CheckResult",
    "Diagnosis",
    "GradNorms",
    "LossFn",
    "NonFinite",
    "ResidualRatios",
    "Stats",
    "Trace",
    "block_paths",
    "first_nonfinite",
    "grad_norms_by_depth",
    "padding_invariance",
    "prepare",
    "residual_ratios",
    "run_all",
    "structure",
    "sublayer_ablation",
    "trace",
    "train_eval_determinism",
]
