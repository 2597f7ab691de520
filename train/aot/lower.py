"""`python -m train lower --config C --platform tpu|cuda [--devices 8] [--layout L] [key=value ...]`.

"Will this run on my pod slice?", answered on any machine before paying for one. The run's train step and
its inference (the eval step: the forward pass with train=False) are exported with `jax.export` for the
platform, on an abstract mesh of N accelerator devices with the run's shardings (the ones the sharded runner
gives them, train/devices/mesh.py), with the attention kernels chosen for that platform
(jaxblock/attention/platform.py `for_platform`). It then reports:

- per layer and call (train, eval): the kernel the dispatch promised (jaxblock/attention/dispatch.py
  `layer_kernels`), its reason, and whether the lowered module holds it (`LOWERED_MARKERS`: the custom call
  the kernel leaves, attributed to its layer through the name stack in the module's locations; a plain-XLA
  kernel must leave no attention custom call in its layer);
- parameters, gradients and optimizer state per device, from the shardings (activations are not counted:
  they are only known to the device's compiler);
- the collectives of the train step: those written in the lowered module (explicit ones: inside shard_map,
  psum) and, when this host has N CPU devices, those XLA's SPMD partitioner inserts for the same shardings
  when the step is compiled for CPU (with the CPU attention kernels; the partitioner runs only when
  compiling, and nothing here compiles for TPU or CUDA).

cuDNN attention cannot be traced without the CUDA plugin ("cuDNN is not detected"): on such a host a call
whose layers the dispatch sends to cuDNN is lowered again with the kernel the dispatch runs without cuDNN
(XLA's), and the report says so per layer. Nothing of the weights is read: with model.init_from the shape
comes from the checkpoint's config (a run's config.yaml or a transformers config.json), and when that
checkpoint is not on this machine, from the shape the config states. The vocabulary and classes come from
the config (a trained BPE vocabulary is at most data.bpe_vocab_size). Nothing is written to any workdir.

Exit codes: 0 every kernel the dispatch promised is in the lowered module; 1 one is missing (or a step did not
lower); 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from train.cli import Parser, program
from train.config import MESH_AXES, STREAMED_SOURCES, Config, ConfigError, config_from_dict
from train.errors import FAILED_EXIT, OK_EXIT

PLATFORMS = ("tpu", "cuda")
DEFAULT_DEVICES = 8
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
}
if "context" in MESH_AXES:  # context parallelism (train/config.py): each sequence split over 2 devices
    LAYOUTS["dp+cp"] = lambda n: {"data": n // 2, "context": 2}
LAYOUT_MULTIPLE = {"dp+fsdp": 2, "dp+tp": 2, "fsdp+tp": 2, "dp+fsdp+tp": 4, "dp+cp": 2}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# cuDNN's fused attention custom calls (jax._src.cudnn.fused_attention_stablehlo): not in jax.export's list
# of stable targets, like the Triton call of the Pallas GPU kernel.
_CUDNN_TARGETS = tuple(f"__cudnn$fmha{kind}{bwd}" for kind in ("Softmax", "ScaleBiasSoftmax", "SoftmaxDropout",
                                                              "ScaleBiasSoftmaxDropout") for bwd in ("", "Backward"))
# The CPU compile that counts the partitioner's collectives: at most this many devices, and cheap code generation.
_MAX_CPU_DEVICES = 64
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


# --- what is lowered ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """A run's config resolved for lowering, the mesh it is lowered on, and what was assumed to get there."""

    config: Config
    platform: str  # 'tpu' or 'cuda'
    devices: int
    mesh: dict[str, int]  # MESH_AXES -> size (all 1 for one device)
    layout: str  # a LAYOUTS name, or "config" (the config's own parallel settings)
    notes: list[str]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device count: pass a whole number >= 1")
    return value


