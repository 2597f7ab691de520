"""A CPU-only speed workaround, kept out of the block's equations: each weight gradient transposes its
smaller operand.

A projection y = x W (x [T, I] over the T = N·L tokens, W [I, O]) has the weight gradient
dW = x^T dy, a product over T. XLA's CPU backend hands dots to XNNPACK, which takes no transposed
operand, so one of x [T, I] and dy [T, O] is first copied transposed, and XLA chooses which one by
its layout rules, not by size: in the FFN's up-projection it transposed dh [T, F] (8 MiB at N16 L128
F1024) rather than x [T, D] (2 MiB). `project` is the projection with a custom VJP whose weight
gradient transposes the smaller of the two, behind an optimization barrier so XLA cannot fold the
transpose back into the dot. The input gradient dx = dy W^T is unchanged.

The values are the same sums in another order (float32 rounding differs, ~1e-7 relative). Measured in
one interleaved run each (Pre-LN float32 training step on a 2-core AMD EPYC, the dense attention kernel
on): 1.07x at N16 L128 D256 B4 and 1.11x at N8 L256 D512 B4 (docs/performance-cpu.md); keeping the
small result's transpose out of the dot (below) another 1.04x at D256 (neutral at D512). Applied on the
CPU backend only, like jaxblock/cpu_residual_gradient.py; elsewhere `project` is the plain product.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxblock.cpu_switch import CpuSwitch, compiled_when_eager

_SWITCH = CpuSwitch()
applies = _SWITCH.applies  # () -> bool: on for XLA's CPU backend unless forced
forced = _SWITCH.forced  # (enabled) -> context manager: force on or off while tracing


@compiled_when_eager("contract")
def project(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """x [N, L, *I] times w [*I, *O] over the `contract` trailing axes of x (= the leading axes of w)
    -> [N, L, *O]. The same product as the einsum, e.g. "NLD,DHK->NLHK" with contract=1."""
    lead, inner, outer = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :], w.shape[contract:]
    if inner != w.shape[:contract]:
        raise ValueError(f"project: x's last {contract} axes {inner} do not match w's first {w.shape[:contract]}")
    x3, w2 = x.reshape(*lead, math.prod(inner)), w.reshape(math.prod(inner), math.prod(outer))
    y = _matmul(x3, w2) if _SWITCH.applies() else _product(x3, w2)
    return y.reshape(*lead, *outer)


def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...I,IO->...O", x, w)


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] @ w [I, O]; x keeps its leading axes (flattening them before the dot measured slower)."""
    return _product(x, w)


def _matmul_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _product(x, w), (x, w)


def _matmul_bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    dx = jnp.einsum("...O,IO->...I", dy, w)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # [T, I], [T, O]
    if x2.shape[1] <= dy2.shape[1]:  # x is the smaller: dW = (x^T) dy
        dw = jax.lax.optimization_barrier(x2.T) @ dy2
    else:  # dy is the smaller: dW = ((dy^T) x)^T, a transpose of the small [O, I] result
        # The second barrier keeps XLA from folding that transpose into the dot, which would make it a
        # transposed-operand dot that XNNPACK does not take (XLA's own, slower dot ran it instead).
        dw = jax.lax.optimization_barrier(jax.lax.optimization_barrier(dy2.T) @ x2).T
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
