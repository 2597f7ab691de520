"""The training loop: plan (validate everything, write nothing), then run (train, evaluate, checkpoint, log).

`plan_run` reads the config, the data, the workdir and any checkpoint in it, and raises a one-line error
(ConfigError, DataError, CheckpointError, WorkdirError: exit code 2) before anything is written, so a bad
command never touches an existing run. `run` then trains from the latest complete checkpoint:

- step t (0-based) uses batch `train_batch(seed, t)` and dropout key fold_in(key(seed), t): both pure in t,
  so a resumed run computes exactly the steps the uninterrupted one would have;
- results are fetched every `train.sync_every` steps (and at each log, eval and save), which bounds the
  queue of dispatched steps and is where non-finite steps are noticed;
- a non-finite step is skipped by the optimizer (optax.apply_if_finite); `train.nonfinite=halt` stops at
  the first one, `skip` after `train.max_nonfinite` in a row; a halt never saves and names the first
  non-finite block/sublayer (exit code 1);
- SIGTERM/SIGINT finish the current step, save synchronously and return (exit code 0).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.experimental import multihost_utils

from jaxblock.diagnostics import first_nonfinite, grad_norms_by_depth, residual_ratios
from jaxblock.model import Classifier
from train import data
from train.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    CheckpointError,
    Checkpoints,
    check_compatible,
    latest_step,
    read_run_config,
)
from train.config import Config, ConfigError, config_from_dict
from train.metrics import MetricsLog, Progress, atomic_write, plot_curves, read_jsonl, run_metadata
from train.parallel import Runner, host_value, initialize_distributed, is_primary, make_runner
from train.state import TrainState, create_state, init_params
from train.step import batch_loss

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"


class WorkdirError(ValueError):
    """A workdir that cannot hold a run: one line naming the problem and the fix."""


class HaltError(RuntimeError):
    """The run stopped on non-finite steps (exit code 1); the message says where and what to do."""


@dataclass
class Plan:
    """Everything validated for a run; nothing has been written yet."""

    config: Config  # resolved: model.vocab_size and model.num_classes come from the data
    workdir: Path
    dataset: data.Dataset
    start_step: int  # the checkpoint to resume from; 0 for a fresh run
    runner: Runner
    abstract: TrainState  # shapes and dtypes only (jax.eval_shape), for the runner and restore targets
    make_state: Callable[[], TrainState]  # the fresh state (seeded init), traceable

    def initial_state(self) -> TrainState:
        """The fresh state, built where the runner keeps it (sharded from the start under `sharded`)."""
        return self.runner.init_state(self.make_state)


def check_workdir(workdir: Path) -> None:
    """A directory we may write: new (creatable), empty, or holding a run."""
    if workdir.exists():
        if not workdir.is_dir():
            raise WorkdirError(f"workdir {workdir} is a file: pass a directory path for --workdir")
        if not os.access(workdir, os.W_OK | os.X_OK):
            raise WorkdirError(f"workdir {workdir} is not writable: fix its permissions or pass another --workdir")
        if any(workdir.iterdir()) and not (workdir / CONFIG_FILE).is_file():
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
    resolved = config_from_dict(raw)
    if resolved.data.buckets[-1] > resolved.model.max_len:
        raise ConfigError(
            f"model.max_len={resolved.model.max_len} is shorter than the largest bucket {resolved.data.buckets[-1]} "
            f"in data.buckets: raise model.max_len to >= {resolved.data.buckets[-1]} or drop that bucket"
        )
    return resolved


def plan_run(config: Config, workdir: Path) -> Plan:
    """Validate config, data, workdir and checkpoint compatibility; build the (placed) initial state."""
    workdir = Path(workdir)
    initialize_distributed(config.parallel)  # multi-host: before anything touches a device
    check_workdir(workdir)
    tokenizer_dir = workdir / TOKENIZER_DIR
    dataset = data.load_dataset(config.data, tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None)
    config = resolve(config, dataset)
    start = latest_step(workdir) or 0
    if start > config.train.steps:
        raise CheckpointError(f"{workdir} is at step {start}, past train.steps={config.train.steps}: raise "
                              "train.steps or use a new --workdir")
    model = Classifier(config.model)
    cfg = config

    def make_state() -> TrainState:
        params = init_params(model, cfg.train.seed, cfg.data.buckets[-1])
        return create_state(model, params, cfg.optim, cfg.train.steps)

    abstract = jax.eval_shape(make_state)
    if start:
        check_compatible(workdir, start, abstract.params)
    return Plan(config, workdir, dataset, start, make_runner(config, abstract), abstract, make_state)


# --- writing the run's files ---------------------------------------------------------------------


def write_run_files(plan: Plan) -> None:
    """Resolved config, tokenizer and a session record in run.json (primary process only)."""
    plan.workdir.mkdir(parents=True, exist_ok=True)
    atomic_write(plan.workdir / CONFIG_FILE, yaml.safe_dump(plan.config.model_dump(mode="json"), sort_keys=False))
    if not (plan.workdir / TOKENIZER_DIR).is_dir():
        plan.dataset.tokenizer.save(plan.workdir / TOKENIZER_DIR)
    path = plan.workdir / RUN_FILE
    record = json.loads(path.read_text()) if path.is_file() else {"sessions": []}
    record["label_names"] = plan.dataset.label_names
    record["truncated"] = plan.dataset.truncated
    record["sessions"].append(run_metadata(plan.start_step))
    atomic_write(path, json.dumps(record, indent=2) + "\n")


# --- evaluation --------------------------------------------------------------------------------


def fetch(tree: Any) -> Any:
    """Host numpy copies of (replicated) results; with several processes each reads its local copy."""
    return jax.device_get(jax.tree.map(host_value, tree))


def evaluate(runner: Runner, state: TrainState, split: data.Split, config: Config) -> dict[str, float]:
    """Loss and accuracy over the whole split in inference mode (no dropout, no gradients)."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    pending: list[Any] = []

    def drain() -> None:
        for sums in fetch(pending):
            for key in totals:
                totals[key] += _host(sums[key])
        pending.clear()

    index, count = runner.data_share()
    for batch in data.eval_batches(split, batch_size=config.train.batch_size, buckets=config.data.buckets,
                                   process_index=index, process_count=count):
        pending.append(runner.eval_step(state, batch))
        if len(pending) >= config.train.sync_every:
            drain()
    drain()
    real = max(totals["count"], 1.0)
    return {"loss": totals["loss_sum"] / real, "accuracy": totals["correct"] / real, "examples": totals["count"]}