def _parser() -> Parser:
    p = Parser(prog=f"{program()} lower", description=(
        "Export a config's train step and inference for TPU or CUDA on an abstract mesh of N devices, on this "
        "machine, and report per layer the attention kernel and whether it is in the lowered module, the "
        "memory per device and the collectives. Writes nothing."),
        epilog="exit codes: 0 every kernel the dispatch promised is in the lowered modules; 1 one is missing, or "
        "a step did not lower (the line says why); 2 bad input (one line)")
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--platform", required=True, choices=PLATFORMS, help="the accelerator to lower for")
    p.add_argument("--devices", type=_positive, default=None, metavar="N",
                   help=f"accelerator devices in the mesh (default {DEFAULT_DEVICES}; 1 with --layout single)")
    p.add_argument("--layout", choices=list(LAYOUTS), default=None,
                   help="a mesh preset for N devices (default: the config's parallel.mesh, or parallel.mesh.* "
                   "overrides): " + "; ".join(f"{k}: {_describe_layout(k)}" for k in LAYOUTS))
    p.add_argument("--no-compile", action="store_true",
                   help="skip compiling the train step for CPU on N devices, which counts the collectives XLA's "
                   "partitioner inserts (the slow part: seconds to minutes for a large model)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. data.packing=true")
    return p


def _describe_layout(name: str) -> str:
    """'data=N/2 tensor=2' (read off the layout at N=16)."""
    sizes = LAYOUTS[name](16)
    shown = {k: "N" if v == 16 else str(v) if v == 2 else f"N/{16 // v}" for k, v in sizes.items()}
    return " ".join(f"{k}={v}" for k, v in shown.items()) or "one device"


def resolve(config_path: str, overrides: list[str], platform: str, devices: int | None = None,
            layout: str | None = None) -> Target:
    """The config to lower (shapes resolved without data or weights) and its mesh. ConfigError on bad input."""
    from train import init_from
    from train.config import load_config
    from train.devices.mesh import mesh_shape

    if platform not in PLATFORMS:
        raise ConfigError(f"unknown platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    if layout is not None and layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    mesh_overrides = [o for o in overrides if o.split("=", 1)[0].startswith(("parallel.mesh", "parallel.strategy"))]
    if layout is not None and mesh_overrides:
        raise ConfigError(f"--layout {layout} sets the mesh, and so does {mesh_overrides[0]}: pass one of them")
    notes: list[str] = []
    config = init_from.drop_file_shape(load_config(config_path, overrides), overrides)
    config, shape_notes = _adopt_shape(config, load_config(config_path, overrides))
    notes += shape_notes
    config, data_notes = _resolve_data_shapes(config)
    notes += data_notes

    if layout == "single":
        if devices not in (None, 1):
            raise ConfigError(f"--layout single is one device, not --devices {devices}: drop --devices or pick "
                              f"another layout ({', '.join(k for k in LAYOUTS if k != 'single')})")
        devices = 1
    n = DEFAULT_DEVICES if devices is None else devices
    parallel = config.parallel
    if layout is not None:
        multiple = LAYOUT_MULTIPLE.get(layout, 1)
        if n % multiple or (layout != "single" and n < 2):
            raise ConfigError(f"--layout {layout} needs a multiple of {max(multiple, 2)} devices, not {n}: pass "
                              f"--devices {max(multiple, 2) * max(1, n // max(multiple, 2))} or another layout")
        sizes = {axis: 1 for axis in MESH_AXES} | LAYOUTS[layout](n)
        raw = config.model_dump(mode="json")
        raw["parallel"]["strategy"] = "single" if layout == "single" else "sharded"
        raw["parallel"]["mesh"] = sizes
        config = config_from_dict(raw)
        parallel = config.parallel
    if parallel.strategy == "single":
        if devices not in (None, 1):
            notes.append(f"parallel.strategy=single runs on one device: lowered for 1, not {devices} (pass "
                         "--layout or parallel.strategy=sharded for a mesh)")
        n = 1
        shape = tuple(1 for _ in MESH_AXES)
    elif parallel.strategy == "pmap":
        notes.append(f"parallel.strategy=pmap is lowered as its sharded equivalent: data parallel over {n} devices")
        shape = tuple(n if axis == "data" else 1 for axis in MESH_AXES)
    else:
        shape = mesh_shape(parallel, n)
    mesh = dict(zip(MESH_AXES, shape, strict=True))
    return Target(config, platform, n, mesh, layout or "config", notes)


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
    if task.name == "mlm":
        raw = config.model_dump(mode="json")
        raw["model"]["vocab_size"] = vocab + 1  # the mask id appended after the vocabulary (train/data/masking.py)
        raw["data"]["buckets"] = [data.max_len]
        resolved = config_from_dict(raw)
        if data.max_len > resolved.model.max_len:
            raise ConfigError(f"model.max_len={resolved.model.max_len} is shorter than the rows of data.max_len="
                              f"{data.max_len} tokens: raise model.max_len or lower data.max_len")
        return resolved, notes
    if data.labels:
        labels = list(data.labels)
    elif data.source == "synthetic":
        labels = list(SYNTHETIC_LABELS[data.synthetic_task])
    elif data.source in ("rotten_tomatoes", "tweets", "amazon", "nyt"):
        labels = list(SENTIMENT_LABELS)
    else:
        labels = ["0", "1"]
        notes.append(f"classes: 2 assumed (data.labels is not set and data.path={data.path} is not read)")
    stand_in = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=vocab), label_names=labels)
    return task.resolve(config, stand_in), notes


