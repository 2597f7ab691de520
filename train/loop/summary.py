"""The summary of a session: what it did, its best validation (ranked as keep-best ranks checkpoints),
its final validation and test; the run writes it to summary.json (train/run.py).

Keys: steps, session_steps, seconds, workdir; after validations `best_metric` (e.g. "val_accuracy"),
`best_val_step` and `best_val_<metric>` for each of the task's metrics at that step; a finished run adds
`final_val_<metric>`, `test_<metric>` and `test_checkpoint_step`; a run stopped by a signal adds
`preempted`, `step` and `checkpoint` instead.
"""

from __future__ import annotations

from typing import Any


def best_validation(records: list[dict[str, Any]], metric: str, higher: bool) -> dict[str, Any] | None:
    """The best "val" record by `metric`; of equally good ones the newest, as Orbax's keep-best ranking."""
    vals = [r for r in records if r.get("split") == "val" and isinstance(r.get(metric), int | float)]
    if not vals:
        return None
    return max(vals, key=lambda r: (r[metric] if higher else -r[metric], r["step"]))


def best_fields(best: dict[str, Any] | None, metric: str, metrics: list[str]) -> dict[str, Any]:
    """The summary's best_* entries for the best validation record (none without one)."""
    if best is None:
        return {}
    return {"best_metric": f"val_{metric}", "best_val_step": best["step"],
            **{f"best_val_{m}": best[m] for m in metrics if m in best}}


def prefixed(prefix: str, values: dict[str, float], metrics: list[str]) -> dict[str, float]:
    return {f"{prefix}{m}": values[m] for m in metrics if m in values}
