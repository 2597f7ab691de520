"""A run's workdir: plan it (validate everything, write nothing), prepare it (write the run's files), train.

`plan_run` reads the config, the data, the workdir and any checkpoint in it, and raises a one-line error
(ConfigError, DataError, CheckpointError, WorkdirError: exit code 2) before anything is written, so a bad
command never touches an existing run. It builds the three objects the loop receives: the task (what is
trained, train/tasks/), the batch source (where batches come from, made by the task) and the runner (where
the step runs). `train` then writes the run's files (`prepare`), hands the plan to the loop
(train/loop/trainer.py) and writes the summary the loop returns (summary.json, curves.png).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import yaml

from train import init_from
from train.checkpoints.store import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    CheckpointError,
    DamagedCheckpointError,
    check_compatible,
    latest_step,
    migrate_run_config,
    read_run_config,
)
from train.config import STREAMED_SOURCES, Config, ConfigError, apply_overrides, config_from_dict, load_config
from train.data.batches import BatchSource
from train.devices.hosts import initialize_distributed, is_primary
from train.devices.runners import make_runner
from train.errors import WorkdirError
from train.interrupts import Interrupts
from train.loop.plan import Plan
from train.loop.state import TrainState, abstract_init, create_state, init_params
from train.loop.trainer import Trainer
from train.tasks import Task, metric_names, task_for, with_ranking
from train.workdir.curves import plot_curves
from train.workdir.files import atomic_write
from train.workdir.lock import WorkdirLock
from train.workdir.session_record import run_metadata

__all__ = ["Plan", "WorkdirError", "plan_run", "prepare", "train"]

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
HISTORY_DIR = "config.history"  # the config of every session: from-step-<S>.yaml produced steps S+1...
# Files a workdir may hold before it holds a run (the lock of a run that failed to plan).
_NOT_A_RUN = {".lock"}


def check_workdir(workdir: Path) -> None:
    """A directory we may write: new (creatable), empty, or holding a run."""
    if workdir.exists():
        if not workdir.is_dir():
            raise WorkdirError(f"workdir {workdir} is a file: pass a directory path for --workdir")
        if not os.access(workdir, os.W_OK | os.X_OK):
            raise WorkdirError(f"workdir {workdir} is not writable: fix its permissions or pass another --workdir")
        if any(p.name not in _NOT_A_RUN for p in workdir.iterdir()) and not (workdir / CONFIG_FILE).is_file():
            raise WorkdirError(f"workdir {workdir} is not empty and holds no run: pass a new or empty directory")
        return
    parent = workdir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise WorkdirError(f"cannot create workdir {workdir} ({parent} is not writable): pass another --workdir")


def plan_run(config: Config, workdir: Path, task: Task | None = None) -> Plan:
    """Validate config, data, workdir and checkpoint compatibility; build the task's runner and batches.
    `task` replaces the one the config names (e.g. a test's variant of it)."""
    workdir = Path(workdir)
    initialize_distributed(config.parallel)  # multi-host: the one call, before anything touches a device
    check_workdir(workdir)
    named = task_for(config)
    task = task if task is not None else named
    start = latest_step(workdir) or 0
    config, source = _init_source(config, workdir, start)
    if config.data.source not in ("synthetic", "file", "corpus") and jax.process_index() == 0:
        print(f"loading data: {config.data.source} (the first run fetches and checks it, ~10 s)",
              file=sys.stderr, flush=True)
    dataset = task.load_data(config, tokenizer_dir=workdir / TOKENIZER_DIR,
                             tokenizer=source.tokenizer if source is not None else None)
    config = with_ranking(task.resolve(config, dataset), task)
    if source is not None:
        config = init_from.check_vocab(config, source, dataset.tokenizer)
    if start > config.train.steps:
        raise CheckpointError(f"{workdir} is at step {start}, past train.steps={config.train.steps}: raise "
                              "train.steps or use a new --workdir")
    model = task.build_model(config.model)
    cfg = config
    params, specs = abstract_init(model, cfg.data.buckets[-1])
    abstract = jax.eval_shape(lambda p: create_state(model, p, cfg.optim, cfg.train.steps), params)

    def make_state() -> TrainState:
        return create_state(model, init_params(model, cfg.train.seed, cfg.data.buckets[-1]), cfg.optim,
                            cfg.train.steps)

    if start:
        # A damaged newest checkpoint is not fatal: the loop's restore falls back to the newest that reads.
        with contextlib.suppress(DamagedCheckpointError):
            check_compatible(workdir, start, abstract.params)
    if source is not None and source.encoder is not None:
        source.encoder = init_from.conform(source.encoder, config.model, abstract.params["encoder"], source.spec)
    runner = make_runner(config, abstract, task=task, specs=specs)
    batches = task.make_batches(dataset, config, runner.data_share())
    return Plan(config, workdir, dataset, start, task, batches, runner, abstract, make_state, source,
                record=task.run_record(dataset, batches))


def _init_source(config: Config, workdir: Path, start: int) -> tuple[Config, init_from.Source | None]:
    """model.init_from: the checkpoint (read now for a fresh run; a resumed run's own config stands for it)
    and the config with its shape. A run keeps the init_from it started with."""
    spec = config.model.init_from
    started_from = read_run_config(workdir).model.init_from if (workdir / CONFIG_FILE).is_file() else None
    if start and spec != started_from and (spec or not started_from):
        began = f"from model.init_from={started_from}" if started_from else "from scratch"
        raise ConfigError(f"{workdir} holds a run started {began}, not from model.init_from={spec}: keep the run's "
                          "own setting to resume it, or use a new --workdir")
    spec = spec or (started_from if start else None)
    if not spec:
        return config, None
    source = init_from.load_source(spec, workdir, resuming=bool(start))
    return init_from.adopt(config, source), source


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """'optim.lr: 0.003 -> 0.001' for each key whose value differs between two config dicts."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def prepare(plan: Plan) -> str | None:
    """Write the resolved config (and a copy in config.history/), the tokenizer and a session record in
    run.json (primary process only; the caller holds the workdir lock). Returns one line naming the
    settings that differ from the config the run was saved with, if any."""
    plan.workdir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(plan.config.model_dump(mode="json"), sort_keys=False)
    changed: list[str] = []
    if plan.start_step and (plan.workdir / CONFIG_FILE).is_file():
        saved = migrate_run_config(yaml.safe_load((plan.workdir / CONFIG_FILE).read_text()) or {})
        with contextlib.suppress(ConfigError):  # keys added since the run was saved read as their defaults
            saved = config_from_dict(saved).model_dump(mode="json")
        changed = config_changes(saved, plan.config.model_dump(mode="json"))
    history = plan.workdir / HISTORY_DIR
    history.mkdir(exist_ok=True)
    atomic_write(history / f"from-step-{plan.start_step}.yaml", text)
    atomic_write(plan.workdir / CONFIG_FILE, text)
    if not (plan.workdir / TOKENIZER_DIR).is_dir():
        plan.dataset.tokenizer.save(plan.workdir / TOKENIZER_DIR)
    path = plan.workdir / RUN_FILE
    record = json.loads(path.read_text()) if path.is_file() else {"sessions": []}
    if plan.init is not None and plan.init.encoder is not None and plan.start_step == 0:
        init_from.copy_files(plan.init, plan.workdir)
        record["init_from"] = plan.init.record
    record["label_names"] = plan.dataset.label_names
    record["truncated"] = plan.dataset.truncated
    record.update(plan.record)  # the task's own entries, e.g. the baseline its main metric must beat
    session = run_metadata(plan.start_step)
    session.update(config=f"{HISTORY_DIR}/from-step-{plan.start_step}.yaml", changed=changed,
                   attention=attention_record(plan))
    record["sessions"].append(session)
    atomic_write(path, json.dumps(record, indent=2) + "\n")
    if not changed:
        return None
    # No step here: the trainer may still fall back past a damaged newest checkpoint, and its own line
    # names the step it resumes from.
    return f"settings changed since the last session: {'; '.join(changed)} (earlier configs kept in {HISTORY_DIR}/)"


def attention_record(plan: Plan) -> dict[str, Any]:
    """What each layer's attention runs in this session: the platform, and for the train and eval calls
    the kernel the dispatch chooses per layer with its reason (jaxblock/attention/dispatch.py
    `layer_kernels`), chosen under the runner's mesh. A choice may depend on the length (the chunked kernel
    on a CPU, a context axis), so each call lists groups of the lengths its batches take with the same
    choices, and the kernels outside attention (jaxblock/kernels/): {"platform": "cpu", "dropout_mask": {"kernel":
    ..., "reason": ...}, "projection": {...}, "layer_norm": {...}, "recompute": {...},
    "train": [{"lengths": [64], "layers": [{"layer": 0, "kernel": ..., "reason": ...}, ...]}], "eval": [...]}."""
    from jaxblock.attention.dispatch import layer_kernels
    from jaxblock.attention.platform import target_platform

    cfg = plan.config
    streamed = cfg.data.source in STREAMED_SOURCES
    context = int(getattr(plan.runner, "context", 1))
    calls = {  # call -> (the lengths its batches take, whether its rows are packed)
        "train": ([cfg.data.buckets[-1]], True) if cfg.data.packing or streamed else (cfg.data.buckets, False),
        "eval": (cfg.data.buckets, streamed),
    }
    from jaxblock.kernels import layer_norm, projection, recompute
    from jaxblock.kernels.dropout import mask_kernel

    gradients = cfg.model.block.gradients
    record: dict[str, Any] = {"platform": target_platform()}
    for name, (kernel, reason) in (("dropout_mask", mask_kernel()), ("projection", projection.kernel(gradients)),
                                   ("layer_norm", layer_norm.kernel(gradients)),
                                   ("recompute", recompute.kernel(gradients))):
        record[name] = {"kernel": kernel, "reason": reason}
    kernel_context = getattr(plan.runner, "kernel_context", contextlib.nullcontext)
    with kernel_context():
        for call, (lengths, packed) in calls.items():
            groups: list[dict[str, Any]] = []
            for length in sorted(set(lengths)):
                padded = -(-length // context) * context
                layers = [{"layer": i, "kernel": kernel, "reason": reason} for i, (kernel, reason) in enumerate(
                    layer_kernels(cfg.model, train=call == "train", length=padded, segments=packed))]
                if groups and groups[-1]["layers"] == layers:
                    groups[-1]["lengths"].append(padded)
                else:
                    groups.append({"lengths": [padded], "layers": layers})
            record[call] = groups
    return record


def train(config: Config, workdir: Path, *, batches: Callable[[BatchSource], BatchSource] | None = None,
          interrupts: Interrupts | None = None) -> dict[str, Any]:
    """Lock the workdir, plan (validate), then train; returns the summary (with "preempted": True after a
    signal).

    The workdir lock (train.workdir.lock) is held for the whole run by process 0; a workdir holding a run is
    locked before its run is read, a new one as soon as the plan is valid (so bad input creates nothing).
    `batches` may wrap the planned batch source (e.g. to inject faults in tests). `interrupts` is the CLI's
    signal policy; without one, SIGINT/SIGTERM are handled for the duration of the call. Raises the
    one-line errors of `plan_run`, WorkdirBusyError, DiskFullError, or HaltError (train/errors.py).
    """
    workdir = Path(workdir)
    initialize_distributed(config.parallel)
    lock = WorkdirLock(workdir, command=" ".join(["train", *sys.argv[1:]]), primary=jax.process_index() == 0)
    own = interrupts is None
    policy = interrupts if interrupts is not None else Interrupts(install=jax.process_count() == 1)
    try:
        if own:
            policy.__enter__()
        if (workdir / CONFIG_FILE).is_file():  # a run: nothing of it is read unlocked
            lock.acquire()
        policy.set_phase("start-up")
        plan = plan_run(config, workdir)
        lock.acquire()
        if batches is not None:
            plan.batches = batches(plan.batches)
        changed = prepare(plan) if is_primary() else None
        summary = Trainer(plan, policy).train(notes=[changed] if changed else [])
        if is_primary():
            write_summary(plan, summary, policy)
        return summary
    finally:
        lock.release()
        if own:
            policy.__exit__(None, None, None)


def config_for_workdir(config_path: str | None, overrides: list[str], workdir: Path) -> Config:
    """The config to run: --config (+ overrides), or the run's own resolved config (+ overrides)."""
    if config_path is not None:
        return init_from.drop_file_shape(load_config(config_path, overrides), overrides)
    if not (Path(workdir) / CONFIG_FILE).is_file():
        raise ConfigError(f"no --config given and {workdir} holds no run: pass --config configs/tiny.yaml (or another)")
    saved = read_run_config(workdir).model_dump(mode="json")
    return init_from.drop_file_shape(config_from_dict(apply_overrides(saved, overrides)), overrides)


def write_summary(plan: Plan, summary: dict[str, Any], interrupts: Interrupts) -> None:
    """summary.json and curves.png (the task's main metric and loss by step) for the session just ended."""
    with interrupts.critical("writing summary.json and curves.png"):
        atomic_write(plan.workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        plot_curves(plan.workdir, metric_names(plan.task)[:2])


def summary_line(summary: dict[str, Any]) -> str:
    """The one line the CLI prints for a finished run: its best validation by the ranking metric, and the
    test metrics of the checkpoint the test ran on (the best one when the run keeps the best)."""
    ranked = str(summary.get("best_metric", "val_accuracy")).removeprefix("val_")
    best = summary.get(f"best_val_{ranked}", float("nan"))
    tests = ", ".join(f"{key.removeprefix('test_').replace('_', ' ')} {value:.4f}" for key, value in summary.items()
                      if key.startswith("test_") and key != "test_checkpoint_step")
    return (f"done: {summary['steps']} steps ({summary['session_steps']} this session, {summary['seconds']:.0f}s); "
            f"best validation {ranked.replace('_', ' ')} {best:.4f} at step {summary.get('best_val_step')}; "
            f"test {tests} (checkpoint {summary['test_checkpoint_step']}); workdir {summary['workdir']}")
