"""Running a model with every block's boundary visible, and addressing blocks by module path.

Blocks are found by module structure, not by name: every `EncoderBlock` (a variant subclass
included) called during the forward pass is a block, numbered in call order, addressed by its
module path (e.g. ("encoder", "stack", "layers_0")); the stack is the blocks' parent module. Its
parameters and recorded intermediates sit at that same path in their trees. Each block's input and
output are taken at its call boundary (Flax method interception), so no check trusts what a block
chooses to record about itself.

Shapes: N batch, L length, D width, B blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax

from jaxblock.block import EncoderBlock
from jaxblock.model import unstack_layer_params
from jaxblock.wiring import BRANCHES, Wiring, wiring_of

Batch = Mapping[str, Any]
Path = tuple[str, ...]


@dataclass
class Trace:
    """One forward pass: the model output and, per block, its input, output and recorded values."""

    output: jax.Array
    stack_output: jax.Array | None  # [N, L, D] returned by the blocks' parent (None if not seen)
    inputs: list[jax.Array]  # B x [N, L, D]
    outputs: list[jax.Array]  # B x [N, L, D]
    records: list[dict[str, jax.Array]]  # B x {site: [N, L, D]}
    paths: list[Path]  # B module paths
    stack_path: Path | None


def prepare(model: nn.Module, variables: Any) -> tuple[nn.Module, dict[str, Any]]:
    """Plain, per-layer variables and the unrolled twin of a scanned/rematerialized model."""
    v = nn.unbox(variables)
    if "params" not in v:
        v = {"params": v}
    v = {k: val for k, val in v.items() if k not in ("intermediates", "perturbations")}
    cfg = getattr(model, "config", None)
    if cfg is not None and (getattr(cfg, "scan_layers", False) or getattr(cfg, "remat", "none") != "none"):
        model = model.clone(config=cfg.model_copy(update={"scan_layers": False, "remat": "none"}))
        v = unstack_layer_params(v)
    return model, v


def block_config(model: nn.Module) -> Any:
    cfg = model.config
    return getattr(cfg, "block", cfg)


def skipped_norms(model: nn.Module, num_layers: int) -> list[frozenset[str]]:
    """Per layer, the norm modules the stack's per-layer settings bypass (layers.attn_norm False: attn_norm)."""
    layers = getattr(model.config, "layers", None)
    flags = (layers.attn_norm if layers is not None else None) or (True,) * num_layers
    return [frozenset() if keep else frozenset({"attn_norm"}) for keep in flags]


def wiring(model: nn.Module) -> Wiring:
    """The placement's wiring the model's blocks must follow (jaxblock.wiring)."""
    return wiring_of(model.config)


def model_input(batch: Batch) -> jax.Array:
    """batch["x"] float[N, L, D] for a stack, batch["tokens"] int32[N, L] for an Encoder or Classifier."""
    return batch["x"] if "x" in batch else batch["tokens"]


def trace(
    model: nn.Module,
    variables: Mapping[str, Any],
    batch: Batch,
    *,
    train: bool = False,
    rngs: Any = None,
    deltas: Sequence[jax.Array] | None = None,
) -> Trace:
    """Run `model` (already `prepare`d) and capture every block boundary.

    deltas: B arrays [N, L, D] added to each block's input, so that the gradient with respect to
    them is the gradient at each layer's input. Works eagerly and under jit: the checks call it eagerly
    (each runs a handful of one-off variants); the measures that
    `train.diagnostics_every` repeats with the same shapes compile it (diagnostics/measures.py).
    """
    paths: list[Path] = []
    inputs: list[jax.Array] = []
    outputs: dict[int, jax.Array] = {}
    stack: dict[str, Any] = {}
    active: set[int] = set()

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, ctx: Any) -> Any:
        module = ctx.module
        # A subclass's __call__ calling super().__call__ is intercepted twice: keep the outer call.
        if ctx.method_name != "__call__" or id(module) in active:
            return next_fun(*args, **kwargs)
        if not isinstance(module, EncoderBlock):
            out = next_fun(*args, **kwargs)
            if paths and tuple(module.path) == paths[0][:-1]:
                stack.update(path=tuple(module.path), output=out)
            return out
        active.add(id(module))
        i = len(paths)
        paths.append(tuple(module.path))
        try:
            if deltas is not None:
                args = (args[0] + deltas[i].astype(args[0].dtype), *args[1:])
            inputs.append(args[0])
            outputs[i] = next_fun(*args, **kwargs)
        finally:
            active.discard(id(module))
        return outputs[i]

    extra = {"segment_ids": batch["segment_ids"]} if batch.get("segment_ids") is not None else {}
    with nn.intercept_methods(interceptor):
        out, state = model.apply(
            variables, model_input(batch), batch["valid_tokens"], train=train, rngs=rngs,
            mutable=["intermediates"], **extra,
        )
    order = wiring(model).order
    recorded = state.get("intermediates", {})
    records = [{k: v[0] for k, v in subtree(recorded, p).items() if k in order} for p in paths]
    if "output" in stack:
        stack_output = stack["output"]
    else:  # the model is the stack itself
        stack_output = out if out.ndim == 3 and paths and len(paths[0]) == 1 else None
    stack_path = stack.get("path", () if paths and len(paths[0]) == 1 else None)
    return Trace(out, stack_output, inputs, [outputs[i] for i in range(len(paths))], records, paths,
                 stack_path)


def block_paths(model: nn.Module, variables: Mapping[str, Any], batch: Batch) -> list[Path]:
    """The blocks' module paths in call order, from one abstract forward pass (jax.eval_shape: nothing is
    compiled or run; the model sees its inputs as a jitted step does)."""
    found: list[Path] = []

    def forward(v: Mapping[str, Any], b: dict[str, Any]) -> Any:
        t = trace(model, v, b)
        found.extend(t.paths)
        return t.output

    jax.eval_shape(forward, variables, dict(batch))
    return found


def subtree(tree: Any, path: Path) -> Any:
    """tree[path[0]][path[1]]...; {} where the path is absent."""
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return {}
        tree = tree[key]
    return tree


def _replace(tree: Any, path: Path, fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(tree)
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], fn)}


def with_block_params(variables: dict[str, Any], paths: Sequence[Path],
                      fn: Callable[[int, dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Copy of variables with fn(i, block params) replacing block i's params subtree."""
    params = variables["params"]
    for i, p in enumerate(paths):
        params = _replace(params, p, functools.partial(_call_on_copy, fn, i))
    return {**variables, "params": params}


def _call_on_copy(fn: Callable[[int, dict[str, Any]], dict[str, Any]], i: int, layer: Any) -> dict[str, Any]:
    return fn(i, dict(layer))


def zero_branch(variables: dict[str, Any], paths: Sequence[Path], branch: str) -> dict[str, Any]:
    """Zero the last projection (bias included) of `branch` ("attention" or "ffn") in every block."""
    b = next(b for b in BRANCHES if b.name == branch)

    def zero(_: int, layer: dict[str, Any]) -> dict[str, Any]:
        if b.module in layer and b.out_projection in layer[b.module]:
            proj = jax.tree.map(jax.numpy.zeros_like, layer[b.module][b.out_projection])
            layer[b.module] = {**layer[b.module], b.out_projection: proj}
        return layer

    return with_block_params(variables, paths, zero)
