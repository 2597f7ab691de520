"""What a run takes from its `model.init_from` checkpoint (`Source`), whichever loader read it
(train/init_from/hf.py for hf:<dir>, train/init_from/run_source.py for a run's workdir)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jaxblock.config import EncoderConfig, format_validation_error
from train.data.tokenizer import Tokenizer
from train.errors import ConfigError

HF_PREFIX = "hf:"
_ENCODER_KEYS = frozenset(EncoderConfig.model_fields)


@dataclass
class Source:
    """What a run takes from its `model.init_from` checkpoint."""

    spec: str
    model: EncoderConfig  # the checkpoint's config; its max_len is the positions it holds
    tokenizer: Tokenizer | None  # None on resume: the run's own tokenizer/ is used
    encoder: Any = None  # host float32 numpy params of `Encoder` (plain tree); None on resume
    files: dict[str, Path] = field(default_factory=dict)  # name in <workdir>/init/ -> file to copy
    record: dict[str, Any] = field(default_factory=dict)  # what run.json records about it


def encoder_config(model: dict[str, Any], spec: str) -> EncoderConfig:
    """The EncoderConfig fields of a dumped model config (ConfigError naming the source when invalid)."""
    try:
        return EncoderConfig.model_validate({k: v for k, v in model.items() if k in _ENCODER_KEYS})
    except ValidationError as err:
        raise ConfigError(f"model.init_from={spec}: its model config is invalid ({format_validation_error(err)})"
                          ) from None