# --- lowering -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LayerResult:
    layer: int
    kernel: str  # what the dispatch promised
    reason: str
    expected: str | None  # the marker it leaves (LOWERED_MARKERS), None for plain XLA
    found: list[tuple[str, str | None]]  # custom calls attributed to this layer: (target, kernel name or None)
    ok: bool
    substitute: str | None = None  # the kernel lowered instead (cuDNN without the CUDA plugin)


@dataclasses.dataclass
class CallResult:
    call: str  # 'train' or 'eval'
    shapes: str  # what the batch looks like
    lowered: bool
    error: str | None
    layers: list[LayerResult]
    module_bytes: int = 0
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # in the lowered module

    @property
    def ok(self) -> bool:
        return self.lowered and all(layer.ok for layer in self.layers)


@dataclasses.dataclass
class Report:
    config: str
    platform: str
    devices: int
    mesh: dict[str, int]
    layout: str
    model: str
    calls: list[CallResult]
    memory: dict[str, int]  # bytes per device: parameters, gradients, optimizer_state, total; and *_global
    compiled_collectives: dict[str, int] | None  # the train step compiled for CPU, partitioner included
    compiled_note: str
    replicated_dims: list[str]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return all(call.ok for call in self.calls)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        for call, raw in zip(self.calls, out["calls"], strict=True):
            raw["ok"] = call.ok
        return out


def lower(target: Target, config_path: str = "", *, compile_collectives: bool = True) -> Report:
    """Export the train and eval steps of `target` and check them (the whole `lower` command but printing)."""
    from jaxblock.attention.platform import for_platform
    from train.devices.mesh import logical_rules, param_shardings, state_shardings
    from train.loop.state import abstract_init, create_state
    from train.tasks import task_for

    config = target.config
    task = task_for(config)
    model = task.build_model(config.model)
    params, specs = abstract_init(model, config.data.buckets[-1])
    state = jax.eval_shape(lambda p: create_state(model, p, config.optim, config.train.steps), params)
    shape = tuple(target.mesh[a] for a in MESH_AXES)
    mesh = AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    rules = logical_rules(config.parallel)
    # The runner's placement rules, on a mesh of devices this host does not have (they read only its shape).
    params_sh, replicated_dims = param_shardings(specs, params, mesh, rules)  # type: ignore[arg-type]
    state_sh = state_shardings(state, params_sh, mesh)  # type: ignore[arg-type]
    memory = _memory(state, state_sh, config.optim.freeze)
    batches = _batches(task, config, mesh, rules)

    calls = []
    with for_platform(target.platform):
        for call, (batch, shapes) in batches.items():
            calls.append(_lower_call(call, shapes, task, model, config, state, state_sh, batch, mesh, rules,
                                     target.platform))
    compiled: dict[str, int] | None = None
    compiled_note = "not counted (--no-compile)"
    if compile_collectives:
        compiled, compiled_note = _compiled_collectives(task, model, config, state, specs, batches["train"][0],
                                                        target.devices, shape, rules)
    block = config.model.block
    desc = (f"{task.name}, {config.model.num_layers} layers, D={block.model_dim}, {block.num_heads} heads"
            f"{'' if block.kv_heads == block.num_heads else f' ({block.kv_heads} kv)'} of {block.head_dim}, "
            f"{block.dtype} compute, {block.param_dtype} params, vocabulary {config.model.vocab_size}"
            f"{'' if task.name == 'mlm' else f', {config.model.num_classes} classes'}")
    return Report(config_path, target.platform, target.devices, target.mesh, target.layout, desc, calls, memory,
                  compiled, compiled_note, replicated_dims, target.notes)


