"""A task's metrics over a whole split, in inference mode: what the loop's validation and test, the
`evaluate` command and `TrainedRun.evaluate` all run (no dropout, no gradients).

It needs a task, a runner, a state and a batch source, nothing of the training loop, so loading a trained
run for evaluation does not import the loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from train.data.batches import BatchSource
from train.devices.runners import Runner
from train.loop.state import TrainState
from train.tasks import Task


def host_number(value: Any) -> float:
    """The first element of a fetched (possibly per-device) array, as a Python float."""
    return float(np.asarray(value).reshape(-1)[0])


def evaluate(task: Task, runner: Runner, state: TrainState, batches: BatchSource, split: str,
             sync_every: int = 32) -> dict[str, float]:
    """The task's metrics over the whole split, plus the count of what they average over (e.g. "examples")."""
    totals: dict[str, float] = {}
    pending: list[Any] = []

    def drain() -> None:
        for sums in runner.fetch(pending):
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + host_number(value)
        pending.clear()

    for batch in batches.eval_batches(split):
        pending.append(runner.eval_step(state, batch))
        if len(pending) >= sync_every:
            drain()
    drain()
    return {**{k: float(v) for k, v in task.metrics(totals).items()}, task.count_name: totals.get("count", 0.0)}
