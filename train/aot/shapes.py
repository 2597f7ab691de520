"""A run's config resolved for ahead-of-time compilation: its shapes without data or weights, its mesh, and
the abstract state and batches a step is compiled for (`python -m train lower` and `compile`).

Nothing of the weights or the data is read: with model.init_from the shape comes from the checkpoint's
config (a run's config.yaml or a transformers config.json), and when that checkpoint is not on this machine,
from the shape the config states. The vocabulary and classes come from the config (a trained BPE
vocabulary is at most data.bpe_vocab_size). Nothing is written.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from train.config import MESH_AXES, STREAMED_SOURCES, Config, ConfigError, config_from_dict

# Layouts: mesh axis sizes for N devices (the axes not named are 1). `single` is one device.
LAYOUTS: dict[str, Callable[[int], dict[str, int]]] = {
    "single": lambda n: {},
    "dp": lambda n: {"data": n},
    "fsdp": lambda n: {"fsdp": n},
    "tp": lambda n: {"tensor": n},
    "dp+fsdp": lambda n: {"data": 2, "fsdp": n // 2},
    "dp+tp": lambda n: {"data": n // 2, "tensor": 2},
    "fsdp+tp": lambda n: {"fsdp": n // 2, "tensor": 2},
    "dp+fsdp+tp": lambda n: {"data": 2, "fsdp": n // 4, "tensor": 2},
    "dp+cp": lambda n: {"data": n // 2, "context": 2},
}
LAYOUT_MULTIPLE = {"dp+fsdp": 2, "dp+tp": 2, "fsdp+tp": 2, "dp+fsdp+tp": 4, "dp+cp": 2}


def describe_layout(name: str) -> str:
    """'data=N/2 tensor=2' (read off the layout at N=16)."""
    sizes = LAYOUTS[name](16)
    shown = {k: "N" if v == 16 else str(v) if v == 2 else f"N/{16 // v}" for k, v in sizes.items()}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or "one device"


@dataclasses.dataclass
class Resolved:
    """A run's config resolved for compiling ahead of time, its mesh, and what was assumed to get there."""

    config: Config
    devices: int
    mesh: dict[str, int]  # MESH_AXES -> size (all 1 for one device)
    layout: str  # a LAYOUTS name, or "config" (the config's own parallel settings)
    notes: list[str]

    def mesh_text(self) -> str:
        sized = [f"{axis}={n}" for axis, n in self.mesh.items() if n > 1]
        return " ".join(sized) if sized else "one device"


def resolve(config_path: str, overrides: list[str], devices: int, layout: str | None = None,
            *, fixed_devices: bool = False) -> Resolved:
    """The config (shapes resolved without data or weights) on `devices` devices with `layout` (None: the
    config's parallel settings). `fixed_devices`: the device count is the target's own (a TPU slice, a GPU
    node set), so a layout of one device runs on the first of them. ConfigError on bad input."""
    from train import init_from
    from train.config import load_config
    from train.devices.mesh import mesh_shape

    if layout is not None and layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    mesh_overrides = [o for o in overrides if o.split("=", 1)[0].startswith(("parallel.mesh", "parallel.strategy"))]
    if layout is not None and mesh_overrides:
        raise ConfigError(f"--layout {layout} sets the mesh, and so does {mesh_overrides[0]}: pass one of them")
    notes: list[str] = []
    as_written = load_config(config_path, overrides)
    config = init_from.drop_file_shape(as_written, overrides)
    config, shape_notes = _adopt_shape(config, as_written)
    notes += shape_notes
    config, data_notes = _resolve_data_shapes(config)
    notes += data_notes

    n = devices
    if layout is not None:
        multiple = LAYOUT_MULTIPLE.get(layout, 1)
        if layout != "single" and (n % multiple or n < 2):
            raise ConfigError(f"--layout {layout} needs a multiple of {max(multiple, 2)} devices, not {n}: pick "
                              "another layout or target")
        sizes = {axis: 1 for axis in MESH_AXES} | LAYOUTS[layout](n)
        raw = config.model_dump(mode="json")
        raw["parallel"]["strategy"] = "single" if layout == "single" else "sharded"
        raw["parallel"]["mesh"] = sizes
        config = config_from_dict(raw)
    parallel = config.parallel
    if parallel.strategy == "single":
        if n > 1:
            notes.append(f"parallel.strategy=single runs on one device: compiled for 1 of the {n}"
                         if fixed_devices else f"parallel.strategy=single runs on one device: 1, not {n}")
        n = 1
        shape = tuple(1 for _ in MESH_AXES)
    elif parallel.strategy == "pmap":
        notes.append(f"parallel.strategy=pmap is compiled as its sharded equivalent: data parallel over {n} devices")
        shape = tuple(n if axis == "data" else 1 for axis in MESH_AXES)
    else:
        shape = mesh_shape(parallel, n)
    return Resolved(config, n, dict(zip(MESH_AXES, shape, strict=True)), layout or "config", notes)


