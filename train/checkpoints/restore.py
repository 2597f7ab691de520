"""The one way to read a trained run's parameters back: `restore_run` -> `RestoredRun`.

Evaluate, predict, diagnose, the inference API, `model.init_from=<workdir>` and the tests all restore
through it. It reads the run's resolved config (`config.yaml`, plus any overrides), its tokenizer
(`tokenizer/`) and one checkpoint's parameters onto one device, read-only (no lock, nothing moved), so it
works while the run trains. Errors are one-line CheckpointErrors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax
import orbax.checkpoint as ocp

from train.checkpoints.repair import committed_steps, describe_damage, quiet_stderr, restore_newest_good
from train.checkpoints.store import (
    CHECKPOINT_DIR,
    TOKENIZER_DIR,
    best_or_latest,
    check_compatible,
    read_only_manager,
    read_run_config,
)
from train.config import Config, apply_overrides, config_from_dict
from train.data.tokenizer import Tokenizer, load_tokenizer
from train.errors import CheckpointError
from train.loop.state import abstract_init
from train.tasks import registry


@dataclass(frozen=True)
class RestoredRun:
    """A run's checkpoint as restored: what evaluation, prediction and fine-tuning start from."""

    workdir: Path
    step: int  # the checkpoint restored
    config: Config  # the run's resolved config (with the overrides applied)
    params: Any  # the model's parameters, on one device
    tokenizer: Tokenizer
    label_names: list[str]  # the classes (empty for a task without them)
    notes: list[str] = field(default_factory=list)  # lines the user should see (a damaged checkpoint skipped)


def restore_run(workdir: Path | str, step: int | None = None, *, overrides: list[str] | None = None,
                prefer: Literal["best", "latest"] = "best") -> RestoredRun:
    """Checkpoint `step` of the run in `workdir`; `step` None: the best checkpoint when the run keeps the
    best ones (`prefer="best"`), else the latest; if that one is damaged, the newest that restores, with a
    note naming the damage. A missing `step` lists the steps that exist; a damaged one names the newest
    that restores. `overrides` (key=value) change the saved config, e.g. a moved data.path."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise CheckpointError(f"workdir {workdir} does not exist: pass the --workdir of a trained run")
    config = read_run_config(workdir)
    if overrides:
        config = config_from_dict(apply_overrides(config.model_dump(mode="json"), list(overrides)))
    tokenizer = load_tokenizer(workdir / TOKENIZER_DIR)
    directory = (workdir / CHECKPOINT_DIR).absolute()
    steps = committed_steps(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint in {workdir}: train first with python -m train "
                              f"--config CONFIG --workdir {workdir}")
    if step is not None and step not in steps:
        raise CheckpointError(f"no checkpoint {step} in {workdir}: it has checkpoints "
                              f"{', '.join(map(str, steps))}; pass one of them to --step")
    tasks = registry()
    if config.task not in tasks:
        raise CheckpointError(f"the run in {workdir} has task={config.task}, which this version does not know: "
                              f"use the version that trained it (tasks here: {', '.join(sorted(tasks))})")
    model = tasks[config.task].from_config(config).build_model(config.model)  # the run's own model
    shapes = abstract_init(model, config.data.buckets[-1])[0]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)

    def restored(used: int, value: Any, notes: list[str]) -> RestoredRun:
        return RestoredRun(workdir, used, config, value["params"], tokenizer, list(value["meta"]["label_names"]),
                           notes)

    with read_only_manager(directory, config.checkpoint if prefer == "best" else None) as manager:
        chosen = step if step is not None else (best_or_latest(manager, config.checkpoint) if prefer == "best"
                                                else steps[-1])

        def restore(s: int) -> Any:
            check_compatible(workdir, s, shapes)
            return manager.restore(s, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))

        with quiet_stderr():
            try:
                return restored(chosen, restore(chosen), [])
            except Exception as err:
                reason = describe_damage(err, directory / str(chosen))
                if reason is None:
                    raise
        others = [s for s in steps if s != chosen]
        found = (restore_newest_good(directory, restore, steps=others, primary=False, together=False)
                 if others else None)
        if found is None or found.step is None:
            raise CheckpointError(f"checkpoint {chosen} in {workdir} is damaged ({reason}) and no other "
                                  "checkpoint restores: train again in a new --workdir")
        if step is not None:
            raise CheckpointError(f"checkpoint {chosen} in {workdir} is damaged ({reason}): pass --step "
                                  f"{found.step}, the newest that restores")
        note = (f"checkpoint {chosen} is damaged ({reason}); using checkpoint {found.step} (the next training "
                "run on this workdir moves the damaged one aside)")
        return restored(found.step, found.value, [note])
