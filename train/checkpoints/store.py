"""Checkpoints of a run: an Orbax CheckpointManager over `<workdir>/checkpoints`, plus the files beside it.

A checkpoint step directory holds three items:
- `params`: the model parameters;
- `train`: optimizer state and the step counter;
- `meta` (JSON): step, the run seed, the label names and the batch source's reading position
  (`data_state`: None for the in-memory source, whose batch of step t is a pure function of (seed, t)).
That is everything needed to continue exactly: the dropout key of step t is fold_in(key(seed), t) and the
batch source restores its position from `data_state`, so no other iterator or key needs saving. Beside
the checkpoints, the workdir holds the resolved config
(`config.yaml`) and the tokenizer (`tokenizer/`), so `evaluate` and `predict` need nothing else.

Orbax writes each save into a temporary directory and renames it when complete; a save killed halfway
leaves only that temporary directory, which `latest_step` never reports, so a resume always starts from
the last complete checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from orbax.checkpoint import checkpoint_managers

from jaxblock.config import migrate_model
from train.checkpoints import event_loops
from train.config import DEFAULT_RULES, CheckpointConfig, Config, ConfigError, config_from_dict
from train.errors import CheckpointError, DamagedCheckpointError
from train.loop.state import TrainState

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"


class _ReadOnlyNotice(logging.Filter):
    """Drops Orbax's "Given directory is read only" warning, which it logs for every read-only manager:
    reading a run (resume checks, evaluate, predict, the inference API) is what we mean, not a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_ReadOnlyNotice())
event_loops.install()  # a failed restore or save leaves no task behind its closed event loop


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _preservation(cfg: CheckpointConfig) -> Any:
    if not cfg.keep_best:
        return checkpoint_managers.LatestN(n=cfg.max_to_keep)
    best = checkpoint_managers.BestN(
        get_metric_fn=_best_fn(cfg),
        reverse=cfg.best_mode == "min",  # the resolved config spells the mode out (train/tasks)
        n=cfg.max_to_keep,
        keep_checkpoints_without_metrics=False,
    )
    # The newest checkpoint always survives as well, so a resume never goes back to an older best one.
    return checkpoint_managers.AnyPreservationPolicy([checkpoint_managers.LatestN(n=1), best])


