"""Measurements by depth: residual ratios, gradient norms, the first non-finite sublayer.

Each reads the placement's wiring (jaxblock.wiring) for what to measure: which values a residual
add sums, and the order in which the sublayers run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxblock.diagnostics.reference import f64, real
from jaxblock.diagnostics.report import GradNorms, NonFinite, ResidualRatios, Stats
from jaxblock.diagnostics.tracing import (
    Path,
    block_config,
    block_paths,
    model_input,
    prepare,
    subtree,
    trace,
    wiring,
)
from jaxblock.wiring import BLOCK_INPUT, BRANCHES

Batch = Mapping[str, Any]
LossFn = Callable[[jax.Array, Batch], Any]

_FFN = next(b for b in BRANCHES if b.name == "ffn")


def residual_ratios(model: nn.Module, variables: Any, batch: Batch, *, limit: float = 10.0) -> ResidualRatios:
    """For each residual add in the wiring: ||branch|| / ||the residual stream it is added to||."""
    model, v = prepare(model, variables)
    inputs, records = _compiled_unless_intercepted(_block_values)(model, v, dict(batch))
    valid = batch["valid_tokens"]
    ratios: dict[str, list[float]] = {"attn": [], "ffn": []}
    for x, rec in zip(inputs, records, strict=True):
        values = {**rec, BLOCK_INPUT: x}
        for add in wiring(model).adds:
            stream, branch = add.inputs
            b, s = real(values[branch], valid), real(values[stream], valid)
            key = branch.removesuffix("_branch")
            ratios[key].append(float(np.linalg.norm(b)) / max(float(np.linalg.norm(s)), 1e-30))
    every = ratios["attn"] + ratios["ffn"]
    passed = bool(np.all(np.isfinite(every)) and max(every, default=0.0) <= limit)
    return ResidualRatios(block_config(model).norm, ratios["attn"], ratios["ffn"], limit, passed)


def _compiled_unless_intercepted(fn: Any) -> Any:
    """The jitted `fn`, or the function it wraps when the caller runs us inside `nn.intercept_methods`:
    the interceptor is not part of jit's cache key, so a program compiled by an earlier call would
    silently leave it out."""
    stack = getattr(nn.module, "_global_interceptor_stack", None)
    return fn.__wrapped__ if stack is None or list(stack) else fn


@functools.partial(jax.jit, static_argnums=0)
def _block_values(model: nn.Module, v: dict[str, Any], batch: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Each block's input and recorded values, from one compiled forward pass (the trainer's
    `train.diagnostics_every` asks again with the same shapes every N steps)."""
    t = trace(model, v, batch)
    return t.inputs, t.records


def grad_norms_by_depth(model: nn.Module, variables: Any, batch: Batch, loss_fn: LossFn) -> GradNorms:
    """Eval-mode gradients of loss_fn(model(batch), batch).

    One compiled program per model, loss and batch shape (jitted with the model and loss static), not op by
    op: an eager gradient compiles every primitive of the forward pass, its linearization and its transpose
    on first use (15 s for the first diagnosis of a 2-layer D32 classifier with XLA's default options, 1.5
    s compiled), and `train.diagnostics_every` asks again with the same shapes every N steps.
    """
    model, v = prepare(model, variables)
    paths = tuple(block_paths(model, v, batch))
    loss, *norms = jax.device_get(_compiled_unless_intercepted(_grad_norms)(model, loss_fn, paths, v, dict(batch)))
    input_grad, param_grad, ffn_out = ([float(x) for x in xs] for xs in norms)
    passed = bool(np.all(np.isfinite([float(loss), *input_grad, *param_grad])))
    return GradNorms(float(loss), input_grad, param_grad, ffn_out, passed)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _grad_norms(model: nn.Module, loss_fn: LossFn, paths: tuple[Path, ...], v: dict[str, Any],
                batch: dict[str, Any]) -> tuple[jax.Array, list[jax.Array], list[jax.Array], list[jax.Array]]:
    """The loss; per block, the norm of the gradient at its input (through zeros added to each block's
    input), of its parameters' gradient and of its FFN output projection's gradient (0 without an FFN)."""
    shape = (*model_input(batch).shape[:2], block_config(model).model_dim)

    def loss_of(params: Any, deltas: list[jax.Array]) -> jax.Array:
        out = trace(model, {**v, "params": params}, batch, deltas=deltas).output
        loss = loss_fn(out, batch)
        return loss[0] if isinstance(loss, tuple) else loss

    deltas = [jnp.zeros(shape, jnp.float32) for _ in paths]
    loss, (g_params, g_inputs) = jax.value_and_grad(loss_of, argnums=(0, 1))(v["params"], deltas)
    layers = [subtree(g_params, p) for p in paths]
    param_grad = [optax.tree.norm(layer) for layer in layers]
    ffn_out = [jnp.linalg.norm(layer[_FFN.module][_FFN.out_projection]["kernel"]) if _FFN.module in layer
               else jnp.zeros(()) for layer in layers]
    return loss, [jnp.linalg.norm(g) for g in g_inputs], param_grad, ffn_out


def first_nonfinite(model: nn.Module, variables: Any, batch: Batch) -> NonFinite:
    """Walk the recorded values in the wiring's execution order; name the first non-finite one."""
    model, v = prepare(model, variables)
    t = trace(model, v, batch)

    def bad(x: Any) -> int:
        return int(np.sum(~np.isfinite(f64(x))))

    if t.inputs and bad(t.inputs[0]):
        first = t.paths[0][-1]  # the first block module's name
        return NonFinite(False, None, "embedding", f"{first} input", bad(t.inputs[0]), Stats.of(t.inputs[0]))
    for i, rec in enumerate(t.records):
        values = {**rec, BLOCK_INPUT: t.inputs[i]}
        for site in wiring(model).sites:
            if site.name in rec and bad(rec[site.name]):
                source = values.get(site.inputs[0], t.inputs[i])
                return NonFinite(False, i, site.kind, site.name, bad(rec[site.name]), Stats.of(source))
        if bad(t.outputs[i]):  # a variant that records nothing still gets its layer named
            return NonFinite(False, i, "block", "output", bad(t.outputs[i]), Stats.of(t.inputs[i]))
    if bad(t.output):
        last = t.stack_output if t.stack_output is not None else t.outputs[-1]
        return NonFinite(False, None, "output", "final norm / head", bad(t.output), Stats.of(last))
    return NonFinite(True)
