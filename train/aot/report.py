"""What `lower` and `compile` report in common: the kernel each layer was promised and whether the program
holds it, the memory of the state from its shardings, the model in one line, and how they print."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from train.aot import programs
from train.config import Config


@dataclasses.dataclass
class LayerResult:
    layer: int
    kernel: str  # what the dispatch promised (jaxblock/attention/dispatch.py)
    reason: str
    found: list[str]  # the attention custom calls the program holds for this layer
    ok: bool
    substitute: str | None = None  # the kernel traced instead (cuDNN on a host without the CUDA plugin)


def heading(first: str, layout: str, model: str, notes: list[str]) -> list[str]:
    """The lines `lower` and `compile` open with: what was built for what, the model, the notes."""
    return [f"{first}{'' if layout == 'config' else f' (layout {layout})'}", f"model: {model}",
            *(f"note: {note}" for note in notes)]


def check_layers(config: Config, call: str, length: int, packed: bool, hlo: str | None,
                 substitute: list[tuple[str, str]] | None = None) -> list[LayerResult]:
    """Per layer: the kernel the dispatch promises for this call and whether `hlo` holds it (None: the call
    did not lower or compile, so nothing is found). Run inside the step's kernel context (the mesh and the
    target platform decide the promise). `substitute`: the kernels traced instead, per layer."""
    from jaxblock.attention.dispatch import layer_kernels

    promised = layer_kernels(config.model, train=call == "train", length=length, segments=packed)
    found = programs.calls_by_layer(hlo, config.model.num_layers) if hlo is not None else {}
    out = []
    for i, (kernel, reason) in enumerate(promised):
        traced = kernel if substitute is None else substitute[i][0]
        calls = found.get(i, [])
        ok = hlo is not None and programs.holds(traced, calls)
        out.append(LayerResult(i, kernel, reason, sorted({c.describe() for c in calls}), ok,
                               traced if traced != kernel else None))
    return out


def state_memory(state: Any, state_sh: Any, freeze: list[str]) -> dict[str, int]:
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


def describe_model(config: Config, task_name: str) -> str:
    model, block = config.model, config.model.block
    return (f"{task_name}, {model.num_layers} layers, D={block.model_dim}, {block.num_heads} heads"
            f"{'' if block.kv_heads == block.num_heads else f' ({block.kv_heads} kv)'} of {block.head_dim}, "
            f"{block.dtype} compute, {block.param_dtype} params, vocabulary {model.vocab_size}"
            f"{'' if task_name == 'mlm' else f', {model.num_classes} classes'}"
            f"{'' if model.remat == 'none' else f', remat {model.remat}'}"
            f"{f', loss in {config.mlm.loss_chunks} groups' if task_name == 'mlm' and config.mlm.loss_chunks else ''}")


def one_line_error(err: BaseException) -> str:
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first}"[:300]


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def counts_text(counts: dict[str, int]) -> str:
    shown = [f"{name} {n}" for name, n in counts.items() if n]
    return ", ".join(shown) if shown else "none"


def layer_lines(layers: list[LayerResult], status: Any) -> list[str]:
    """Consecutive layers with the same result share a line: '  layers 0-5  splash  ok  <status>'."""
    groups: list[list[LayerResult]] = []
    for layer in layers:
        key = (layer.kernel, layer.reason, layer.found, layer.ok, layer.substitute)
        last = groups[-1][0] if groups else None
        if last is not None and (last.kernel, last.reason, last.found, last.ok, last.substitute) == key:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    labels = [f"layer {g[0].layer}" if len(g) == 1 else f"layers {g[0].layer}-{g[-1].layer}" for g in groups]
    width = max((len(label) for label in labels), default=0)
    lines = []
    for label, group in zip(labels, groups, strict=True):
        first = group[0]
        lines.append(f"  {label:<{width}}  {first.kernel:<10} {'ok ' if first.ok else 'BAD'} {status(first)}")
        lines.append(f"  {'':<{width}}  {'':<10}     why: {first.reason}")
    return lines


def found_text(layer: LayerResult) -> str:
    return "; ".join(layer.found) if layer.found else "no attention custom call"
