"""model.init_from=<workdir>[@<step>]: one of our runs (a classifier or a masked-LM pretraining run) as an
init_from Source: its latest checkpoint (or <step>), restored through train.checkpoints.restore."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np

from train.checkpoints.restore import restore_run
from train.checkpoints.store import CONFIG_FILE
from train.errors import CheckpointError, ConfigError, DataError
from train.init_from.source import Source, encoder_config


def run_source(spec: str) -> Source:
    """Config, encoder weights, tokenizer and config file of the run `spec` names."""
    match = re.fullmatch(r"(.*)@(\d+)", spec)
    path, step = (Path(match[1]), int(match[2])) if match else (Path(spec), None)
    fix = "pass a run's --workdir (or <workdir>@<step>), or hf:<dir> for a transformers checkpoint"
    if not path.is_dir():
        raise ConfigError(f"model.init_from={spec}: {path} is not a directory: {fix}")
    if not (path / CONFIG_FILE).is_file():
        if (path / "config.json").is_file():
            fix = f"it holds config.json, so write model.init_from=hf:{path} for a transformers checkpoint"
        raise ConfigError(f"model.init_from={spec}: {path} holds no run ({CONFIG_FILE} missing): {fix}")
    try:
        run = restore_run(path, step, prefer="latest")
    except (CheckpointError, DataError) as err:
        raise ConfigError(f"model.init_from={spec}: {err}".replace("pass one of them to --step",
                                                                   "pick one of them (<workdir>@<step>)")) from None
    if not isinstance(run.params, dict) or "encoder" not in run.params:
        raise ConfigError(f"model.init_from={spec}: checkpoint {run.step} holds no encoder parameters: start from a "
                          "classifier or masked-LM run")
    return Source(spec, encoder_config(run.config.model.model_dump(mode="json"), spec), run.tokenizer,
                  jax.tree.map(np.asarray, run.params["encoder"]), {CONFIG_FILE: path / CONFIG_FILE},
                  {"kind": "run", "path": str(path.absolute()), "step": run.step})
