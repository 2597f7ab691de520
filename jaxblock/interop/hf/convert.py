"""from_hf / to_hf / load_pretrained: transformers models and local checkpoint directories <-> our params.

Reading a directory needs neither PyTorch nor transformers: config.json is read as JSON over the family's
defaults (jaxblock.interop.hf.family), *.safetensors through safetensors' NumPy loader (bfloat16 and
sharded files included). Only pytorch_model.bin files and writing (to_hf) need torch and transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from pydantic import ValidationError

from jaxblock.config import EncoderConfig, PoolerConfig, format_validation_error
from jaxblock.initializers import abstract_params
from jaxblock.interop.hf.common import (
    Mapping,
    UnsupportedConfigError,
    get_path,
    layout_to_hf,
    layout_to_ours,
    refuse,
    set_path,
    take_part,
)
from jaxblock.interop.hf.family import Family, HFConfig, family, guess
from jaxblock.model import Classifier, Encoder


class Converted(tuple):  # type: ignore[type-arg]
    """A result tuple (unpacks as before) that also says which family it was read as: `.family`."""

    family: str

    def __new__(cls, items: tuple[Any, ...], family_name: str) -> Converted:
        out = super().__new__(cls, items)
        out.family = family_name
        return out


def _maps(cfg: EncoderConfig, fam: Family, classifier: bool) -> list[Mapping]:
    rows = fam.encoder_map(cfg)
    if not classifier:
        return rows
    enc = [r._replace(hf_name=f"{fam.prefix}.{r.hf_name}", path=("encoder", *r.path)) for r in rows]
    return enc + fam.head_map(cfg)


def _np(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        return t.detach().cpu().float().numpy()
    return np.asarray(t, np.float32)


# --- reading ------------------------------------------------------------------------------------


def _read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    sd: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(f), framework="np") as st:  # bfloat16 arrives as ml_dtypes.bfloat16
            sd |= {k: np.asarray(st.get_tensor(k), np.float32) for k in st.keys()}  # noqa: SIM118
    return sd


def _read_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise UnsupportedConfigError(f"{path} is a PyTorch pickle and torch is not installed: pip install "
                                     "'jaxblock[hf]', or save the checkpoint as safetensors") from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: _np(v) for k, v in state.items()}


def read_config(path: str | Path) -> tuple[Family, HFConfig]:
    """(family, config over its defaults) of a local checkpoint directory's config.json; no transformers."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found: pass a directory written by save_pretrained")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UnsupportedConfigError(f"{path}/config.json is not JSON ({err.__class__.__name__}): "
                                     "write it again with save_pretrained") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise refuse("model_type", None, f"{path}/config.json names no model_type: add the checkpoint's")
    fam = family(raw["model_type"])
    return fam, fam.config(raw)


