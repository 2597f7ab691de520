"""The training log's window: per-step metrics summed between two log rows, averaged into one row.

A window is saved in every checkpoint (`state`) and restored with it, so the first row after a resume
averages the same steps as in an uninterrupted run. Non-finite steps count towards `steps` (the progress
bar) and tokens, not towards the averages.
"""

from __future__ import annotations

import time
from typing import Any

# Step metrics that are bookkeeping, not averaged into a log window.
COUNTERS = ("lr", "finite", "nonfinite_consecutive", "nonfinite_total", "tokens")


class LogWindow:
    def __init__(self, saved: dict[str, float] | None = None):
        self.sums: dict[str, float] = dict(saved or {})
        self.start = time.perf_counter()

    @staticmethod
    def averaged(metrics: dict[str, float]) -> list[str]:
        """The task's metrics (loss first), then grad_norm; fetched dicts come back with sorted keys."""
        return sorted((k for k in metrics if k not in COUNTERS), key=lambda k: (k != "loss", k == "grad_norm", k))

    def add(self, metrics: dict[str, float]) -> None:
        """One step's host metrics."""
        w = self.sums
        if metrics["finite"]:
            for key in self.averaged(metrics):
                w[key] = w.get(key, 0.0) + metrics[key]
            w["n"] = w.get("n", 0.0) + 1
        w["tokens"] = w.get("tokens", 0.0) + metrics["tokens"]
        w["steps"] = w.get("steps", 0.0) + 1

    def row(self, metrics: dict[str, float]) -> tuple[dict[str, Any], int]:
        """The log row of the window ending with the step of `metrics`, and the steps it covers; the
        window starts afresh."""
        w = self.sums
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        n = max(w.get("n", 0.0), 1.0)
        record = {**{k: w.get(k, float("nan")) / n for k in self.averaged(metrics)}, "lr": metrics["lr"],
                  "tokens_per_s": w["tokens"] / elapsed, "nonfinite_total": metrics["nonfinite_total"]}
        steps = int(w["steps"])
        self.sums, self.start = {}, time.perf_counter()
        return record, steps

    def state(self) -> dict[str, float]:
        return dict(self.sums)
