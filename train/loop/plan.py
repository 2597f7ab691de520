"""What the loop receives: a validated run (train/run.py `plan_run` builds it; nothing is written yet)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train import init_from
from train.config import Config
from train.data.batches import BatchSource
from train.devices.runners import Runner
from train.loop.state import TrainState
from train.tasks import Task, TaskData


@dataclass
class Plan:
    """Everything validated for a run; nothing has been written yet."""

    config: Config  # resolved: model.vocab_size, model.num_classes, checkpoint.best_metric come from data/task
    workdir: Path
    dataset: TaskData  # what the task's load_data returned (train/tasks/)
    start_step: int  # the checkpoint to resume from; 0 for a fresh run
    task: Task
    batches: BatchSource
    runner: Runner
    abstract: TrainState  # shapes and dtypes only (jax.eval_shape), for the runner and restore targets
    make_state: Callable[[], TrainState]  # the fresh state (seeded init), traceable
    init: init_from.Source | None = None  # model.init_from: its encoder weights are grafted into a fresh state
    record: dict[str, Any] = field(default_factory=dict)  # the task's entries for run.json (e.g. a baseline)

    def initial_state(self) -> TrainState:
        """The fresh state, built where the runner keeps it (sharded from the start under `sharded`),
        with the pretrained encoder of model.init_from in place of the seeded one."""
        state = self.runner.init_state(self.make_state)
        if self.init is None or self.init.encoder is None:
            return state
        state = self.runner.unreplicate(state)  # pmap: drop the device axis; the runner places it again
        return self.runner.place_state(state.replace(params=init_from.graft(state.params, self.init.encoder)))

    def data_summary(self) -> str:
        """One line for the run log: the data, and the task's own entries (e.g. its baseline)."""
        extra = "".join(f"; {key.replace('_', ' ')} {value:.4f}" if isinstance(value, float) else f"; {key} {value}"
                        for key, value in self.record.items())
        return self.dataset.summary() + extra