@contextlib.contextmanager
def _kernel_context(mesh: Any, rules: Any, strategy: str) -> Iterator[None]:
    """What the sharded runner sets while it traces (train/devices/runners.py `kernel_context`): the
    abstract mesh and the logical-axis rules, from which the per-shard kernels read their layout."""
    from jaxblock.attention.context import context_strategy

    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules), context_strategy(strategy):
        yield


def _token_axes(rules: Any) -> tuple[Any, Any]:
    spec = nn.logical_to_mesh_axes(("batch", "length"), rules) or (None, None)
    return spec[0], spec[1]


def _axes_size(mesh: Any, entry: Any) -> int:
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[a] for a in names)


def _batches(task: Any, config: Config, mesh: Any, rules: Any) -> dict[str, tuple[dict[str, Any], str]]:
    """{'train': (abstract batch, description), 'eval': ...}: the largest batch each call takes, sharded as
    the runner places it (rows over the batch axes, tokens over the length axes)."""
    batch_axes, length_axes = _token_axes(rules)
    rows_axes = _axes_size(mesh, batch_axes)
    n = config.train.batch_size
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
        batch = {"tokens": jax.ShapeDtypeStruct((n, padded), jnp.int32, sharding=tokens),
                 "valid_tokens": jax.ShapeDtypeStruct((n, padded), jnp.bool_, sharding=tokens)}
        if packed:
            batch["segment_ids"] = jax.ShapeDtypeStruct((n, padded), jnp.int32, sharding=tokens)
        per_example = (n, segments) if packed else (n,)
        for key in task.target_keys:
            if key in ("labels", "scores"):
                dtype = jnp.int32 if key == "labels" else jnp.float32
                batch[key] = jax.ShapeDtypeStruct(per_example, dtype, sharding=rows)
            elif key in ("mlm_targets", "mlm_weights"):
                dtype = jnp.int32 if key == "mlm_targets" else jnp.float32
                batch[key] = jax.ShapeDtypeStruct((n, padded), dtype, sharding=tokens)
            else:
                raise ConfigError(f"task={task.name} takes the batch key {key!r}, which lower cannot shape yet: "
                                  "lower another task")
        kind = f"packed rows, up to {segments} examples each" if packed else "padded rows"
        out[call] = (batch, f"tokens [{n}, {padded}], {kind}")
    return out