def _adopt_shape(config: Config, as_written: Config) -> tuple[Config, list[str]]:
    """model.init_from: the checkpoint's shape from its config alone (config.yaml of a run, config.json of a
    transformers directory); no weights are read. A checkpoint not on this machine: the shape as written."""
    from train import init_from
    from train.init_from.source import HF_PREFIX, Source, encoder_config

    spec = config.model.init_from
    if not spec:
        return config, []
    if spec.startswith(HF_PREFIX):
        model, where = _hf_shape(spec)
        adopted = init_from.adopt(config, Source(spec, model, None))
        raw = adopted.model_dump(mode="json")
        raw["data"]["tokenizer"] = "pretrained"
        return config_from_dict(raw), [f"model.init_from={spec}: the shape from {where} (no weights read)"]
    from train.checkpoints.store import CONFIG_FILE, read_run_config

    path = Path(re.sub(r"@\d+$", "", spec))
    if not (path / CONFIG_FILE).is_file():
        return as_written, [f"model.init_from={spec} holds no run on this machine: lowered with the model shape the "
                            "config states (training takes the run's own)"]
    saved = read_run_config(path)
    adopted = init_from.adopt(config, Source(spec, encoder_config(saved.model.model_dump(mode="json"), spec), None))
    return adopted, [f"model.init_from={spec}: the shape from {path / CONFIG_FILE} (no weights read)"]


def _hf_shape(spec: str) -> tuple[Any, str]:
    """The EncoderConfig of hf:<dir|name> from its config.json, as train/init_from/hf.py reads it."""
    from pydantic import ValidationError

    from jaxblock.config import EncoderConfig, format_validation_error
    from jaxblock.interop.hf.common import UnsupportedConfigError
    from jaxblock.interop.hf.convert import read_config
    from train.init_from.packaged import checkpoint_dir

    path = checkpoint_dir(spec.removeprefix("hf:"))  # a directory, or a packaged checkpoint (fetched once)
    try:
        fam, hf_cfg = read_config(path)
        fields = fam.encoder_fields(hf_cfg, None)
        model = EncoderConfig.model_validate(fields | {"pooler": fam.head_fields(hf_cfg)})
    except (UnsupportedConfigError, FileNotFoundError) as err:
        raise ConfigError(f"model.init_from={spec}: {err}") from None
    except ValidationError as err:
        raise ConfigError(f"model.init_from={spec}: {format_validation_error(err)}") from None
    return model, f"{path}/config.json"


def _resolve_data_shapes(config: Config) -> tuple[Config, list[str]]:
    """The config with the vocabulary and classes the data would set (train/tasks/ `resolve`), from the
    config alone: no data set is read or fetched."""
    from train.data.datasets import SENTIMENT_LABELS, SYNTHETIC_LABELS
    from train.data.tokenizer import ByteTokenizer, IdTokenizer
    from train.tasks import task_for

    task = task_for(config)
    data = config.data
    notes: list[str] = []
    if config.model.init_from:
        vocab = config.model.vocab_size
    elif data.source == "synthetic" and data.tokenizer != "pretrained":
        vocab = IdTokenizer(data.synthetic_vocab).vocab_size
    elif data.tokenizer == "byte":
        vocab = ByteTokenizer.vocab_size
    elif data.tokenizer == "bpe":
        vocab = data.bpe_vocab_size
        notes.append(f"vocabulary: {vocab} (data.bpe_vocab_size, the most a trained BPE vocabulary has)")
    else:
        raise ConfigError("data.tokenizer=pretrained needs model.init_from=hf:<dir> (its tokenizer.json): set it")
    if data.labels:
        labels = list(data.labels)
    elif data.source == "synthetic":
        labels = list(SYNTHETIC_LABELS[data.synthetic_task])
    elif data.source in ("rotten_tomatoes", "tweets", "amazon", "nyt"):
        labels = list(SENTIMENT_LABELS)
    else:
        labels = ["0", "1"]
        if task.predicts_labels:  # a masked-LM or regression head has no classes to assume
            notes.append(f"classes: 2 assumed (data.labels is not set and data.path={data.path} is not read)")
    return task.resolve_shapes(config, vocab, labels), notes


