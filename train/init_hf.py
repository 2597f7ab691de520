"""model.init_from=hf:<dir>: a local transformers checkpoint as an init_from Source (train/init_from.py)."""

from __future__ import annotations

from train.config import ConfigError
from train.init_from import Source


def hf_source(spec: str) -> Source:
    raise ConfigError(f"model.init_from={spec}: not yet")