def _read_dir(path: Path) -> tuple[Family, HFConfig, dict[str, np.ndarray]]:
    """(family, config, state dict as float32 numpy) from a local directory; never downloads."""
    fam, hf_cfg = read_config(path)
    files = sorted(path.glob("model*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if files:
        sd = _read_safetensors(files)
    elif (path / "pytorch_model.bin").is_file():
        sd = _read_bin(path / "pytorch_model.bin")
    else:
        raise FileNotFoundError(f"{path} holds no model.safetensors or pytorch_model.bin: save the weights there")
    # Old checkpoints name LayerNorm parameters gamma/beta.
    return fam, hf_cfg, {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"):
                         v for k, v in sd.items()}


def _is_classifier(hf_cfg: HFConfig, model: Any = None) -> bool:
    name = type(model).__name__ if model is not None else ((hf_cfg.architectures or [""])[0])
    return name.endswith("ForSequenceClassification")


def _build(cfg: EncoderConfig, sd: dict[str, np.ndarray], fam: Family, classifier: bool) -> dict[str, Any]:
    """Fill our params tree (shapes from the module itself) from a state dict; every leaf must be mapped."""
    model = Classifier(cfg) if classifier else Encoder(cfg)
    shapes = nn.unbox(abstract_params(model))
    rows = _maps(cfg, fam, classifier)
    # A base model's own keys are bare; a MaskedLM/CausalLM checkpoint nests them under its prefix.
    first = next(r.hf_name for r in rows if r.kind != "ones")
    prefix = fam.prefix + "." if not classifier and f"{fam.prefix}.{first}" in sd else ""
    params: dict[str, Any] = {}
    dtype = cfg.block.params_dtype
    for row in rows:
        shape = get_path(shapes, row.path).shape
        if row.kind == "ones":
            set_path(params, row.path, jnp.ones(shape, dtype))
            continue
        name = row.hf_name if classifier else prefix + row.hf_name
        if name not in sd:
            raise UnsupportedConfigError(f"state dict lacks {name}: the weights do not match config.json")
        value = take_part(sd[name], row.part)
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
    kernel: str = "auto",
) -> Converted:
    """A transformers model object, or a local directory with config.json + *.safetensors
    (or pytorch_model.bin), -> (EncoderConfig, {"params": ...}); `.family` on the result names the family.

    *ForSequenceClassification models give Classifier variables (params: encoder, [pooler], head) and
    the config's num_classes/pooler; any other architecture gives Encoder variables from its base model
    (a MaskedLM/CausalLM head or a base model's pooler is left out). `max_len` caps the positions
    (default: all the checkpoint has); dtype is our compute dtype, kernel our block.attention.kernel.
    Raises UnsupportedConfigError (one line
    naming the field) for what cannot be expressed exactly. A directory is read without torch/transformers.
    """
    if isinstance(source, str | Path):
        fam, hf_cfg, sd = _read_dir(Path(source))
        classifier = _is_classifier(hf_cfg)
    else:
        fam = family(source.config.model_type)
        hf_cfg = fam.config(source.config.to_dict())
        classifier = _is_classifier(hf_cfg, source)
        sd = {k: _np(v) for k, v in source.state_dict().items()}
    fields = fam.encoder_fields(hf_cfg, max_len)
    fields["block"] |= {"dtype": dtype, "param_dtype": param_dtype}
    fields["block"]["attention"] = fields["block"].get("attention", {}) | {"kernel": kernel}
    if classifier:
        if hf_cfg.num_labels < 2:
            raise refuse("num_labels", hf_cfg.num_labels, "a regression head (one label) is not a Classifier")
        fields |= {"pooler": fields.get("pooler", {}) | fam.head_fields(hf_cfg), "num_classes": hf_cfg.num_labels}
    try:
        cfg = EncoderConfig.model_validate(fields)
    except ValidationError as err:
        raise UnsupportedConfigError(format_validation_error(err)) from None
    return Converted((cfg, {"params": _build(cfg, sd, fam, classifier)}), fam.name)


# --- writing ------------------------------------------------------------------------------------


def guess_family(cfg: EncoderConfig) -> str:
    """The family to_hf writes when none is named (Mistral, XLM-R, CamemBERT read as Llama/RoBERTa: name them)."""
    return guess(cfg).name


def _plain(variables: Any) -> dict[str, Any]:
    p = nn.unbox(variables)
    return p.get("params", p)


def state_dict(config: EncoderConfig, variables: Any, *, family: str | None = None) -> dict[str, np.ndarray]:
    """Our params (or their gradients: the map is linear) -> transformers state-dict names, float32 numpy.
    Classifier variables (with 'encoder') give *ForSequenceClassification names."""
    p = _plain(variables)
    fam = _family_of(config, family)
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for r in _maps(config, fam, "encoder" in p):
        if r.kind != "ones":
            parts.setdefault(r.hf_name, []).append(
                (r.part[0], layout_to_hf(np.asarray(get_path(p, r.path), np.float32), r.kind)))
    return {name: np.concatenate([a for _, a in sorted(ps, key=lambda t: t[0])]) if len(ps) > 1 else ps[0][1]
            for name, ps in parts.items()}


def _family_of(config: EncoderConfig, name: str | None) -> Family:
    return family(name) if name is not None else guess(config)


def to_hf(config: EncoderConfig, variables: Any, *, family: str | None = None, **hf_overrides: Any) -> Any:
    """(EncoderConfig, Encoder or Classifier variables) -> the transformers model holding the same weights
    (<Family>Model, or <Family>ForSequenceClassification for Classifier variables), in eval mode.

    family: a registered family's name or model_type (default: guess_family). hf_overrides go to the
    transformers config (e.g. pad_token_id). A field transformers cannot express raises
    UnsupportedConfigError naming it. A base model is built without a pooler.
    """
    import torch
    import transformers

    fam = _family_of(config, family)
    p = _plain(variables)
    classifier = "encoder" in p
    kwargs = fam.hf_config(config, classifier) | hf_overrides
    hf_cfg = getattr(transformers, fam.hf_class + "Config")(**kwargs)
    cls = getattr(transformers, fam.hf_class + ("ForSequenceClassification" if classifier else "Model"))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = cls(hf_cfg, **({} if classifier else dict(fam.base_kwargs))).to(torch_dtype[config.block.param_dtype])
    sd = state_dict(config, {"params": p}, family=fam.name)
    expected = model.state_dict()
    if set(sd) != set(expected):
        raise UnsupportedConfigError(f"{cls.__name__} holds {sorted(set(expected) ^ set(sd))[:3]} that the variables "
                                     "do not (or the reverse): pass the variables built for this config")
    model.load_state_dict({k: torch.from_numpy(np.array(v)).to(expected[k].dtype) for k, v in sd.items()}, strict=True)
    return model.eval()


def load_pretrained(
    path: str | Path, *, max_len: int | None = None, dtype: str = "float32"
) -> Converted:
    """One call for a trainer: (EncoderConfig, Encoder params (plain tree, no 'params' wrapper),
    tokenizer.json path or None, license file path or None) from a local checkpoint directory;
    `.family` on the result names the family. Needs neither torch nor transformers (safetensors files).

    The config's pooler is the family's own sequence-classification head's (pooling, activation
    and norm), so a Classifier built from it mirrors transformers' *ForSequenceClassification; its pooler
    and head start fresh (set num_classes). A classifier checkpoint gives its encoder only."""
    path = Path(path)
    converted = from_hf(path, max_len=max_len, dtype=dtype)
    cfg, variables = converted
    params = variables["params"]
    params = params.get("encoder", params)
    fam, hf_cfg = read_config(path)
    pooler = PoolerConfig.model_validate(cfg.pooler.model_dump() | fam.head_fields(hf_cfg))
    cfg = cfg.model_copy(update={"pooler": pooler})
    tok = path / "tokenizer.json"
    lic = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().startswith(("license", "licence")))
    return Converted((cfg, params, tok if tok.is_file() else None, lic[0] if lic else None), fam.name)