# --- the abstract state and batches a step is compiled for ----------------------------------------------


@dataclasses.dataclass
class Abstract:
    """What a step of `config` is compiled for, on `mesh`: shapes, dtypes and this layout's shardings."""

    task: Any
    model: Any
    state: Any  # TrainState of ShapeDtypeStructs (no shardings)
    state_sharding: Any  # TrainState of NamedShardings
    replicated_dims: list[str]  # parameter dims kept whole because their mesh axes do not divide them
    batches: dict[str, tuple[dict[str, jax.ShapeDtypeStruct], str]]  # call -> (batch, description)

    def sharded_state(self) -> Any:
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), self.state,
                            self.state_sharding)

    def rng(self, mesh: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def abstract(config: Config, mesh: Any, rows: int | None = None) -> Abstract:
    """The abstract state and batches of `config` on `mesh` (a Mesh, of any devices, or an AbstractMesh), with
    the runner's placement rules. rows: the global batch (default train.batch_size)."""
    from train.devices.mesh import logical_rules, param_shardings, state_shardings
    from train.loop.state import abstract_init, create_state
    from train.tasks import task_for

    task = task_for(config)
    model = task.build_model(config.model)
    params, specs = abstract_init(model, config.data.buckets[-1])
    state = jax.eval_shape(lambda p: create_state(model, p, config.optim, config.train.steps), params)
    rules = logical_rules(config.parallel)
    params_sh, replicated_dims = param_shardings(specs, params, mesh, rules)
    state_sh = state_shardings(state, params_sh, mesh)
    batches = _batches(task, config, mesh, rules, config.train.batch_size if rows is None else rows)
    return Abstract(task, model, state, state_sh, replicated_dims, batches)


def _axes_size(mesh: Any, entry: Any) -> int:
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[a] for a in names)


def _batches(task: Any, config: Config, mesh: Any, rules: Any, n: int) -> dict[str, tuple[dict[str, Any], str]]:
    """{'train': (abstract batch, description), 'eval': ...}: the largest batch each call takes, sharded as
    the runner places it (rows over the batch axes, tokens over the length axes)."""
    batch_axes, length_axes = nn.logical_to_mesh_axes(("batch", "length"), rules) or (None, None)
    rows_axes = _axes_size(mesh, batch_axes)
    if n % rows_axes:
        raise ConfigError(f"train.batch_size={n} (global) does not split over {rows_axes} data-parallel devices "
                          f"(mesh axes {batch_axes}): use a multiple of {rows_axes}")
    context = _axes_size(mesh, length_axes)
    length = config.data.buckets[-1]
    padded = -(-length // context) * context
    if padded > config.model.max_len:
        raise ConfigError(f"the context axis ({context}) pads sequences of {length} tokens to {padded}, beyond "
                          f"model.max_len={config.model.max_len}: use lengths that are multiples of {context}")
    rows = NamedSharding(mesh, PartitionSpec(batch_axes))
    tokens = NamedSharding(mesh, PartitionSpec(batch_axes, length_axes))
    streamed = config.data.source in STREAMED_SOURCES
    out = {}
    for call in ("train", "eval"):
        packed = streamed or (call == "train" and config.data.packing)
        segments = config.data.pack_segments
        shapes = {"tokens": jax.ShapeDtypeStruct((n, padded), jnp.int32),
                  "valid_tokens": jax.ShapeDtypeStruct((n, padded), jnp.bool_)}
        if packed:
            shapes["segment_ids"] = jax.ShapeDtypeStruct((n, padded), jnp.int32)
        shapes |= task.target_shapes(n, padded, segments if packed else None)
        batch = {key: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tokens if x.shape[:2] == (n, padded) else rows)
                 for key, x in shapes.items()}
        kind = f"packed rows, up to {segments} examples each" if packed else "padded rows"
        out[call] = (batch, f"tokens [{n}, {padded}], {kind}")
    return out