def _lower_call(call: str, shapes: str, task: Any, model: Any, config: Config, state: Any, state_sh: Any,
                batch: dict[str, Any], mesh: Any, rules: Any, platform: str) -> CallResult:
    from jaxblock.attention.dispatch import LOWERED_MARKERS, layer_kernels

    train = call == "train"
    packed = "segment_ids" in batch
    length = batch["tokens"].shape[1]
    strategy = config.parallel.context_strategy
    with _kernel_context(mesh, rules, strategy):
        promised = layer_kernels(config.model, train=train, length=length, segments=packed)
    substitute = None
    try:
        exported = _export(call, task, model, state, state_sh, batch, mesh, rules, strategy, platform)
    except Exception as err:  # any failure to trace or lower is the answer, in one line
        if not ("cuDNN" in str(err) and any(kernel == "cudnn" for kernel, _ in promised)):
            return CallResult(call, shapes, False, one_line_error(err), [
                LayerResult(i, k, r, LOWERED_MARKERS.get(k), [], False) for i, (k, r) in enumerate(promised)])
        # No CUDA plugin here: lower the call with the kernel the dispatch runs without cuDNN.
        fallback = config.model.with_kernel("xla")
        with _kernel_context(mesh, rules, strategy):
            substitute = layer_kernels(fallback, train=train, length=length, segments=packed)
        try:
            exported = _export(call, task, task.build_model(fallback), state, state_sh, batch, mesh, rules, strategy,
                               platform)
        except Exception as again:
            return CallResult(call, shapes, False, one_line_error(again), [
                LayerResult(i, k, r, LOWERED_MARKERS.get(k), [], False) for i, (k, r) in enumerate(promised)])
    text = exported.mlir_module()
    found = attention_calls(text, config.model.num_layers)
    markers = {m for m in LOWERED_MARKERS.values() if m}
    layers = []
    for i, (kernel, reason) in enumerate(promised):
        lowered_kernel = kernel
        note = None
        if substitute is not None and kernel == "cudnn":
            lowered_kernel = substitute[i][0]
            note = lowered_kernel
        expected = LOWERED_MARKERS.get(lowered_kernel)
        here = found.get(i, [])
        if expected is None:
            ok = not any(m in target for target, _ in here for m in markers)
        else:
            ok = any(expected in target for target, _ in here)
        layers.append(LayerResult(i, kernel, reason, expected, here, ok, note))
    return CallResult(call, shapes, True, None, layers, len(text.encode()), lowered_collectives(text))