def latest_step(workdir: Path) -> int | None:
    """The newest complete checkpoint step, read without creating or changing anything."""
    directory = Path(workdir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return None
    with read_only_manager(directory) as manager:
        return manager.latest_step()


def _best_fn(cfg: CheckpointConfig) -> Any:
    """Orbax's ranking value of a save's metrics; the run's resolved config names the metric (train/tasks)."""
    return (lambda metrics: metrics[cfg.best_metric]) if cfg.keep_best and cfg.best_metric else None


def read_only_manager(directory: Path, cfg: CheckpointConfig | None = None) -> ocp.CheckpointManager:
    """A CheckpointManager that only reads `directory` (restore, verify): nothing is created or moved."""
    # Read-only with the options it implies spelled out: Orbax overrides (and logs a warning for) any
    # setting that would write, i.e. its defaults save_interval_steps=1 and create=True.
    options = ocp.CheckpointManagerOptions(
        read_only=True, save_interval_steps=0, create=False, enable_async_checkpointing=False,
        best_fn=_best_fn(cfg) if cfg is not None else None,
        best_mode=(cfg.best_mode if cfg is not None else None) or "max",
    )
    return ocp.CheckpointManager(directory.absolute(), options=options, item_handlers=_handlers())


class Checkpoints:
    """Save/restore of TrainStates for one workdir (all processes call every method)."""

    def __init__(self, workdir: Path, cfg: CheckpointConfig):
        self.cfg = cfg
        self.directory = (Path(workdir) / CHECKPOINT_DIR).absolute()
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_save,
            preservation_policy=_preservation(cfg),
            # best_fn makes Orbax record each save's metrics in the checkpoint, so the best is known later.
            best_fn=_best_fn(cfg),
            best_mode=cfg.best_mode or "max",
            # Leftovers of a save that was killed halfway are never reported as checkpoints; remove them.
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        return best_or_latest(self.manager, self.cfg) if self.manager.latest_step() is not None else None

    def save(self, state: TrainState, meta: dict[str, Any], metrics: dict[str, float] | None = None) -> bool:
        """Start saving `state` at its step (asynchronously if configured); returns whether it saved."""
        # Replicated: every process holds a copy, even when the array spans hosts.
        step = int(np.asarray(state.step.addressable_data(0) if isinstance(state.step, jax.Array) else state.step))
        items = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            train=ocp.args.StandardSave({"opt_state": state.opt_state, "step": state.step}),
            meta=ocp.args.JsonSave({**meta, "step": step}),
        )
        return bool(self.manager.save(step, args=items, metrics=metrics, force=True))

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Restore `step` into the shapes, dtypes and shardings of `target` (arrays or ShapeDtypeStructs,
        e.g. `Runner.abstract_state`): Orbax reads each shard where the target puts it, so a checkpoint
        saved on one device count or mesh restores onto any other."""
        abstract = jax.tree.map(_abstract, {"params": target.params, "opt_state": target.opt_state,
                                            "step": target.step})
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract["params"]),
            train=ocp.args.StandardRestore({"opt_state": abstract["opt_state"], "step": abstract["step"]}),
            meta=ocp.args.JsonRestore(),
        ))
        state = target.replace(
            params=restored["params"], opt_state=restored["train"]["opt_state"], step=restored["train"]["step"]
        )
        return state, dict(restored["meta"])

    def close(self) -> None:
        self.manager.close()


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _path_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_compatible(workdir: Path, step: int, params: Any) -> None:
    """Raise CheckpointError naming the first parameter whose shape differs from `params` (arrays or
    ShapeDtypeStructs built from the config), or that only one of the two has."""
    with read_only_manager(Path(workdir) / CHECKPOINT_DIR) as manager:
        try:
            saved = manager.item_metadata(step)["params"]
        except Exception as err:  # Orbax raises assorted errors for unreadable metadata
            raise DamagedCheckpointError(
                f"checkpoint {step} in {workdir} is unreadable ({err.__class__.__name__}): remove "
                f"{CHECKPOINT_DIR}/{step} to resume from an older one, or use a new --workdir"
            ) from None
    saved_tree = getattr(saved, "tree", saved)
    have = {_path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    want = {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    fix = "use the run's own config (omit --config to reuse it) or a new --workdir"
    for name in sorted(set(have) | set(want)):
        if name not in want:
            raise CheckpointError(f"checkpoint in {workdir} has parameter {name} that the config lacks: {fix}")
        if name not in have:
            raise CheckpointError(f"checkpoint in {workdir} lacks parameter {name} that the config has: {fix}")
        if have[name] != want[name]:
            raise CheckpointError(
                f"checkpoint in {workdir} does not match the config: parameter {name} has shape {have[name]} "
                f"in the checkpoint but {want[name]} from the config: {fix}"
            )


def read_run_config(workdir: Path) -> Config:
    """The resolved config saved in a workdir (CheckpointError if missing). A config.yaml written before
    the model keys were grouped (jaxblock.config.RENAMED) reads in the new layout."""
    path = Path(workdir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{workdir} holds no run ({CONFIG_FILE} missing): train first with "
                              f"python -m train --config CONFIG --workdir {workdir}")
    try:
        return config_from_dict(migrate_run_config(yaml.safe_load(path.read_text()) or {}))
    except (yaml.YAMLError, ConfigError) as err:
        raise CheckpointError(f"{path} is not a valid run config ({err}): restore it from the run") from None


# The default parallel.rules before activations had logical axes of their own: a run saved with them runs
# with today's defaults, which place parameters the same way and constrain activations too.
_DEFAULT_RULES_BEFORE_ACTIVATIONS = [
    ["batch", ["data", "fsdp"]], ["length", "context"], ["vocab", "tensor"], ["embed", "fsdp"], ["heads", "tensor"],
    ["kv_heads", "tensor"], ["mlp", "tensor"], ["head_dim", None], ["layers", None]]


def migrate_run_config(raw: Any) -> Any:
    """A saved run config (dict) in the current layout: its `model` section's keys (jaxblock.config
    .migrate_model), and the default parallel.rules of earlier releases replaced by today's. Earlier runs keep
    loading, resuming and serving as `model.init_from`."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    if isinstance(out.get("model"), dict):
        out["model"] = migrate_model(out["model"])
    parallel = out.get("parallel")
    if isinstance(parallel, dict) and _as_lists(parallel.get("rules")) == _DEFAULT_RULES_BEFORE_ACTIVATIONS:
        out["parallel"] = {**parallel, "rules": [[name, list(axes) if isinstance(axes, tuple) else axes]
                                                 for name, axes in DEFAULT_RULES]}
    return out


def _as_lists(value: Any) -> Any:
    return [_as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def inference_state(model: nn.Module, params: Any) -> TrainState:
    """A TrainState for `eval_step` that carries no optimizer state (evaluate/predict)."""
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.identity(), lr_schedule=lambda _: 0.0)


def best_or_latest(manager: ocp.CheckpointManager, cfg: CheckpointConfig) -> int:
    """The best checkpoint by `cfg.best_metric` when keeping the best (the manager must have been opened
    with that config), else the newest."""
    step = manager.best_step() if cfg.keep_best and cfg.best_metric else None
    if step is None:
        step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"no checkpoint in {manager.directory}: train first")
    return int(step)
