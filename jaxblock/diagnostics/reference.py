"""Float64 NumPy re-implementations the checks compare against: the norms and error measures.

Tokens are [T, D]: the real tokens of an [N, L, D] value, selected by `valid_tokens` (True = real).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def f64(x: Any) -> np.ndarray:
    return np.asarray(x, np.float64)


def real(x: Any, valid: Any) -> np.ndarray:
    """[N, L, D] -> [T, D]: the real tokens only."""
    return f64(x)[np.asarray(valid, bool)]


def norm(x: np.ndarray, params: Mapping[str, Any], cfg: Any) -> np.ndarray:
    """The block's norm (cfg.norm_type, cfg.norm_eps) recomputed in float64 with one instance's params."""
    if cfg.norm_type == "rmsnorm":
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps)
    else:
        c = x - np.mean(x, -1, keepdims=True)
        y = c / np.sqrt(np.mean(c * c, -1, keepdims=True) + cfg.norm_eps)
    y = y * f64(params["scale"])[None, :]
    return y + f64(params["bias"])[None, :] if "bias" in params else y


def unnormalized_error(y: np.ndarray, params: Mapping[str, Any] | None, cfg: Any) -> float:
    """How far tokens [T, D] are from a norm's output: undo its affine, then |mean| and |rms - 1|."""
    if params is not None:
        scale = f64(params["scale"])
        keep = np.abs(scale) > 1e-3  # a feature scaled to ~0 carries no information about the statistics
        bias = f64(params["bias"]) if "bias" in params else np.zeros_like(scale)
        y = (y - bias[None, :]) / np.where(keep, scale, 1.0)[None, :]
        y = y[:, keep]
    rms = np.sqrt(np.mean(y * y, -1))
    err = np.abs(rms - 1.0)
    if cfg.norm_type != "rmsnorm":
        err = np.maximum(err, np.abs(np.mean(y, -1)))
    return float(np.max(err)) if err.size else 0.0


def rel_err(a: Any, b: Any) -> float:
    """max |a - b| / (1 + max |b|)."""
    a, b = f64(a), f64(b)
    return float(np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b))))


def fmt_list(xs: Sequence[float]) -> str:
    return " ".join(f"{x:.3g}" for x in xs)