def lowered_collectives(text: str) -> dict[str, int]:
    """Collective ops written in a lowered (StableHLO) module, by kind; one over groups of one device (the
    transpose of a shard_map over an axis it does not split leaves such no-ops) is not counted."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    pattern = re.compile(r'"?(?:stablehlo|sdy)\.(all_reduce|all_gather|reduce_scatter|collective_permute|all_to_all)\b'
                         r'(?:.*?replica_groups = dense<.*?> : tensor<\d+x(\d+)xi64>)?')
    for m in pattern.finditer(text):
        if m[2] is None or int(m[2]) > 1:
            counts[m[1].replace("_", "-")] += 1
    return counts


def _export(call: str, task: Any, model: Any, state: Any, state_sh: Any, batch: dict[str, Any], mesh: Any,
            rules: Any, strategy: str, platform: str) -> Any:
    """jax.export of the train step (state, batch, rng) or the eval step (params, batch) for `platform`."""
    from train.loop.step import eval_step, train_step

    abstract_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_sh)
    replicated = NamedSharding(mesh, PartitionSpec())
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("__gpu$xla.gpu.triton", *_CUDNN_TARGETS)]
    apply_fn = model.apply
    # A new function object per export: jit caches traces by function, and the platform the kernels are
    # chosen for (for_platform) is not part of that cache's key.
    if call == "train":
        pinned = state_sh.replace(apply_fn=apply_fn)  # the model's function is part of the state's tree

        def step(st: Any, b: Any, rng: jax.Array) -> Any:
            st = st.replace(apply_fn=apply_fn)
            with _kernel_context(mesh, rules, strategy):
                new_state, metrics = train_step(task, st, b, rng)
            return (jax.lax.with_sharding_constraint(new_state, pinned),
                    jax.lax.with_sharding_constraint(metrics, replicated))

        rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
        fn = jax.jit(step, donate_argnums=0)
        return jax.export.export(fn, platforms=[platform], disabled_checks=checks)(abstract_state, batch, rng)

    def evaluate(params: Any, b: Any) -> Any:
        with _kernel_context(mesh, rules, strategy):
            sums = eval_step(task, types.SimpleNamespace(apply_fn=apply_fn, params=params), b)
        return jax.lax.with_sharding_constraint(sums, replicated)

    fn = jax.jit(evaluate)
    return jax.export.export(fn, platforms=[platform], disabled_checks=checks)(abstract_state.params, batch)


def attention_calls(text: str, num_layers: int) -> dict[int, list[tuple[str, str | None]]]:
    """{layer: [(custom call target, kernel name or None), ...]} for every custom call in a lowered module,
    attributed to the layer whose name stack ('.../layers_3/...') encloses it: its own location, an
    enclosing op's (a shard_map region) or that of the call into the function holding it. A scanned stack
    ('.../layers/...') runs one body for every layer, so what it holds counts for all of them."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    out: dict[int, set[tuple[str, str | None]]] = {i: set() for i in range(num_layers)}
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if op.operation.name == "func.func"}
        seen: set[tuple[str, Any]] = set()

        def layer_of(loc: str, ctx: Any) -> Any:
            if m := re.search(r"/layers_(\d+)/", loc):
                return int(m[1])
            if re.search(r"/layers/", loc):
                return "all"
            return ctx

        def visit(op: Any, ctx: Any) -> None:
            o = op.operation
            ctx = layer_of(str(o.location), ctx)
            if o.name == "stablehlo.custom_call":
                target = ir.StringAttr(o.attributes["call_target_name"]).value
                name = ir.StringAttr(o.attributes["kernel_name"]).value if "kernel_name" in o.attributes else None
                if name is None and "mhlo.backend_config" in o.attributes:  # a Triton call: its kernel's name
                    m = re.search(r'\bname = "([^"]+)"', str(o.attributes["mhlo.backend_config"]))
                    name = m[1] if m else None
                for layer in (range(num_layers) if ctx == "all" else [ctx] if isinstance(ctx, int) else []):
                    if layer in out:
                        out[layer].add((target, name))
            if o.name == "func.call":
                callee = ir.FlatSymbolRefAttr(o.attributes["callee"]).value
                if (callee, ctx) not in seen and callee in funcs:
                    seen.add((callee, ctx))
                    for region in funcs[callee].regions:
                        for block in region.blocks:
                            for child in block.operations:
                                visit(child, ctx)
            for region in o.regions:
                for block in region.blocks:
                    for child in block.operations:
                        visit(child, ctx)

        for region in funcs["main"].regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child, None)
    return {layer: sorted(calls, key=str) for layer, calls in out.items()}


def _memory(state: Any, state_sh: Any, freeze: list[str]) -> dict[str, int]:
    """Bytes per device (and in all) of the parameters, their gradients (the trained parameters' shapes,
    dtypes and shardings: a frozen leaf's gradient is never formed, train/loop/step.py) and the optimizer
    state, from the shardings."""
    from train.loop.state import frozen_labels

    def per_device(tree: Any, shardings: Any, keep: list[bool] | None = None) -> tuple[int, int]:
        leaves = jax.tree.leaves(tree)
        shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        kept = [True] * len(leaves) if keep is None else keep
        local = sum(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                    for x, sh, k in zip(leaves, shs, kept, strict=True) if k)
        whole = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x, k in zip(leaves, kept, strict=True) if k)
        return local, whole

    params, params_all = per_device(state.params, state_sh.params)
    trained = [label == "train" for label in jax.tree.leaves(frozen_labels(state.params, freeze))]
    grads, _ = per_device(state.params, state_sh.params, trained)
    opt, opt_all = per_device(state.opt_state, state_sh.opt_state)
    return {"parameters": params, "gradients": grads, "optimizer_state": opt, "total": params + grads + opt,
            "parameters_global": params_all, "optimizer_state_global": opt_all}


