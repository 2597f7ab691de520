"""A run's workdir: plan it (validate everything, write nothing), prepare it (write the run's files), train.

`plan_run` reads the config, the data, the workdir and any checkpoint in it, and raises a one-line error
(ConfigError, DataError, CheckpointError, WorkdirError: exit code 2) before anything is written, so a bad
command never touches an existing run. It builds the three objects the loop receives: the task (what is
trained), the batch source (where batches come from) and the runner (where the step runs). `train` then
writes the run's files (`prepare`) and hands the plan to the loop (train/loop/trainer.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
    read_run_config,
)
from train.config import Config, ConfigError, apply_overrides, config_from_dict, load_config
from train.data import labelled as data
from train.data.batches import BatchSource, InMemoryBatches, StreamBatches
from train.devices.runners import Runner, initialize_distributed, make_runner
from train.interrupts import Interrupts
from train.loop.state import TrainState, abstract_init, create_state, init_params
from train.tasks import CLASSIFICATION, Task, task_for
from train.workdir.records import atomic_write, run_metadata

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
HISTORY_DIR = "config.history"  # the config of every session: from-step-<S>.yaml produced steps S+1...
# Files a workdir may hold before it holds a run (the lock of a run that failed to plan).
_NOT_A_RUN = {".lock"}


class WorkdirError(ValueError):
    """A workdir that cannot hold a run: one line naming the problem and the fix."""


@dataclass
class Plan:
    """Everything validated for a run; nothing has been written yet."""

    config: Config  # resolved: model.vocab_size and model.num_classes come from the data
    workdir: Path
    dataset: Any  # data.Dataset (classification) or train.data.pretrain.CorpusData (mlm)
    start_step: int  # the checkpoint to resume from; 0 for a fresh run
    task: Task
    batches: BatchSource
    runner: Runner
    abstract: TrainState  # shapes and dtypes only (jax.eval_shape), for the runner and restore targets
    make_state: Callable[[], TrainState]  # the fresh state (seeded init), traceable
    init: init_from.Source | None = None  # model.init_from: its encoder weights are grafted into a fresh state

    def initial_state(self) -> TrainState:
        """The fresh state, built where the runner keeps it (sharded from the start under `sharded`),
        with the pretrained encoder of model.init_from in place of the seeded one."""
        state = self.runner.init_state(self.make_state)
        if self.init is None or self.init.encoder is None:
            return state
        state = self.runner.unreplicate(state)  # pmap: drop the device axis; the runner places it again
        return self.runner.place_state(state.replace(params=init_from.graft(state.params, self.init.encoder)))


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


def resolve(config: Config, dataset: data.Dataset) -> Config:
    """The config with what the data decides: vocabulary size (tokenizer) and number of classes."""
    raw = config.model_dump(mode="json")
    raw["model"].update(vocab_size=dataset.tokenizer.vocab_size, num_classes=len(dataset.label_names))
    if raw["data"].get("path"):  # saved absolute: evaluate and resume work from any directory
        raw["data"]["path"] = str(Path(raw["data"]["path"]).expanduser().absolute())
    resolved = config_from_dict(raw)
    if resolved.data.packing and resolved.model.pooling != "mean":
        raise ConfigError(f"data.packing=true pools each packed example by its mean, but model.pooling="
                          f"'{resolved.model.pooling}': set data.packing=false (or model.pooling=mean)")
    if resolved.data.buckets[-1] > resolved.model.max_len:
        raise ConfigError(
            f"model.max_len={resolved.model.max_len} is shorter than the largest bucket {resolved.data.buckets[-1]} "
            f"in data.buckets: raise model.max_len to >= {resolved.data.buckets[-1]} or drop that bucket"
        )
    return resolved


def resolve_corpus(config: Config, corpus: Any) -> Config:
    """The config of an MLM run with what the corpus decides: the embedding rows the masking needs (the
    tokenizer's vocabulary, plus a mask row when the tokenizer has no spare id) and rows of data.max_len."""
    raw = config.model_dump(mode="json")
    raw["model"].update(vocab_size=corpus.masking.model_vocab_size)
    raw["data"].update(buckets=[config.data.max_len])
    resolved = config_from_dict(raw)
    if resolved.data.max_len > resolved.model.max_len:
        raise ConfigError(f"model.max_len={resolved.model.max_len} is shorter than the rows of data.max_len="
                          f"{resolved.data.max_len} tokens: raise model.max_len or lower data.max_len")
    if config.train.batch_size % config.data.stream_shards:
        raise ConfigError(f"train.batch_size={config.train.batch_size} does not divide among data.stream_shards="
                          f"{config.data.stream_shards}: make the batch a multiple of the shard count")
    return resolved


def plan_run(config: Config, workdir: Path, task: Task = CLASSIFICATION) -> Plan:
    """Validate config, data, workdir and checkpoint compatibility; build the task's runner and batches."""
    workdir = Path(workdir)
    initialize_distributed(config.parallel)  # multi-host: the one call, before anything touches a device
    check_workdir(workdir)
    start = latest_step(workdir) or 0
    config, source = _init_source(config, workdir, start)
    if config.data.source not in ("synthetic", "file", "corpus") and jax.process_index() == 0:
        print(f"loading data: {config.data.source} (the first run fetches and checks it, ~10 s)",
              file=sys.stderr, flush=True)
    tokenizer_dir = workdir / TOKENIZER_DIR
    if config.task == "mlm":
        from train.data.pretrain import load_corpus

        if source is not None:
            raise ConfigError("model.init_from starts a fine-tuning run; a task=mlm run pretrains from scratch: "
                              "drop model.init_from")
        task = task_for(config) if task is CLASSIFICATION else task
        dataset: Any = load_corpus(config, tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None)
        config = resolve_corpus(config, dataset)
    else:
        dataset = data.load_dataset(config.data, tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None,
                                    tokenizer=source.tokenizer if source and not tokenizer_dir.is_dir() else None)
        config = resolve(config, dataset)
    if source is not None:
        config = init_from.check_vocab(config, source, dataset.tokenizer)
    if start > config.train.steps:
        raise CheckpointError(f"{workdir} is at step {start}, past train.steps={config.train.steps}: raise "
                              "train.steps or use a new --workdir")
    model = task.build_model(config.model)
    cfg = config
    params, specs = abstract_init(model, cfg.train.seed, cfg.data.buckets[-1])
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
    batches: BatchSource
    if config.task == "mlm":
        batches = StreamBatches(dataset, config, runner.data_share())
        dataset.unigram_accuracy = batches.unigram_accuracy()
    else:
        batches = InMemoryBatches(dataset, config, runner.data_share())
    return Plan(config, workdir, dataset, start, task, batches, runner, abstract, make_state, source)


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
        saved = yaml.safe_load((plan.workdir / CONFIG_FILE).read_text()) or {}
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
    if plan.config.task == "mlm":  # reported once: what the masked-token accuracy must beat
        record["unigram_baseline_accuracy"] = plan.dataset.unigram_accuracy
    session = run_metadata(plan.start_step)
    session.update(config=f"{HISTORY_DIR}/from-step-{plan.start_step}.yaml", changed=changed)
    record["sessions"].append(session)
    atomic_write(path, json.dumps(record, indent=2) + "\n")
    if not changed:
        return None
    return (f"resuming from step {plan.start_step} with changed settings: {'; '.join(changed)} "
            f"(earlier configs kept in {HISTORY_DIR}/)")


def train(config: Config, workdir: Path, *, batches: Callable[[BatchSource], BatchSource] | None = None,
          interrupts: Interrupts | None = None) -> dict[str, Any]:
    """Lock the workdir, plan (validate), then train; returns the summary (with "preempted": True after a
    signal).

    The workdir lock (train.workdir.lock) is held for the whole run by process 0; a workdir holding a run is
    locked before its run is read, a new one as soon as the plan is valid (so bad input creates nothing).
    `batches` may wrap the planned batch source (e.g. to inject faults in tests). `interrupts` is the CLI's
    signal policy; without one, SIGINT/SIGTERM are handled for the duration of the call. Raises the
    one-line errors of `plan_run`, WorkdirBusyError, DiskFullError, or train.loop.trainer.HaltError.
    """
    from train.loop.trainer import Trainer
    from train.workdir.lock import WorkdirLock

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
        return Trainer(plan, policy).train()
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


def summary_line(summary: dict[str, Any]) -> str:
    """The one line the CLI prints for a finished run."""
    return (f"done: {summary['steps']} steps ({summary['session_steps']} this session, {summary['seconds']:.0f}s); "
            f"best validation accuracy {summary['best_val_accuracy']:.4f} at step {summary['best_val_step']}; "
            f"test accuracy {summary['test_accuracy']:.4f} (checkpoint {summary['test_checkpoint_step']}); "
            f"workdir {summary['workdir']}")
