"""HuggingFace `transformers` checkpoints <-> jaxblock Encoder / Classifier.

    config, variables = from_hf(model_or_dir)     # EncoderConfig, {"params": ...}; .family names it
    model = to_hf(config, variables)              # the transformers model, identical state dict
    print(compare(model, tokens, valid_tokens))   # per-layer forward and per-parameter gradient parity
    cfg, params, tokenizer_json, license = load_pretrained(dir)   # what a trainer needs

Families are a registry (jaxblock.interop.hf.family; one module each in families/): BERT, RoBERTa,
XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA (Post-LN, learned positions), Llama, Mistral, Qwen2
(Pre-RMSNorm, SwiGLU, RoPE, GQA, causal) and ModernBERT (Pre-LN, GeGLU, RoPE with per-layer bases,
sliding-window attention on local layers), with their *ForSequenceClassification heads. The family table
with measured parity and how to add a family: docs/families.md. Anything not expressible exactly raises
UnsupportedConfigError with one line naming the field. A directory is read locally (config.json +
*.safetensors, sharded or not, or pytorch_model.bin): nothing is ever downloaded.

Reading a directory (from_hf(dir), load_pretrained) needs neither transformers nor torch; to_hf, compare,
from_hf(model object) and pytorch_model.bin files do (the `hf` extra). `compare` and `TOLERANCES`
import torch when first used. Importing `jaxblock` imports none of this.
"""

from typing import Any

from jaxblock.interop.hf.common import UnsupportedConfigError
from jaxblock.interop.hf.convert import from_hf, guess_family, load_pretrained, read_config, state_dict, to_hf
from jaxblock.interop.hf.family import Family, HFConfig, families, family, register, unregister

__all__ = ["TOLERANCES", "Family", "HFConfig", "UnsupportedConfigError", "compare", "families", "family",
           "from_hf", "guess_family", "load_pretrained", "read_config", "register", "state_dict", "to_hf",
           "unregister"]


def __getattr__(name: str) -> Any:
    if name in ("compare", "TOLERANCES"):  # they import torch: only on use
        from jaxblock.interop.hf import parity

        return getattr(parity, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