def _compiled_collectives(task: Any, model: Any, config: Config, state: Any, specs: Any, batch: dict[str, Any],
                          devices: int, shape: tuple[int, ...], rules: Any) -> tuple[dict[str, int] | None, str]:
    """The collectives XLA's SPMD partitioner puts in the train step for these shardings: the step compiled
    for CPU on `devices` CPU devices (the CPU attention kernels; the same program otherwise)."""
    from jaxblock.attention.platform import for_platform
    from train.devices.mesh import param_shardings, state_shardings
    from train.loop.step import train_step

    if devices == 1:
        return dict.fromkeys(COLLECTIVES, 0), "one device: none"
    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        return None, (f"not counted: this process has {len(cpus)} CPU device{'s' if len(cpus) > 1 else ''}, not "
                      f"{devices} (the command sets "
                      f"--xla_force_host_platform_device_count up to {_MAX_CPU_DEVICES} when it starts JAX itself)")
    mesh = Mesh(np.asarray(cpus[:devices]).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    params_sh, _ = param_shardings(specs, state.params, mesh, rules)
    state_sh = state_shardings(state, params_sh, mesh)
    abstract_state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_sh)
    on_cpu = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, v.sharding.spec))
              for k, v in batch.items()}
    replicated = NamedSharding(mesh, PartitionSpec())
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    strategy = config.parallel.context_strategy
    apply_fn = model.apply

    def step(st: Any, b: Any, key: jax.Array) -> Any:
        st = st.replace(apply_fn=apply_fn)
        with _kernel_context(mesh.abstract_mesh, rules, strategy):
            new_state, metrics = train_step(task, st, b, key)
        return (jax.lax.with_sharding_constraint(new_state, state_sh),
                jax.lax.with_sharding_constraint(metrics, replicated))

    with for_platform("cpu"):
        lowered = jax.jit(step, donate_argnums=0).trace(abstract_state, on_cpu, rng).lower()
        # Only the partitioner's output is read: the CPU code generation is kept cheap.
        try:
            compiled = lowered.compile(compiler_options=_FAST_CPU_COMPILE)
        except Exception:  # a jaxlib without these options: XLA's defaults (slower, same counts)
            compiled = lowered.compile()
        text = compiled.as_text()
    counts = {c: len(re.findall(rf"\s{c}(?:-start)?\(", text)) for c in COLLECTIVES}
    return counts, f"compiled for CPU on {devices} devices with these shardings (CPU attention kernels)"


def one_line_error(err: BaseException) -> str:
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first}"[:300]


# --- the report -----------------------------------------------------------------------------------------


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def mesh_text(mesh: dict[str, int]) -> str:
    sized = [f"{axis}={n}" for axis, n in mesh.items() if n > 1]
    return " ".join(sized) if sized else "one device"


def _ranges(layers: list[LayerResult]) -> list[tuple[str, LayerResult]]:
    """Consecutive layers with the same result share one line: ('layers 0-5', result)."""
    groups: list[list[LayerResult]] = []
    for layer in layers:
        key = (layer.kernel, layer.reason, layer.found, layer.ok, layer.substitute)
        if groups and (groups[-1][0].kernel, groups[-1][0].reason, groups[-1][0].found, groups[-1][0].ok,
                       groups[-1][0].substitute) == key:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    out = []
    for group in groups:
        first, last = group[0].layer, group[-1].layer
        out.append((f"layer {first}" if first == last else f"layers {first}-{last}", group[0]))
    return out


