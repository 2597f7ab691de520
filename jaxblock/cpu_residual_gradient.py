"""A CPU-only speed workaround, kept out of the block's equations: store the residual gradient once.

The residual stream's gradient is a chain of adds and norm backward passes through every later
block, and XLA's CPU fusion otherwise re-derives it inside each of its consumers (the norm
reductions, the input-gradient matmul and the transposed copy feeding each weight gradient):
O(B^2) elementwise work for B blocks, with strided reads. `settle_gradient` is an identity whose
backward divides by a runtime 1.0, an op XLA will not duplicate, so the gradient at that point is
computed once and stored. Values and gradients are bitwise the same with and without it.

Where: every residual-stream value a residual add reads (the block input and, from the wiring, the
stream between the two sublayers). Both are needed: in one interleaved run of the Pre-LN float32
training step at N16 L128 D256 B4 on a 2-core CPU, settling only the block input or only the
mid-block stream was as slow as not settling at all (0.88x, 0.85x, 0.89x of settling both).
Other backends gain nothing, so it applies on CPU only. `EncoderStack` installs it around each block
with `settled_residuals`; this module is the only place that knows about it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock.cpu_switch import CpuSwitch
from jaxblock.wiring import wiring_of

_SWITCH = CpuSwitch()
applies = _SWITCH.applies  # () -> bool: on for XLA's CPU backend unless forced
forced = _SWITCH.forced  # (enabled) -> context manager: force on or off while tracing (the bench's variant)


@jax.custom_vjp
def settle_gradient(x: jax.Array, one: jax.Array) -> jax.Array:
    """Identity; its backward divides the incoming gradient by `one` (a runtime 1.0: exact)."""
    return x


def _settle_fwd(x: jax.Array, one: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, one


def _settle_bwd(one: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g / one.astype(g.dtype), jnp.zeros_like(one)


settle_gradient.defvjp(_settle_fwd, _settle_bwd)


def runtime_one(valid_tokens: jax.Array) -> jax.Array:
    """float32 1.0 computed from the mask, so XLA cannot fold the division away."""
    return (jnp.sum(valid_tokens, dtype=jnp.int32) >= 0).astype(jnp.float32)


@contextmanager
def settled_residuals(block: nn.Module, x: jax.Array, valid_tokens: jax.Array) -> Iterator[None]:
    """While `block` is called on `x`: settle its input and the residual stream points its wiring names.

    A Flax method interceptor: it sees the block's `__call__` (its input) and its `_record` calls
    (the values it records and goes on using), so the block's code stays the equations alone. Nothing
    to settle when neither `x` nor the block's variables are traced (an eager forward pass: no gradient).
    """
    if not _SWITCH.applies_to(x, block.variables):
        yield
        return
    one = runtime_one(valid_tokens)
    stream = set(wiring_of(block.config).stream)

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, ctx: Any) -> Any:
        if ctx.module is not block:
            return next_fun(*args, **kwargs)
        if ctx.method_name == "__call__":
            args = (settle_gradient(args[0], one), *args[1:])
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        if ctx.method_name == "_record" and args[0] in stream:
            return settle_gradient(out, one)
        return out

    with nn.intercept_methods(interceptor):
        yield