# --- signals -----------------------------------------------------------------------------------


class StopRequest:
    """SIGTERM/SIGINT ask the loop to stop after the current step; a second signal interrupts at once.

    With several processes, JAX's preemption sync point (through Orbax) decides instead, so that every
    process stops at the same step.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopRequest:
        if jax.process_count() == 1:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# --- the loop ----------------------------------------------------------------------------------


def locate_nonfinite(config: Config, params: Any, batch: dict[str, np.ndarray]) -> str:
    """The first block/sublayer whose recorded output is non-finite on `batch` (jaxblock.diagnostics),
    plus the likely cause when the batch itself holds token ids outside the vocabulary."""
    found = first_nonfinite(Classifier(config.model), {"params": params}, batch)
    where = str(found) if not found.passed else (
        "none in the forward pass: the loss is finite, so the gradients overflowed in the backward pass")
    tokens, vocab = np.asarray(batch["tokens"]), config.model.vocab_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        where += (f"; the batch has token ids {tokens.min()}..{tokens.max()} outside [0, {vocab}): a corrupt batch "
                  "or the wrong tokenizer")
    return where


def _host(value: Any) -> float:
    return float(np.asarray(value).reshape(-1)[0])


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves))


class Trainer:
    """One session of a run (from `plan.start_step` to `train.steps`)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.cfg = plan.config
        self.primary = is_primary()
        self.runner = plan.runner
        self.base_key = jax.random.key(self.cfg.train.seed)
        self.pending: list[tuple[int, Any]] = []
        self.window: dict[str, float] = {}
        self.window_start = time.perf_counter()
        self.ckpts: Checkpoints | None = None

    def batch(self, step: int, packed: bool = True) -> dict[str, np.ndarray]:
        """This process's share of step's batch; packed=False gives the same examples padded (what the
        per-example diagnostics and the non-finite locator take, with or without data.packing)."""
        index, count = self.runner.data_share()
        return data.train_batch(
            self.plan.dataset.train, seed=self.cfg.train.seed, step=step, batch_size=self.cfg.train.batch_size,
            buckets=self.cfg.data.buckets, process_index=index, process_count=count,
            pack_segments=self.cfg.data.pack_segments if self.cfg.data.packing and packed else None,
        )

    def meta(self) -> dict[str, Any]:
        return {"seed": self.cfg.train.seed, "label_names": self.plan.dataset.label_names,
                "data_position": "the step: batches are a pure function of (seed, step)"}

    def drain(self, state: TrainState, log: MetricsLog, progress: Progress) -> None:
        """Fetch the dispatched steps' metrics; log windows; stop on non-finite steps as configured."""
        fetched = fetch([m for _, m in self.pending])
        steps = [s for s, _ in self.pending]
        self.pending.clear()
        tcfg = self.cfg.train
        for done, metrics in zip(steps, fetched, strict=True):
            m = {k: _host(v) for k, v in metrics.items()}
            w = self.window
            if m["finite"]:
                for key in ("loss", "accuracy", "grad_norm"):
                    w[key] = w.get(key, 0.0) + m[key]
                w["n"] = w.get("n", 0.0) + 1
            w["tokens"] = w.get("tokens", 0.0) + m["tokens"]
            w["steps"] = w.get("steps", 0.0) + 1
            if not m["finite"] and (tcfg.nonfinite == "halt" or m["nonfinite_consecutive"] >= tcfg.max_nonfinite):
                self.halt(state, done, m)
            if done % tcfg.log_every == 0 or done == tcfg.steps:
                elapsed = max(time.perf_counter() - self.window_start, 1e-9)
                n = max(w.get("n", 0.0), 1.0)
                record = {"loss": w.get("loss", float("nan")) / n, "accuracy": w.get("accuracy", float("nan")) / n,
                          "grad_norm": w.get("grad_norm", float("nan")) / n, "lr": m["lr"],
                          "tokens_per_s": w["tokens"] / elapsed, "nonfinite_total": m["nonfinite_total"]}
                log.write("train", done, record)
                progress.update(int(w["steps"]), {"loss": record["loss"], "acc": record["accuracy"],
                                                  "tok/s": record["tokens_per_s"]})
                self.window = {}
                self.window_start = time.perf_counter()

    def host_params(self, state: TrainState) -> Any:
        """The parameters as host arrays (gathered from every process when sharded across hosts)."""
        params = self.runner.unreplicate(state).params
        if not all(x.is_fully_addressable for x in jax.tree.leaves(params)):
            params = multihost_utils.process_allgather(params, tiled=True)
        return jax.device_get(params)

    def diagnose(self, state: TrainState, done: int, log: MetricsLog) -> None:
        """train.diagnostics_every: per-layer residual ratios and gradient norms by depth on this step's
        batch (jaxblock.diagnostics, eval mode), recorded as split 'diag'."""
        params = self.host_params(state)  # every process takes part in the gather
        if not self.primary:
            return
        model, batch = Classifier(self.cfg.model), self.batch(done - 1, packed=False)
        ratios = residual_ratios(model, {"params": params}, batch)
        grads = grad_norms_by_depth(model, {"params": params}, batch, batch_loss)
        log.write("diag", done, {**ratios.as_metrics(), **grads.as_metrics()})

    def halt(self, state: TrainState, done: int, m: dict[str, float]) -> None:
        """Stop without saving; name the first non-finite block/sublayer on the step's own batch."""
        tcfg = self.cfg.train
        where = locate_nonfinite(self.cfg, self.host_params(state), self.batch(done - 1, packed=False))
        why = ("train.nonfinite=halt" if tcfg.nonfinite == "halt"
               else f"{int(m['nonfinite_consecutive'])} consecutive non-finite steps (train.max_nonfinite)")
        assert self.ckpts is not None  # halts happen inside train(), which opened them
        self.ckpts.wait()  # report the newest checkpoint that is complete on disk
        newest = self.ckpts.latest_step()
        raise HaltError(
            f"halted at step {done}: non-finite loss or gradients ({why}); {where}; "
            f"newest checkpoint: {newest if newest is not None else 'none'} (finite): lower optim.lr, check the "
            "data, or set train.nonfinite=skip, then rerun the same command to resume from it"
        )

    def save(self, ckpts: Checkpoints, state: TrainState, log: MetricsLog, val: dict[str, float] | None) -> bool:
        host_state = self.runner.unreplicate(state)
        if not bool(fetch(_all_finite((host_state.params, host_state.opt_state)))):
            return False  # never write a non-finite state; the previous checkpoint stays the newest
        log.flush()
        metrics = {f"val_{k}": v for k, v in val.items()} if val else None
        return ckpts.save(host_state, self.meta(), metrics)

    def train(self) -> dict[str, Any]:
        plan, cfg, tcfg = self.plan, self.cfg, self.cfg.train
        t0 = time.perf_counter()
        if self.primary:
            write_run_files(plan)
        ckpts = self.ckpts = Checkpoints(plan.workdir, cfg.checkpoint)
        if plan.start_step:
            restored, _ = ckpts.restore(plan.start_step, self.runner.abstract_state(plan.abstract))
            state = self.runner.place_state(restored)
        else:
            state = plan.initial_state()
        log = MetricsLog(plan.workdir, plan.start_step, enabled=self.primary)
        progress = Progress(tcfg.steps, plan.start_step, bar=self.primary and tcfg.progress, lines=self.primary)
        progress.write(f"{plan.dataset.summary()}; run in {plan.workdir}"
                       + (f", resuming from step {plan.start_step}" if plan.start_step else ""))
        val: dict[str, float] | None = None
        preempted = False
        try:
            with StopRequest() as stop:
                for step in range(plan.start_step, tcfg.steps):
                    done = step + 1
                    rng = jax.random.fold_in(self.base_key, step)
                    state, metrics = self.runner.train_step(state, self.batch(step), rng)
                    self.pending.append((done, metrics))
                    preempted = stop.signum is not None or (
                        jax.process_count() > 1 and ckpts.manager.reached_preemption(done))
                    eval_now = done % tcfg.eval_every == 0 or done == tcfg.steps
                    save_now = done % cfg.checkpoint.every == 0 or done == tcfg.steps or preempted
                    if (preempted or eval_now or save_now or done % tcfg.log_every == 0
                            or len(self.pending) >= tcfg.sync_every):
                        self.drain(state, log, progress)
                    if tcfg.diagnostics_every and done % tcfg.diagnostics_every == 0:
                        self.diagnose(state, done, log)
                    val = None
                    if eval_now:
                        val = evaluate(self.runner, state, plan.dataset.validation, cfg)
                        log.write("val", done, val)
                        progress.write(f"step {done}: validation accuracy {val['accuracy']:.4f} "
                                       f"loss {val['loss']:.4f}")
                    if save_now and not self.save(ckpts, state, log, val):
                        progress.write(f"step {done}: the state is non-finite; checkpoint skipped "
                                       f"(the newest stays {ckpts.latest_step()})")
                    if preempted:
                        ckpts.wait()
                        break
            ckpts.wait()
            if preempted:
                return {"preempted": True, "step": done,  # state.step counts skipped updates too
                        "checkpoint": str(ckpts.directory / str(ckpts.latest_step()))}
            return self.finish(ckpts, state, log, t0, val)
        finally:
            progress.close()
            log.close()
            ckpts.close()

    def finish(self, ckpts: Checkpoints, state: TrainState, log: MetricsLog, t0: float,
               val: dict[str, float] | None) -> dict[str, Any]:
        """Final validation (unless the last step just ran it) and test (on the best checkpoint when keeping
        the best), curves, summary."""
        plan, cfg = self.plan, self.cfg
        total = cfg.train.steps
        if val is None:  # a rerun of a finished run, which trained nothing this session
            val = evaluate(self.runner, state, plan.dataset.validation, cfg)
            log.write("val", total, val)
        best_step = ckpts.best_step()
        test_step = total if best_step is None else best_step
        test_state = state
        if test_step != total:
            restored, _ = ckpts.restore(test_step, self.runner.abstract_state(plan.abstract))
            test_state = self.runner.place_state(restored)
        test = evaluate(self.runner, test_state, plan.dataset.test, cfg)
        log.write("test", total, {**test, "checkpoint_step": test_step})
        log.flush()
        vals = [r for r in read_jsonl(plan.workdir / "metrics.jsonl") if r["split"] == "val"] if self.primary else []
        # Of equally good evaluations the newest, as Orbax's keep-best ranking does.
        best = max(vals, key=lambda r: (r["accuracy"], r["step"])) if vals else {"accuracy": val["accuracy"],
                                                                                  "step": total}
        summary = {
            "steps": total, "session_steps": total - plan.start_step,
            "seconds": round(time.perf_counter() - t0, 1),
            "best_val_accuracy": best["accuracy"], "best_val_step": best["step"],
            "final_val_accuracy": val["accuracy"], "test_accuracy": test["accuracy"], "test_loss": test["loss"],
            "test_checkpoint_step": test_step, "workdir": str(plan.workdir),
        }
        if self.primary:
            atomic_write(plan.workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
            plot_curves(plan.workdir)
        return summary


def summary_line(summary: dict[str, Any]) -> str:
    return (f"done: {summary['steps']} steps ({summary['session_steps']} this session, {summary['seconds']:.0f}s); "
            f"best validation accuracy {summary['best_val_accuracy']:.4f} at step {summary['best_val_step']}; "
            f"test accuracy {summary['test_accuracy']:.4f} (checkpoint {summary['test_checkpoint_step']}); "
            f"workdir {summary['workdir']}")


def train_from_config(config: Config, workdir: Path) -> dict[str, Any]:
    """Plan (validate), then train. Raises the one-line errors of `plan_run`, or HaltError."""
    return Trainer(plan_run(config, workdir)).train()


def config_for_workdir(config_path: str | None, overrides: list[str], workdir: Path) -> Config:
    """The config to run: --config (+ overrides), or the run's own resolved config (+ overrides)."""
    from train.config import load_config

    if config_path is not None:
        return load_config(config_path, overrides)
    if not (Path(workdir) / CONFIG_FILE).is_file():
        raise ConfigError(f"no --config given and {workdir} holds no run: pass --config configs/tiny.yaml (or another)")
    saved = read_run_config(workdir).model_dump(mode="json")
    from train.config import apply_overrides

    return config_from_dict(apply_overrides(saved, overrides))