def render(report: Report) -> str:
    lines = [f"{report.config or 'config'} lowered for {report.platform} on {report.devices} "
             f"device{'s' if report.devices > 1 else ''}: {mesh_text(report.mesh)}"
             f"{'' if report.layout == 'config' else f' (layout {report.layout})'}",
             f"model: {report.model}"]
    lines += [f"note: {note}" for note in report.notes]
    for call in report.calls:
        title = "train step" if call.call == "train" else "inference (eval step, train=False)"
        lines.append("")
        if not call.lowered:
            lines.append(f"{title}: NOT lowered for {report.platform}: {call.error}")
            continue
        lines.append(f"{title}: {call.shapes}; exported for {report.platform} ({size(call.module_bytes)} StableHLO)")
        width = max(len(label) for label, _ in _ranges(call.layers))
        for label, layer in _ranges(call.layers):
            if layer.substitute:
                status = (f"not traceable here (cuDNN needs the CUDA plugin); lowered with {layer.substitute}, "
                          f"the dispatch's kernel without cuDNN: {_found_text(layer)}")
            elif layer.expected is None:
                status = f"plain XLA: {_found_text(layer)}"
            else:
                status = f"{'in the module' if layer.ok else 'MISSING from the module'}: {_found_text(layer)}"
            lines.append(f"  {label:<{width}}  {layer.kernel:<10} {'ok ' if layer.ok else 'BAD'} {status}")
            lines.append(f"  {'':<{width}}  {'':<10}     why: {layer.reason}")
    m = report.memory
    lines += ["", "memory per device (from the shardings; activations are not counted):",
              f"  parameters       {size(m['parameters']):>10}  (of {size(m['parameters_global'])} in all)",
              f"  gradients        {size(m['gradients']):>10}"
              f"{'' if m['gradients'] == m['parameters'] else '  (the trained parameters: optim.freeze)'}",
              f"  optimizer state  {size(m['optimizer_state']):>10}  (of {size(m['optimizer_state_global'])} in all)",
              f"  total            {size(m['total']):>10}"]
    if report.replicated_dims:
        lines.append(f"  kept whole on every device (their mesh axes do not divide them): "
                     f"{len(report.replicated_dims)} dims, e.g. {report.replicated_dims[0]}")
    train = next((c for c in report.calls if c.call == "train" and c.lowered), None)
    lines += ["", "collectives in the train step:"]
    if train is not None:
        lines.append(f"  in the lowered module (explicit ones, e.g. inside shard_map): {_counts(train.collectives)}")
    if report.compiled_collectives is not None:
        lines.append(f"  {report.compiled_note}: {_counts(report.compiled_collectives)}")
    else:
        lines.append(f"  partitioner's: {report.compiled_note}")
    lines.append("")
    if report.ok:
        lines.append("result: OK, every kernel the dispatch promised is in the lowered module")
    else:
        bad = [f"{c.call}: " + ("not lowered" if not c.lowered else
                                "layers " + ", ".join(str(x.layer) for x in c.layers if not x.ok))
               for c in report.calls if not c.ok]
        lines.append(f"result: FAILED ({'; '.join(bad)})")
    return "\n".join(lines)


def _found_text(layer: LayerResult) -> str:
    if not layer.found:
        return "no attention custom call"
    by_target: dict[str, list[str]] = {}
    for target, name in layer.found:
        by_target.setdefault(target, []).extend([name] if name else [])
    return "; ".join(f"{target} ({', '.join(names)})" if names else target for target, names in by_target.items())


def _counts(counts: dict[str, int]) -> str:
    shown = [f"{name} {n}" for name, n in counts.items() if n]
    return ", ".join(shown) if shown else "none"


# --- the command ----------------------------------------------------------------------------------------


def _cpu_devices_for(devices: int) -> None:
    """Before JAX starts its backend (the command run as a process): N simulated CPU devices, so the
    partitioner's collectives can be counted by compiling for CPU."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if getattr(bridge, "_backends", None) or not 1 < devices <= _MAX_CPU_DEVICES:
        return  # too late (XLA has read its flags), or nothing to count
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    target = resolve(args.config, args.overrides, args.platform, args.devices, args.layout)
    if not args.no_compile:
        _cpu_devices_for(target.devices)
    report = lower(target, args.config, compile_collectives=not args.no_compile)
    print(json.dumps(report.to_json(), indent=1) if args.json else render(report))
    return OK_EXIT if report.ok else FAILED_EXIT


if __name__ == "__main__":
    sys.exit(main())
