"""The training loop: for each step take a batch from the batch source, run the compiled step through the
runner, then do whatever periodic work is due (log, diagnose, validate, checkpoint).

The loop receives a `train.loop.plan.Plan` (built by train/run.py, which also writes the run's files):
the task (loss, metrics and which of them ranks validations), the batch source (`batch(step)`,
evaluation batches, a reading position saved in each checkpoint) and the runner (devices, hosts,
placement and every gather). It knows nothing about the objective, the data or the devices.

- step t (0-based) uses batch `batches.batch(t)` and dropout key fold_in(key(seed), t), so with a source
  pure in (seed, t) a resumed run computes exactly the steps the uninterrupted one would have;
- results are fetched every `train.sync_every` steps (and before each log, eval and save), which bounds
  the queue of dispatched steps and is where non-finite steps are noticed;
- a non-finite step is skipped by the optimizer (optax.apply_if_finite); `train.nonfinite=halt` stops at
  the first one, `skip` after `train.max_nonfinite` in a row; a halt never saves and names the first
  non-finite block/sublayer (HaltError, exit code 1);
- signals follow train.interrupts: the first SIGTERM/SIGINT finishes the current step, saves and returns
  the summary of what was done (exit code 0); a second stops at once, never inside a checkpoint commit;
- a resumed run restores the newest checkpoint that reads back (a damaged newer one is moved aside and named
  in one line, train.checkpoints.repair); a save that fails for lack of space is a one-line DiskFullError.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import jax

from jaxblock.diagnostics import grad_norms_by_depth, residual_ratios
from train.checkpoints.repair import restore_newest_good, saves_report_full_disk
from train.checkpoints.store import Checkpoints, check_compatible
from train.devices.hosts import is_primary
from train.errors import HaltError
from train.evaluation import evaluate, host_number
from train.interrupts import Interrupts
from train.loop.log_window import LogWindow
from train.loop.nonfinite import all_finite, halt_error, locate_nonfinite
from train.loop.plan import Plan
from train.loop.schedule import Every, Tick
from train.loop.state import TrainState
from train.loop.summary import best_fields, best_validation, prefixed
from train.tasks import metric_names, ranking
from train.workdir.log_routing import LIBRARY_LOG, library_errors_to, stderr_to
from train.workdir.metrics_log import MetricsLog, read_jsonl
from train.workdir.progress import Progress

__all__ = ["Every", "HaltError", "Tick", "Trainer", "evaluate", "locate_nonfinite"]


class Trainer:
    """One session of a run (from `plan.start_step` to `train.steps`); `train()` returns its summary."""

    def __init__(self, plan: Plan, interrupts: Interrupts | None = None):
        self.plan, self.cfg = plan, plan.config
        self.task, self.batches, self.runner = plan.task, plan.batches, plan.runner
        self.interrupts = interrupts if interrupts is not None else Interrupts(install=False)
        self.terminal = sys.stderr  # the run's own lines go here while library noise goes to orbax.log
        self.primary = is_primary()
        self.base_key = jax.random.key(self.cfg.train.seed)
        self.rank_by, self.higher = ranking(self.task, self.cfg)
        tcfg = self.cfg.train
        self.log_rows = Every(tcfg.log_every, lambda tick: self.drain(tick.state), on_stop=True)
        self.pending: list[tuple[int, Any]] = []  # (step, dispatched metrics) not yet fetched
        self.window = LogWindow()
        self.ckpts: Checkpoints | None = None
        self.log: MetricsLog | None = None
        self.progress: Progress | None = None

    def train(self, notes: list[str] | None = None) -> dict[str, Any]:
        """Train from the plan's start step; `notes` are lines to show once the progress line is up."""
        t0, failed = time.perf_counter(), True
        with library_errors_to(self.plan.workdir / LIBRARY_LOG):
            try:
                tick = self.steps(self.open(notes or []))
                self.interrupts.set_phase("finishing")
                self.wait_for_saves(tick.done)
                summary = self.stopped(tick.done) if tick.stopping else self.finish(tick.state, tick.val)
                summary["seconds"] = round(time.perf_counter() - t0, 1)
                failed = False
                return summary
            finally:
                self.close(failed)

    def steps(self, state: TrainState) -> Tick:
        """Every step from the plan's start to train.steps (or a stop), each followed by the periodic work due;
        the last step's Tick."""
        start, total, interrupts = self.plan.start_step, self.cfg.train.steps, self.interrupts
        actions = [self.log_rows, Every(self.cfg.train.diagnostics_every, self.diagnose, at_end=False),
                   Every(self.cfg.train.eval_every, self.validate),
                   Every(self.cfg.checkpoint.every, self.checkpoint, on_stop=True)]
        tick = Tick(state, start)
        with interrupts.graceful():
            for step in range(start, total):
                interrupts.set_phase("compile" if step == start else "training")
                state, done = self.step(state, step), step + 1
                tick = Tick(state, done, last=done == total, stopping=self.stop_requested(done))
                for action in actions:
                    action(tick)
                if tick.stopping:
                    break
        return tick

    def step(self, state: TrainState, step: int) -> TrainState:
        """Dispatch step `step`; fetch the queue when it reaches train.sync_every."""
        batch, rng = self.batches.batch(step), jax.random.fold_in(self.base_key, step)
        state, metrics = self.runner.train_step(state, batch, rng)
        self.pending.append((step + 1, metrics))
        if len(self.pending) >= self.cfg.train.sync_every:
            self.drain(state)
        return state

    def stop_requested(self, done: int) -> bool:
        return self.interrupts.stop_requested or (
            jax.process_count() > 1 and self.ckpts_().manager.reached_preemption(done))

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.write(line)

    # --- session resources ----------------------------------------------------------------------

    def open(self, notes: list[str]) -> TrainState:
        """Open the checkpoints, the metrics log and the progress line; the state to start from: the
        newest checkpoint that restores (damaged newer ones are moved aside and named), else fresh."""
        plan, cfg = self.plan, self.cfg
        self.ckpts = ckpts = Checkpoints(plan.workdir, cfg.checkpoint)
        if plan.start_step:
            target = self.runner.abstract_state(plan.abstract)

            def restore(step: int) -> tuple[TrainState, dict[str, Any]]:
                check_compatible(plan.workdir, step, plan.abstract.params)
                return ckpts.restore(step, target)

            found = restore_newest_good(ckpts.directory, restore, primary=self.primary)
            if found.notes:
                ckpts.manager.reload()
            assert found.step is not None, "a run with a latest step has a checkpoint"
            plan.start_step = found.step
            restored, meta = found.value
            self.batches.restore(meta.get("data_state"))
            self.window = LogWindow(meta.get("log_window"))
            state = self.runner.place_state(restored)
            notes = [*found.notes, *notes]
        else:
            state = plan.initial_state()
        self.log = MetricsLog(plan.workdir, plan.start_step, enabled=self.primary)
        self.progress = Progress(cfg.train.steps, plan.start_step, bar=self.primary and cfg.train.progress,
                                 lines=self.primary, stream=self.terminal)
        for note in notes:
            self.say(note)
        self.say(f"{plan.data_summary()}; run in {plan.workdir}"
                 + (f", resuming from step {plan.start_step}" if plan.start_step else ""))
        return state

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
                    continue
                with saves_report_full_disk(self.ckpts_().directory, None):
                    resource.close()

    def ckpts_(self) -> Checkpoints:
        assert self.ckpts is not None, "open() first"
        return self.ckpts

    def log_(self) -> MetricsLog:
        assert self.log is not None, "open() first"
        return self.log

    def progress_(self) -> Progress:
        assert self.progress is not None, "open() first"
        return self.progress

    # --- periodic work --------------------------------------------------------------------------

    def drain(self, state: TrainState) -> None:
        """Fetch the dispatched steps' metrics; write the log rows due; stop on non-finite steps as configured."""
        fetched = self.runner.fetch([m for _, m in self.pending])
        steps = [s for s, _ in self.pending]
        self.pending.clear()
        tcfg = self.cfg.train
        for step, metrics in zip(steps, fetched, strict=True):
            m = {k: host_number(v) for k, v in metrics.items()}
            self.window.add(m)
            if not m["finite"] and (tcfg.nonfinite == "halt" or m["nonfinite_consecutive"] >= tcfg.max_nonfinite):
                self.halt(state, step, m)
            if self.log_rows.due(step, last=step == tcfg.steps, stopping=False):
                record, covered = self.window.row(m)
                self.log_().write("train", step, record)
                main = self.task.main_metric
                self.progress_().update(covered, {"loss": record["loss"], main: record.get(main, float("nan")),
                                                  "tok/s": record["tokens_per_s"]})

    def diagnose(self, tick: Tick) -> None:
        """train.diagnostics_every: per-layer residual ratios and gradient norms by depth on this step's
        examples (jaxblock.diagnostics, eval mode), recorded as split 'diag'."""
        self.drain(tick.state)
        params = self.runner.host_params(tick.state)  # every process takes part in the gather
        if not self.primary:
            return
        model, batch = self.task.build_model(self.cfg.model), self.batches.example_batch(tick.done - 1)
        ratios = residual_ratios(model, {"params": params}, batch)
        grads = grad_norms_by_depth(model, {"params": params}, batch, self.task.loss)
        self.log_().write("diag", tick.done, {**ratios.as_metrics(), **grads.as_metrics()})

    def validate(self, tick: Tick) -> None:
        self.drain(tick.state)
        tick.val = evaluate(self.task, self.runner, tick.state, self.batches, "validation", self.cfg.train.sync_every)
        self.log_().write("val", tick.done, tick.val)
        shown = " ".join(f"{m} {tick.val[m]:.4f}" for m in metric_names(self.task))
        self.progress_().write(f"step {tick.done}: validation {shown}")

    def checkpoint(self, tick: Tick) -> None:
        """Save (asynchronously if configured), never a non-finite state: the previous one stays newest.
        The metrics and TensorBoard events up to `done` are made durable first, so a kill after the
        checkpoint loses nothing it covers; the log window in progress is saved with it."""
        self.drain(tick.state)
        host_state = self.runner.unreplicate(tick.state)
        ckpts = self.ckpts_()
        if bool(self.runner.fetch(all_finite((host_state.params, host_state.opt_state)))):
            self.log_().flush()
            metrics = {f"val_{k}": v for k, v in tick.val.items()} if tick.val else None
            meta = {"seed": self.cfg.train.seed, "label_names": self.plan.dataset.label_names,
                    "data_state": self.batches.state(), "log_window": self.window.state()}
            with self.interrupts.critical(f"saving checkpoint {tick.done}"), \
                    saves_report_full_disk(ckpts.directory, tick.done):
                saved = ckpts.save(host_state, meta, metrics)
            if saved:
                return
        self.progress_().write(f"step {tick.done}: the state is non-finite; checkpoint skipped "
                               f"(the newest stays {ckpts.latest_step()})")

    def wait_for_saves(self, step: int | None) -> None:
        """Block until started saves are committed (signals held meanwhile); a full disk is one line."""
        ckpts = self.ckpts_()
        with saves_report_full_disk(ckpts.directory, step):
            self.interrupts.wait_for_saves(ckpts.wait, f"checkpoint {step}" if step is not None else "a save")

    def halt(self, state: TrainState, done: int, m: dict[str, float]) -> None:
        """Stop without saving; name the first non-finite block/sublayer on the step's own examples."""
        where = locate_nonfinite(self.cfg, self.runner.host_params(state), self.batches.example_batch(done - 1),
                                 self.task)
        self.wait_for_saves(None)  # report the newest checkpoint that is complete on disk
        raise halt_error(self.cfg, done, int(m["nonfinite_consecutive"]), where, self.ckpts_().latest_step())

    # --- the end of a session -------------------------------------------------------------------

    def best(self) -> dict[str, Any]:
        """The summary's best_* entries: the best validation so far, ranked as keep-best ranks checkpoints."""
        if not self.primary:
            return {}
        self.log_().flush()
        records = read_jsonl(self.plan.workdir / "metrics.jsonl")
        return best_fields(best_validation(records, self.rank_by, self.higher), self.rank_by,
                           list(metric_names(self.task)))

    def stopped(self, done: int) -> dict[str, Any]:
        """The summary of a session stopped by a signal: what it did, where to continue from."""
        latest = self.ckpts_().latest_step()
        return {"preempted": True, "step": done, "steps": self.cfg.train.steps,
                "session_steps": done - self.plan.start_step,
                "checkpoint": str(self.ckpts_().directory / str(latest)) if latest is not None else None,
                "workdir": str(self.plan.workdir), **self.best()}

    def finish(self, state: TrainState, val: dict[str, float] | None) -> dict[str, Any]:
        """Final validation (unless the last step just ran it) and test (on the best checkpoint when keeping
        the best, the one the summary's best validation names too)."""
        plan, total, log = self.plan, self.cfg.train.steps, self.log_()
        if val is None:  # a rerun of a finished run, which trained nothing this session
            val = evaluate(self.task, self.runner, state, self.batches, "validation", self.cfg.train.sync_every)
            log.write("val", total, val)
        test_step = self.ckpts_().best_step() or total
        if test_step != total:
            restored, _ = self.ckpts_().restore(test_step, self.runner.abstract_state(plan.abstract))
            state = self.runner.place_state(restored)
        test = evaluate(self.task, self.runner, state, self.batches, "test", self.cfg.train.sync_every)
        log.write("test", total, {**test, "checkpoint_step": test_step})
        names = list(metric_names(self.task))
        best = self.best() or best_fields({**val, "step": total}, self.rank_by, names)
        return {"steps": total, "session_steps": total - plan.start_step, **best,
                **prefixed("final_val_", val, names), **prefixed("test_", test, names),
                "test_checkpoint_step": test_step, "workdir": str(plan.workdir)}
