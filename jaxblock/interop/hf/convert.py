"""from_hf / to_hf / load_pretrained: transformers models and local checkpoint directories <-> our params."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from pydantic import ValidationError

from jaxblock.config import EncoderConfig, format_validation_error
from jaxblock.interop.hf import bert, llama
from jaxblock.interop.hf.common import (
    Mapping,
    UnsupportedConfigError,
    get_path,
    layout_to_hf,
    layout_to_ours,
    refuse,
    set_path,
)
from jaxblock.model import Classifier, Encoder

_FAMILIES: dict[str, ModuleType] = {f: bert for f in bert.FAMILIES} | {f: llama for f in llama.FAMILIES}
_PREFIX = {"bert": "bert", "roberta": "roberta", "distilbert": "distilbert",
           "llama": "model", "mistral": "model", "qwen2": "model"}
_CLASS = {"bert": "Bert", "roberta": "Roberta", "distilbert": "DistilBert",
          "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def _family(model_type: str) -> ModuleType:
    if model_type not in _FAMILIES:
        raise refuse("model_type", model_type, f"not converted: jaxblock reads {', '.join(_FAMILIES)}")
    return _FAMILIES[model_type]


def _maps(cfg: EncoderConfig, family: str, classifier: bool) -> list[Mapping]:
    mod = _family(family)
    rows = mod.encoder_map(cfg, family)
    if not classifier:
        return rows
    prefix = _PREFIX[family] + "."
    enc = [Mapping(prefix + r.hf_name, ("encoder", *r.path), r.kind) for r in rows]
    return enc + mod.head_map(family)


def _np(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        return t.detach().cpu().float().numpy()
    return np.asarray(t, np.float32)


# --- reading ------------------------------------------------------------------------------------


def _read_dir(path: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """(transformers config, state dict as float32 numpy) from a local directory; never downloads."""
    import transformers

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found: pass a directory written by save_pretrained")
    hf_cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    files = sorted(path.glob("model*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    sd: dict[str, np.ndarray] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            sd |= {k: _np(v) for k, v in load_file(str(f)).items()}
    elif (path / "pytorch_model.bin").is_file():
        import torch

        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        sd = {k: _np(v) for k, v in state.items()}
    else:
        raise FileNotFoundError(f"{path} holds no model.safetensors or pytorch_model.bin: save the weights there")
    # Old checkpoints name LayerNorm parameters gamma/beta.
    return hf_cfg, {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
                    for k, v in sd.items()}


def _is_classifier(hf_cfg: Any, model: Any = None) -> bool:
    name = type(model).__name__ if model is not None else ((hf_cfg.architectures or [""])[0])
    return name.endswith("ForSequenceClassification")


def _build(cfg: EncoderConfig, sd: dict[str, np.ndarray], family: str, classifier: bool) -> dict[str, Any]:
    """Fill our params tree (shapes from the module itself) from a state dict; every leaf must be mapped."""
    model = Classifier(cfg) if classifier else Encoder(cfg)
    tokens = jnp.zeros((1, 1), jnp.int32)
    shapes = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens > 0)))["params"]
    rows = _maps(cfg, family, classifier)
    # A base model's own keys are bare; a MaskedLM/CausalLM checkpoint nests them under its prefix.
    prefix = _PREFIX[family] + "." if not classifier and _PREFIX[family] + "." + rows[0].hf_name in sd else ""
    params: dict[str, Any] = {}
    dtype = cfg.block.params_dtype
    for row in rows:
        name = row.hf_name if classifier else prefix + row.hf_name
        if name not in sd:
            raise UnsupportedConfigError(f"state dict lacks {name}: the weights do not match config.json")
        shape = get_path(shapes, row.path).shape
        value = sd[name]
        if row.path[-1] == "pos_embedding":  # max_len may cap the checkpoint's positions: keep the first rows
            value = value[: shape[0]]
        set_path(params, row.path, jnp.asarray(layout_to_ours(value, shape, row.kind), dtype))
    missing = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)} - {
        "/".join(f"['{k}']" for k in r.path) for r in rows}
    if missing:  # a programming error in the maps, not a user mistake
        raise AssertionError(f"unmapped parameters: {sorted(missing)}")
    return params


def from_hf(
    source: Any, *, max_len: int | None = None, dtype: str = "float32", param_dtype: str = "float32",
    attention: str = "auto",
) -> tuple[EncoderConfig, dict[str, Any]]:
    """A transformers model object, or a local directory with config.json + model.safetensors
    (or pytorch_model.bin), -> (EncoderConfig, {"params": ...}).

    *ForSequenceClassification models give Classifier variables (params: encoder, [pooler], head) and
    the config's num_classes/pooling; any other architecture gives Encoder variables from its base model
    (a MaskedLM/CausalLM head or a base model's pooler is left out). `max_len` caps the positions
    (default: all the checkpoint has); dtype is our compute dtype. Raises UnsupportedConfigError (one line
    naming the field) for what cannot be expressed exactly.
    """
    if isinstance(source, str | Path):
        hf_cfg, sd = _read_dir(Path(source))
        classifier = _is_classifier(hf_cfg)
    else:
        hf_cfg, classifier = source.config, _is_classifier(source.config, source)
        sd = {k: _np(v) for k, v in source.state_dict().items()}
    family = hf_cfg.model_type
    mod = _family(family)
    fields = mod.encoder_fields(hf_cfg, family, max_len)
    fields["block"] |= {"dtype": dtype, "param_dtype": param_dtype, "attention": attention}
    if classifier:
        fields |= mod.head_fields(family) | {"num_classes": max(hf_cfg.num_labels, 2)}
        if hf_cfg.num_labels < 2:
            raise refuse("num_labels", hf_cfg.num_labels, "a regression head (one label) is not a Classifier")
    try:
        cfg = EncoderConfig.model_validate(fields)
    except ValidationError as err:
        raise UnsupportedConfigError(format_validation_error(err)) from None
    return cfg, {"params": _build(cfg, sd, family, classifier)}


# --- writing ------------------------------------------------------------------------------------


def guess_family(cfg: EncoderConfig) -> str:
    """The transformers family our config reads as (Mistral configs read as Llama: pass family='mistral')."""
    b = cfg.block
    if cfg.positions == "rope":
        return "qwen2" if b.has_qkv_bias and not b.has_out_bias else "llama"
    if cfg.position_offset:
        return "roberta"
    return "bert" if cfg.type_vocab_size else "distilbert"


def _plain(variables: Any) -> dict[str, Any]:
    p = nn.unbox(variables)
    return p.get("params", p)


def state_dict(config: EncoderConfig, variables: Any, *, family: str | None = None) -> dict[str, np.ndarray]:
    """Our params (or their gradients: the map is linear) -> transformers state-dict names, float32 numpy.
    Classifier variables (with 'encoder') give *ForSequenceClassification names."""
    p = _plain(variables)
    family = family or guess_family(config)
    classifier = "encoder" in p
    return {r.hf_name: layout_to_hf(np.asarray(get_path(p, r.path), np.float32), r.kind)
            for r in _maps(config, family, classifier)}


def to_hf(config: EncoderConfig, variables: Any, *, family: str | None = None, **hf_overrides: Any) -> Any:
    """(EncoderConfig, Encoder or Classifier variables) -> the transformers model holding the same weights
    (BertModel ... Qwen2Model, or *ForSequenceClassification for Classifier variables), in eval mode.

    family: 'bert', 'roberta', 'distilbert', 'llama', 'mistral' or 'qwen2' (default: guess_family).
    hf_overrides go to the transformers config (e.g. pad_token_id). A field transformers cannot express
    raises UnsupportedConfigError naming it. A base model is built without a pooler.
    """
    import torch
    import transformers

    family = family or guess_family(config)
    mod = _family(family)
    p = _plain(variables)
    classifier = "encoder" in p
    hf_cfg = mod.hf_config(config, family, classifier, hf_overrides)
    cls = getattr(transformers, _CLASS[family] + ("ForSequenceClassification" if classifier else "Model"))
    extra = {"add_pooling_layer": False} if family in ("bert", "roberta") and not classifier else {}
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = cls(hf_cfg, **extra).to(torch_dtype[config.block.param_dtype])
    sd = state_dict(config, {"params": p}, family=family)
    expected = model.state_dict()
    if set(sd) != set(expected):
        raise UnsupportedConfigError(f"{cls.__name__} holds {sorted(set(expected) ^ set(sd))[:3]} that the variables "
                                "do not (or the reverse): pass the variables built for this config")
    model.load_state_dict({k: torch.from_numpy(np.array(v)).to(expected[k].dtype) for k, v in sd.items()}, strict=True)
    return model.eval()


def load_pretrained(
    path: str | Path, *, max_len: int | None = None, dtype: str = "float32"
) -> tuple[EncoderConfig, dict[str, Any], Path | None, Path | None]:
    """One call for a trainer: (EncoderConfig, Encoder params (plain tree, no 'params' wrapper),
    tokenizer.json path or None, license file path or None) from a local checkpoint directory.

    The config's pooling is the family's own sequence-classification pooling ('cls' with its pooler
    activation for BERT-family, 'last' for Llama-family), so a Classifier built from it mirrors
    transformers' *ForSequenceClassification; its pooler and head start fresh (set num_classes).
    A classifier checkpoint gives its encoder only."""
    path = Path(path)
    cfg, variables = from_hf(path, max_len=max_len, dtype=dtype)
    params = variables["params"]
    params = params.get("encoder", params)
    family = _FAMILIES[guess_family(cfg)]
    cfg = cfg.model_copy(update=family.head_fields(guess_family(cfg)))
    tok = path / "tokenizer.json"
    lic = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().startswith(("license", "licence")))
    return cfg, params, tok if tok.is_file() else None, lic[0] if lic else None
