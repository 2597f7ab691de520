"""Measurements by depth: residual ratios, gradient norms, the first non-finite sublayer.

Each reads the placement's wiring (jaxblock.wiring) for what to measure: which values a residual
add sums, and the order in which the sublayers run.
"""

from __future__ import annotations

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
    t = trace(model, v, batch)
    valid = batch["valid_tokens"]
    ratios: dict[str, list[float]] = {"attn": [], "ffn": []}
    for x, rec in zip(t.inputs, t.records, strict=True):
        values = {**rec, BLOCK_INPUT: x}
        for add in wiring(model).adds:
            stream, branch = add.inputs
            b, s = real(values[branch], valid), real(values[stream], valid)
            key = branch.removesuffix("_branch")
            ratios[key].append(float(np.linalg.norm(b)) / max(float(np.linalg.norm(s)), 1e-30))
    every = ratios["attn"] + ratios["ffn"]
    passed = bool(np.all(np.isfinite(every)) and max(every, default=0.0) <= limit)
    return ResidualRatios(block_config(model).norm, ratios["attn"], ratios["ffn"], limit, passed)


def grad_norms_by_depth(model: nn.Module, variables: Any, batch: Batch, loss_fn: LossFn) -> GradNorms:
    """Eval-mode gradients of loss_fn(model(batch), batch)."""
    model, v = prepare(model, variables)
    paths = block_paths(model, v, batch)
    shape = (*model_input(batch).shape[:2], block_config(model).model_dim)

    def loss_of(params: Any, deltas: list[jax.Array]) -> jax.Array:
        out = trace(model, {**v, "params": params}, batch, deltas=deltas).output
        loss = loss_fn(out, batch)
        return loss[0] if isinstance(loss, tuple) else loss

    deltas = [jnp.zeros(shape, jnp.float32) for _ in paths]
    loss, (g_params, g_inputs) = jax.value_and_grad(loss_of, argnums=(0, 1))(v["params"], deltas)
    layers = [subtree(g_params, p) for p in paths]
    param_grad = [float(optax.tree.norm(layer)) for layer in layers]
    ffn_out = [float(jnp.linalg.norm(layer[_FFN.module][_FFN.out_projection]["kernel"]))
               if _FFN.module in layer else 0.0 for layer in layers]
    input_grad = [float(jnp.linalg.norm(g)) for g in g_inputs]
    passed = bool(np.all(np.isfinite([float(loss), *input_grad, *param_grad])))
    return GradNorms(float(loss), input_grad, param_grad, ffn_out, passed)


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
