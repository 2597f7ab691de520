"""The training loop: for each step take a batch from the batch source, run the compiled step through the
runner, then do whatever periodic work is due (log, diagnose, evaluate, checkpoint).

The loop receives its three seams from a `train.run.Plan`: the task (loss and metrics), the batch source
(`batch(step)`, evaluation batches, a reading position saved in each checkpoint) and the runner (devices,
hosts, placement and every gather). It knows nothing about the objective, the data or the devices.

- step t (0-based) uses batch `batches.batch(t)` and dropout key fold_in(key(seed), t), so with a source
  pure in (seed, t) a resumed run computes exactly the steps the uninterrupted one would have;
- results are fetched every `train.sync_every` steps (and before each log, eval and save), which bounds
  the queue of dispatched steps and is where non-finite steps are noticed;
- a non-finite step is skipped by the optimizer (optax.apply_if_finite); `train.nonfinite=halt` stops at
  the first one, `skip` after `train.max_nonfinite` in a row; a halt never saves and names the first
  non-finite block/sublayer (exit code 1);
- signals follow train.interrupts: the first SIGTERM/SIGINT finishes the current step, saves, writes
  curves.png and summary.json for what was done and returns (exit code 0); a second stops at once, never
  inside a checkpoint commit, so the last complete checkpoint stays intact;
- a resumed run restores the newest checkpoint that reads back (a damaged newer one is moved aside and named
  in one line, train.checkpoints.repair); a save that fails for lack of space is a one-line DiskFullError.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.diagnostics import first_nonfinite, grad_norms_by_depth, residual_ratios
from train.checkpoints.repair import restore_newest_good, save_failed_for_space
from train.checkpoints.store import Checkpoints, check_compatible
from train.config import Config
from train.data.batches import BatchSource
from train.devices.runners import Runner, is_primary
from train.interrupts import Interrupts
from train.loop.state import TrainState
from train.run import SUMMARY_FILE, Plan, prepare
from train.tasks import CLASSIFICATION, Task
from train.workdir.log_routing import LIBRARY_LOG, library_errors_to, stderr_to
from train.workdir.records import MetricsLog, Progress, atomic_write, plot_curves, read_jsonl

# Step metrics that are bookkeeping, not averaged into a log window.
_COUNTERS = ("lr", "finite", "nonfinite_consecutive", "nonfinite_total", "tokens")


class HaltError(RuntimeError):
    """The run stopped on non-finite steps (exit code 1); the message says where and what to do."""


def _host(value: Any) -> float:
    return float(np.asarray(value).reshape(-1)[0])


def evaluate(task: Task, runner: Runner, state: TrainState, batches: BatchSource, split: str,
             sync_every: int = 32) -> dict[str, float]:
    """The task's metrics over the whole split in inference mode (no dropout, no gradients), plus the
    count of what they average over (e.g. "examples")."""
    totals: dict[str, float] = {}
    pending: list[Any] = []

    def drain() -> None:
        for sums in runner.fetch(pending):
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + _host(value)
        pending.clear()

    for batch in batches.eval_batches(split):
        pending.append(runner.eval_step(state, batch))
        if len(pending) >= sync_every:
            drain()
    drain()
    return {**{k: float(v) for k, v in task.metrics(totals).items()}, task.count_name: totals.get("count", 0.0)}


def locate_nonfinite(config: Config, params: Any, batch: dict[str, np.ndarray], task: Task = CLASSIFICATION) -> str:
    """The first block/sublayer whose recorded output is non-finite on `batch` (jaxblock.diagnostics),
    plus the likely cause when the batch itself holds token ids outside the vocabulary."""
    found = first_nonfinite(task.build_model(config.model), {"params": params}, batch)
    where = str(found) if not found.passed else (
        "none in the forward pass: the loss is finite, so the gradients overflowed in the backward pass")
    tokens, vocab = np.asarray(batch["tokens"]), config.model.vocab_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        where += (f"; the batch has token ids {tokens.min()}..{tokens.max()} outside [0, {vocab}): a corrupt batch "
                  "or the wrong tokenizer")
    return where


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves))


@dataclass(frozen=True)
class Every:
    """Periodic work after step `done`: when `every` divides it, at the last step (`at_end`) and when the
    run is stopping (`on_stop`). `every` of 0 or None never fires on its own."""

    every: int | None
    action: Callable[[TrainState, int], None]
    at_end: bool = True
    on_stop: bool = False

    def __call__(self, state: TrainState, done: int, last: bool, stopping: bool) -> None:
        if (self.every and done % self.every == 0) or (self.at_end and last) or (self.on_stop and stopping):
            self.action(state, done)


class Trainer:
    """One session of a run (from `plan.start_step` to `train.steps`)."""

    def __init__(self, plan: Plan, interrupts: Interrupts | None = None):
        self.plan, self.cfg = plan, plan.config
        self.task, self.batches, self.runner = plan.task, plan.batches, plan.runner
        self.interrupts = interrupts if interrupts is not None else Interrupts(install=False)
        self.terminal = sys.stderr  # the run's own lines go here while library noise goes to orbax.log
        self.primary = is_primary()
        self.base_key = jax.random.key(self.cfg.train.seed)
        self.pending: list[tuple[int, Any]] = []  # (step, dispatched metrics) not yet fetched
        self.window: dict[str, float] = {}  # sums since the last log row; saved in each checkpoint
        self.window_start = time.perf_counter()
        self.val: dict[str, float] | None = None  # validation of the step just done, if it ran one
        self.ckpts: Checkpoints | None = None
        self.log: MetricsLog | None = None
        self.progress: Progress | None = None

    def train(self) -> dict[str, Any]:
        plan, tcfg, interrupts = self.plan, self.cfg.train, self.interrupts
        t0 = time.perf_counter()
        changed = prepare(plan) if self.primary else None
        failed = True
        with library_errors_to(plan.workdir / LIBRARY_LOG):
            try:
                state = self.open()
                if changed:
                    self.say(changed)
                actions = [Every(tcfg.log_every, self.drain, on_stop=True),
                           Every(tcfg.diagnostics_every, self.diagnose, at_end=False),
                           Every(tcfg.eval_every, self.validate),
                           Every(self.cfg.checkpoint.every, self.checkpoint, on_stop=True)]
                stopping, done = False, plan.start_step
                with interrupts.graceful():
                    for step in range(plan.start_step, tcfg.steps):
                        interrupts.set_phase("compile" if step == plan.start_step else "training")
                        done, self.val = step + 1, None
                        batch, rng = self.batches.batch(step), jax.random.fold_in(self.base_key, step)
                        state, metrics = self.runner.train_step(state, batch, rng)
                        self.pending.append((done, metrics))
                        if len(self.pending) >= tcfg.sync_every:
                            self.drain(state, done)
                        stopping = interrupts.stop_requested or (
                            jax.process_count() > 1 and self.ckpts_().manager.reached_preemption(done))
                        for action in actions:
                            action(state, done, done == tcfg.steps, stopping)
                        if stopping:
                            break
                interrupts.set_phase("finishing")
                self.wait_for_saves(done)
                summary = self.stopped(done, t0) if stopping else self.finish(state, t0)
                failed = False
                return summary
            finally:
                self.close(failed)

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.write(line)

    def close(self, failed: bool) -> None:
        """Close the session's files; the checkpoint manager last, with its saves finished. After a failure
        the first error is the one reported: a second one from closing is not allowed to replace it."""
        with self.interrupts.critical("closing the run's files"):
            for resource in (self.progress, self.log, self.ckpts):
                if resource is None:
                    continue
                if failed:  # best effort; what Orbax's failed save threads print goes to orbax.log
                    with contextlib.suppress(Exception), stderr_to(self.plan.workdir / LIBRARY_LOG):
                        resource.close()
                elif resource is self.ckpts:
                    try:
                        resource.close()
                    except Exception as err:
                        full = save_failed_for_space(err, self.ckpts_().directory, None)
                        if full is None:
                            raise
                        raise full from None
                else:
                    resource.close()

    # --- session resources ----------------------------------------------------------------------

    def open(self) -> TrainState:
        """Open the checkpoints, the metrics log and the progress line; the state to start from: the
        newest checkpoint that restores (damaged newer ones are moved aside and named), else fresh."""
        plan, cfg = self.plan, self.cfg
        self.ckpts = Checkpoints(plan.workdir, cfg.checkpoint)
        notes: list[str] = []
        if plan.start_step:
            ckpts, target = self.ckpts, self.runner.abstract_state(plan.abstract)

            def restore(step: int) -> tuple[TrainState, dict[str, Any]]:
                check_compatible(plan.workdir, step, plan.abstract.params)
                return ckpts.restore(step, target)

            found = restore_newest_good(ckpts.directory, restore, primary=self.primary)
            if found.notes:
                ckpts.manager.reload()
                notes = found.notes
            assert found.step is not None, "a run with a latest step has a checkpoint"
            plan.start_step = found.step
            restored, meta = found.value
            self.batches.restore(meta.get("data_state"))
            self.window = dict(meta.get("log_window") or {})
            state = self.runner.place_state(restored)
        else:
            state = plan.initial_state()
        self.log = MetricsLog(plan.workdir, plan.start_step, enabled=self.primary)
        self.progress = Progress(cfg.train.steps, plan.start_step, bar=self.primary and cfg.train.progress,
                                 lines=self.primary, stream=self.terminal)
        for note in notes:
            self.say(note)
        self.say(f"{plan.dataset.summary()}; run in {plan.workdir}"
                 + (f", resuming from step {plan.start_step}" if plan.start_step else ""))
        return state

    def ckpts_(self) -> Checkpoints:
        assert self.ckpts is not None, "open() first"
        return self.ckpts

    def log_(self) -> MetricsLog:
        assert self.log is not None, "open() first"
        return self.log

    # --- periodic work --------------------------------------------------------------------------

    def drain(self, state: TrainState, done: int) -> None:
        """Fetch the dispatched steps' metrics; log windows; stop on non-finite steps as configured."""
        fetched = self.runner.fetch([m for _, m in self.pending])
        steps = [s for s, _ in self.pending]
        self.pending.clear()
        tcfg = self.cfg.train
        for step, metrics in zip(steps, fetched, strict=True):
            m = {k: _host(v) for k, v in metrics.items()}
            # The task's metrics (loss first), then grad_norm; fetched dicts come back with sorted keys.
            averaged = sorted((k for k in m if k not in _COUNTERS), key=lambda k: (k != "loss", k == "grad_norm", k))
            w = self.window
            if m["finite"]:
                for key in averaged:
                    w[key] = w.get(key, 0.0) + m[key]
                w["n"] = w.get("n", 0.0) + 1
            w["tokens"] = w.get("tokens", 0.0) + m["tokens"]
            w["steps"] = w.get("steps", 0.0) + 1
            if not m["finite"] and (tcfg.nonfinite == "halt" or m["nonfinite_consecutive"] >= tcfg.max_nonfinite):
                self.halt(state, step, m)
            if step % tcfg.log_every == 0 or step == tcfg.steps:
                elapsed = max(time.perf_counter() - self.window_start, 1e-9)
                n = max(w.get("n", 0.0), 1.0)
                record = {**{k: w.get(k, float("nan")) / n for k in averaged}, "lr": m["lr"],
                          "tokens_per_s": w["tokens"] / elapsed, "nonfinite_total": m["nonfinite_total"]}
                self.log_().write("train", step, record)
                assert self.progress is not None
                self.progress.update(int(w["steps"]), {"loss": record["loss"], "acc": record.get("accuracy", 0.0),
                                                       "tok/s": record["tokens_per_s"]})
                self.window = {}
                self.window_start = time.perf_counter()

    def diagnose(self, state: TrainState, done: int) -> None:
        """train.diagnostics_every: per-layer residual ratios and gradient norms by depth on this step's
        examples (jaxblock.diagnostics, eval mode), recorded as split 'diag'."""
        self.drain(state, done)
        params = self.runner.host_params(state)  # every process takes part in the gather
        if not self.primary:
            return
        model, batch = self.task.build_model(self.cfg.model), self.batches.example_batch(done - 1)
        ratios = residual_ratios(model, {"params": params}, batch)
        grads = grad_norms_by_depth(model, {"params": params}, batch, self.task.loss)
        self.log_().write("diag", done, {**ratios.as_metrics(), **grads.as_metrics()})

    def validate(self, state: TrainState, done: int) -> None:
        self.drain(state, done)
        self.val = evaluate(self.task, self.runner, state, self.batches, "validation", self.cfg.train.sync_every)
        self.log_().write("val", done, self.val)
        assert self.progress is not None
        self.progress.write(f"step {done}: validation accuracy {self.val['accuracy']:.4f} loss {self.val['loss']:.4f}")

    def checkpoint(self, state: TrainState, done: int) -> None:
        """Save (asynchronously if configured), never a non-finite state: the previous one stays newest.
        The metrics and TensorBoard events up to `done` are made durable first, so a kill after the
        checkpoint loses nothing it covers; the log window in progress is saved with it, so the first log
        row after a resume averages the same steps as in an uninterrupted run."""
        self.drain(state, done)
        host_state = self.runner.unreplicate(state)
        ckpts = self.ckpts_()
        if bool(self.runner.fetch(_all_finite((host_state.params, host_state.opt_state)))):
            self.log_().flush()
            metrics = {f"val_{k}": v for k, v in self.val.items()} if self.val else None
            meta = {"seed": self.cfg.train.seed, "label_names": self.plan.dataset.label_names,
                    "data_state": self.batches.state(), "log_window": self.window}
            with self.interrupts.critical(f"saving checkpoint {done}"):
                try:
                    saved = ckpts.save(host_state, meta, metrics)
                except Exception as err:
                    full = save_failed_for_space(err, ckpts.directory, done)
                    if full is None:
                        raise
                    raise full from None
            if saved:
                return
        assert self.progress is not None
        self.progress.write(f"step {done}: the state is non-finite; checkpoint skipped "
                            f"(the newest stays {ckpts.latest_step()})")

    def wait_for_saves(self, step: int | None) -> None:
        """Block until started saves are committed (signals held meanwhile); a full disk is one line."""
        ckpts = self.ckpts_()
        try:
            self.interrupts.wait_for_saves(ckpts.wait, f"checkpoint {step}" if step is not None else "a save")
        except Exception as err:
            full = save_failed_for_space(err, ckpts.directory, step)
            if full is None:
                raise
            raise full from None

    def halt(self, state: TrainState, done: int, m: dict[str, float]) -> None:
        """Stop without saving; name the first non-finite block/sublayer on the step's own examples."""
        tcfg = self.cfg.train
        where = locate_nonfinite(self.cfg, self.runner.host_params(state), self.batches.example_batch(done - 1),
                                 self.task)
        why = ("train.nonfinite=halt" if tcfg.nonfinite == "halt"
               else f"{int(m['nonfinite_consecutive'])} consecutive non-finite steps (train.max_nonfinite)")
        self.wait_for_saves(None)  # report the newest checkpoint that is complete on disk
        newest = self.ckpts_().latest_step()
        raise HaltError(
            f"halted at step {done}: non-finite loss or gradients ({why}); {where}; "
            f"newest checkpoint: {newest if newest is not None else 'none'} (finite): lower optim.lr, check the "
            "data, or set train.nonfinite=skip, then rerun the same command to resume from it"
        )

    # --- the end of a run -------------------------------------------------------------------------

    def stopped(self, done: int, t0: float) -> dict[str, Any]:
        """The summary of a run stopped by a signal: what it did, where to continue from; with curves."""
        plan, ckpts = self.plan, self.ckpts_()
        latest = ckpts.latest_step()
        summary: dict[str, Any] = {
            "preempted": True, "step": done, "steps": self.cfg.train.steps,
            "session_steps": done - plan.start_step, "seconds": round(time.perf_counter() - t0, 1),
            "checkpoint": str(ckpts.directory / str(latest)) if latest is not None else None,
            "workdir": str(plan.workdir),
        }
        if self.primary:
            self.log_().flush()
            vals = [r for r in read_jsonl(plan.workdir / "metrics.jsonl") if r["split"] == "val"]
            if vals:
                best = max(vals, key=lambda r: (r["accuracy"], r["step"]))
                summary.update(best_val_accuracy=best["accuracy"], best_val_step=best["step"])
            with self.interrupts.critical("writing summary.json and curves.png"):
                atomic_write(plan.workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
                plot_curves(plan.workdir)
        return summary

    def finish(self, state: TrainState, t0: float) -> dict[str, Any]:
        """Final validation (unless the last step just ran it) and test (on the best checkpoint when keeping
        the best), curves, summary."""
        plan, total = self.plan, self.cfg.train.steps
        ckpts, log = self.ckpts_(), self.log_()
        val = self.val
        if val is None:  # a rerun of a finished run, which trained nothing this session
            val = evaluate(self.task, self.runner, state, self.batches, "validation", self.cfg.train.sync_every)
            log.write("val", total, val)
        best_step = ckpts.best_step()
        test_step = total if best_step is None else best_step
        test_state = state
        if test_step != total:
            restored, _ = ckpts.restore(test_step, self.runner.abstract_state(plan.abstract))
            test_state = self.runner.place_state(restored)
        test = evaluate(self.task, self.runner, test_state, self.batches, "test", self.cfg.train.sync_every)
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
            with self.interrupts.critical("writing summary.json and curves.png"):
                atomic_write(plan.workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
                plot_curves(plan.workdir)
        return summary
