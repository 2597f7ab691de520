"""The registry of tasks: the `task:` config value -> the module of train/tasks/ that defines it.

Each module here (besides `base`) defines one task class and names it `TASK`; the class has a `name`
(its `task:` value) and `from_config(config)`. Adding an objective is adding a module: the registry finds
it, and the config, the run, the loop, evaluation and inference reach it only through `task_for`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from train.config import Config, ConfigError
from train.tasks.base import Task, TaskData, check_ranking, metric_names, ranking, ratio, with_ranking
from train.tasks.classification import CLASSIFICATION, ClassificationTask, classification_sums
from train.tasks.mlm import MaskedLMTask

__all__ = [
    "CLASSIFICATION", "ClassificationTask", "MaskedLMTask", "Task", "TaskData", "classification_sums",
    "metric_names", "ranking", "ratio", "registry", "task_for", "with_ranking",
]


@functools.cache
def registry() -> dict[str, Any]:
    """{task name: task class} over every module of this package that defines `TASK`."""
    found: dict[str, Any] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base":
            continue
        cls = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TASK", None)
        if cls is not None:
            found[cls.name] = cls
    return found


def task_for(config: Config) -> Task:
    """The task a train/config.py Config names (`task`, and its own section such as `mlm.*`), checked
    against the config: ConfigError (one line) for an unknown task, a setting it cannot run with, or a
    checkpoint.best_metric that is not one of its metrics."""
    tasks = registry()
    if config.task not in tasks:
        raise ConfigError(f"task={config.task} is not a task: set task to one of {', '.join(sorted(tasks))}")
    task: Task = tasks[config.task].from_config(config)
    task.check_config(config)
    check_ranking(task, config)
    return task
