"""`model.init_from`: start a run's encoder from a pretrained checkpoint, with a fresh head.

    model.init_from=hf:<dir>            a local transformers checkpoint directory (never a download)
    model.init_from=<workdir>[@<step>]  one of our runs (a classifier or a masked-LM pretraining run):
                                        its latest checkpoint, or checkpoint <step>

Both trees keep the encoder's parameters under `encoder` (Classifier and jaxblock.MaskedLM alike), so the
pretrained part is exactly `Encoder`'s tree. What comes from the checkpoint:
- the model's shape: every key of `model` that changes a parameter's shape or what the pretrained weights
  compute (widths, heads, layers, norms, activation, positions, biases, vocabulary, ...). A key the user
  sets to another value is refused in one line naming it and both values. The keys in FREE_KEYS (dropout,
  pooling and head, dtypes, attention kernel, scan/remat, max_len within the checkpoint's positions) may be
  set; unset, they too come from the checkpoint (a BERT brings its dropout and its [CLS] pooler, a
  Llama-family model its last-token pooling);
- the tokenizer: the run's `tokenizer/`, or the checkpoint's `tokenizer.json` (train.data.tokenizer
  .PretrainedTokenizer), saved into the new run's `tokenizer/` so evaluate and predict use it;
- the encoder's weights, grafted into the fresh state (`graft`) only when a run starts: a resumed run
  restores its own checkpoint and never reads the source again (its shape then comes from its own
  config.yaml). The head (pooler, classifier) starts from the seeded init.
The source's config (config.json or config.yaml) and license file are copied into `<workdir>/init/`.
Errors are one-line ConfigErrors (exit 2) raised before anything is written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from pydantic import BaseModel

from jaxblock.config import EncoderConfig
from jaxblock.model import stack_layer_params, unstack_layer_params
from train.checkpoints.store import read_run_config
from train.config import Config, ConfigError, config_from_dict, parse_override
from train.data.tokenizer import Tokenizer
from train.init_from.hf import hf_source
from train.init_from.run_source import run_source
from train.init_from.source import HF_PREFIX, Source, encoder_config

__all__ = ["FREE_KEYS", "HF_PREFIX", "INIT_DIR", "SOURCES", "Source", "adopt", "check_vocab", "conform", "copy_files",
           "drop_file_shape", "graft", "load_source"]

INIT_DIR = "init"  # <workdir>/init/: the source's config and license, copied when the run starts

# Keys of `model` (dotted below it) that neither change a parameter's shape nor what the pretrained
# weights compute; every other key is the checkpoint's. vocab_size is the checkpoint's too (set after the
# tokenizer resolves it), and max_len is checked against the checkpoint's positions (learned or RoPE).
FREE_KEYS = frozenset({
    "init_from", "max_len", "num_classes", "pooler.pooling", "pooler.activation", "embedding.dropout",
    "scan_layers", "remat", "block.ffn_dropout", "block.residual_dropout", "block.dtype", "block.param_dtype",
    "block.init", "block.attention.dropout", "block.attention.kernel", "block.attention.chunk_size",
    "block.attention.fused_qkv",
})


def _group(cls: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The config class of key group `name` of `cls` (block, block.attention, embedding, ...), else None."""
    field = cls.model_fields.get(name)
    ann = field.annotation if field is not None else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _flat(tree: dict[str, Any], cls: type[BaseModel] = EncoderConfig, prefix: str = "") -> dict[str, Any]:
    """A dumped EncoderConfig as dotted keys (every group opened: block.attention.dropout); values stay as
    dumped (a rope_scaling mapping is one value)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        group = _group(cls, key)
        if group is not None and isinstance(value, dict):
            out |= _flat(value, group, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `_flat`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *groups, name = key.split(".")
        node = out
        for group in groups:
            node = node.setdefault(group, {})
        node[name] = value
    return out


def _set_keys(model: BaseModel, prefix: str = "") -> set[str]:
    """The dotted keys of `model` given explicitly (in the YAML or an override), not left at defaults."""
    keys: set[str] = set()
    for name in model.model_fields_set:
        if _group(type(model), name) is not None:
            keys |= _set_keys(getattr(model, name), f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def drop_file_shape(config: Config, overrides: list[str]) -> Config:
    """With model.init_from set: forget the shape keys a config file set (the checkpoint decides them)
    while keeping those given as command-line overrides, which `adopt` then checks against the checkpoint.
    Free keys (dropout, pooling, ...) keep their config-file values."""
    if not config.model.init_from:
        return config
    overridden: set[str] = set()

    def note(key: str, value: Any) -> None:  # the key and every key above it count as given
        parts = key.split(".")
        overridden.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        if isinstance(value, dict):
            for k, v in value.items():
                note(f"{key}.{k}" if key else str(k), v)

    for item in overrides:
        path, value = parse_override(item)
        if path[:1] == ["model"]:
            note(".".join(path[1:]), value)
    raw = config.model_dump(mode="json", exclude_unset=True)
    model = _flat(raw.get("model", {}), type(config.model))
    raw["model"] = _nested({k: v for k, v in model.items() if k in FREE_KEYS or k in overridden})
    return config_from_dict(raw)


def adopt(config: Config, source: Source) -> Config:
    """The config with the checkpoint's shape: unset model keys take the checkpoint's values; a set shape
    key that differs is refused (ConfigError naming it and both values); max_len must fit the
    checkpoint's positions (unset, it is the smaller of the default and the checkpoint's)."""
    src = source.model
    mine = _flat(config.model.model_dump(mode="json"), type(config.model))
    theirs = _flat(src.model_dump(mode="json"))
    given = _set_keys(config.model)
    merged: dict[str, Any] = {}
    for key, value in theirs.items():
        if key not in given or key == "vocab_size":
            merged[key] = value
            continue
        if key not in FREE_KEYS and mine[key] != value:
            raise ConfigError(
                f"model.{key}={mine[key]!r} contradicts the checkpoint of model.init_from={source.spec}, which has "
                f"{value!r}: drop that setting (the model's shape comes from the checkpoint)")
        merged[key] = mine[key]
    # Learned positions end with the table; RoPE ends where the checkpoint's context (or sliding window,
    # which full attention reproduces only within it) ends. Sinusoidal and no positions have no end.
    if src.embedding.positions == "learned" or src.block.attention.rope:
        if "max_len" not in given:
            merged["max_len"] = min(mine["max_len"], src.max_len)
        elif mine["max_len"] > src.max_len:
            raise ConfigError(
                f"model.max_len={mine['max_len']} exceeds the {src.max_len} positions of the checkpoint of "
                f"model.init_from={source.spec}: set model.max_len<={src.max_len} (and data.max_len, data.buckets "
                "within it)")
    model = _nested(merged)
    model["init_from"] = source.spec
    raw = config.model_dump(mode="json")
    raw["model"] = model
    kind = source.tokenizer.kind if source.tokenizer is not None else raw["data"]["tokenizer"]
    if kind in ("byte", "bpe", "pretrained"):
        raw["data"]["tokenizer"] = kind
    elif raw["data"]["source"] != "synthetic":  # IdTokenizer: integer symbols only
        raise ConfigError(f"the run of model.init_from={source.spec} tokenizes synthetic symbols ('{kind}'): "
                          "fine-tune it on data.source=synthetic, or start from a run trained on text")
    return config_from_dict(raw)


def check_vocab(config: Config, source: Source, tokenizer: Tokenizer) -> Config:
    """After `run.resolve` sized the vocabulary from the tokenizer: the checkpoint's embedding decides
    (it may hold more rows than the tokenizer has ids, never fewer)."""
    if tokenizer.vocab_size > source.model.vocab_size:
        raise ConfigError(f"the tokenizer of model.init_from={source.spec} has {tokenizer.vocab_size} ids but the "
                          f"checkpoint embeds {source.model.vocab_size}: use the checkpoint's own tokenizer")
    return config.model_copy(update={"model": config.model.model_copy(update={"vocab_size": source.model.vocab_size})})


# --- reading a source ----------------------------------------------------------------------------


def load_source(spec: str, workdir: Path, *, resuming: bool) -> Source:
    """The checkpoint `spec` names: its config, tokenizer and encoder weights. When `resuming`, the run's
    own config.yaml in `workdir` stands for it (nothing of the source is read). ConfigError if unusable."""
    if resuming:
        saved = read_run_config(workdir).model
        return Source(spec, encoder_config(saved.model_dump(mode="json"), spec), None)
    load = next(loader for prefix, loader in SOURCES if spec.startswith(prefix))
    return load(spec)


# The source table: the first entry whose prefix `model.init_from` starts with loads it.
SOURCES: tuple[tuple[str, Callable[[str], Source]], ...] = ((HF_PREFIX, hf_source), ("", run_source))


# --- the weights --------------------------------------------------------------------------------


def conform(encoder: Any, model: EncoderConfig, target: Any, spec: str) -> Any:
    """The source's encoder params shaped as `target` (the new model's encoder, shapes only): the learned
    position table cut to the new max_len, layers stacked or unstacked for scan_layers, cast to the
    parameter dtype. ConfigError naming the first parameter that still differs."""
    enc = dict(encoder)
    if "pos_embedding" in enc:
        enc["pos_embedding"] = enc["pos_embedding"][: model.max_len + model.embedding.position_offset]
    stack = enc.get("stack", {})
    if model.scan_layers and "layers" not in stack:
        enc["stack"] = jax.tree.map(np.asarray, stack_layer_params(stack))
    elif not model.scan_layers and "layers" in stack:
        enc["stack"] = jax.tree.map(np.asarray, unstack_layer_params(stack))
    have = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(enc)}
    want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(target)}
    for name in sorted(set(have) | set(want)):
        if name not in have or name not in want or tuple(have[name].shape) != tuple(want[name].shape):
            got = tuple(have[name].shape) if name in have else "nothing"
            need = tuple(want[name].shape) if name in want else "nothing"
            raise ConfigError(f"model.init_from={spec}: encoder parameter {name} is {got} in the checkpoint but "
                              f"{need} in this model: use the checkpoint's model settings")
    return jax.tree.map(lambda x, t: np.asarray(x, t.dtype), enc, target)


def graft(params: Any, encoder: Any) -> Any:
    """The fresh params (Classifier: encoder, [pooler], head) with the pretrained encoder in place."""
    return {**params, "encoder": encoder}


def copy_files(source: Source, workdir: Path) -> None:
    """The source's config and license into <workdir>/init/ (primary process, when the run starts)."""
    if not source.files:
        return
    directory = workdir / INIT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    for name, path in source.files.items():
        shutil.copyfile(path, directory / name)
    (directory / "source.json").write_text(json.dumps(source.record, indent=2) + "\n")
