"""The projections' einsum, y = x W (x [N, L, *I], W [*I, *O]), with its weight gradient written for a CPU.

    y = einsum("NLD,DF->NLF", x, w)                      # jnp.einsum's value; on a CPU, this kernel's backward
    y = einsum("NLD,DF->NLF", x, w, gradients="plain")   # jnp.einsum itself on every platform

Why: the weight gradient dW = x^T dy is a product over the N·L tokens. XLA's CPU backend hands dots to XNNPACK,
which takes no transposed operand, so one of x [T, I] and dy [T, O] is first copied transposed, and XLA picks
which one by its layout rules, not by size: in the FFN's up-projection it copied dy [T, F] rather than the four
times smaller x [T, D]. Here the backward transposes the smaller of the two, behind an optimization barrier so
XLA cannot fold the transpose back into the dot, and when dy is the smaller it keeps the small [O, I] result's
transpose out of the dot too. dx = dy W^T is JAX's own. The values are the same sums in another order (float32
rounding, ~1e-7 relative); tests/jaxblock/kernels/test_projection.py holds them to the plain einsum.

Chosen by the platform the step is traced for (jaxblock/attention/platform.py `target_platform`), as the attention
kernels are: on a CPU this one, elsewhere `jnp.einsum` (an accelerator's compiler chooses its own layouts).
`python -m bench.e2e` measures what it buys end to end (bench/records/e2e-main-*.md); run.json records the
choice and its reason (`kernel`).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from jaxblock.attention.platform import target_platform

Gradients = Literal["auto", "plain"]


def kernel(gradients: Gradients = "auto") -> tuple[str, str]:
    """(kernel, reason) of the projections for the platform being traced for, as run.json records it."""
    if gradients == "plain":
        return "einsum", "model.block.gradients=plain: JAX's autodiff of the einsum on every platform"
    if target_platform() == "cpu":
        return "smaller_operand_transposed", (
            "CPU: the weight gradient transposes the smaller of x and dy (XNNPACK takes no transposed operand, "
            "and XLA picks the copy by layout, not size)"
        )
    return "einsum", "off the CPU: JAX's autodiff of the einsum (the compiler chooses the layouts)"


def einsum(spec: str, x: jax.Array, w: jax.Array, *, gradients: Gradients = "auto") -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a projection: x's trailing axes contract with w's leading ones, in order
    ("NLD,DF->NLF", "NLD,DHK->NLHK", "NLHK,HKD->NLD"). Any other spec is jnp.einsum on every platform."""
    contract = _contracted(spec)
    if contract is None or kernel(gradients)[0] == "einsum":
        return jnp.einsum(spec, x, w)
    lead, inner, outer = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :], w.shape[contract:]
    if inner != w.shape[:contract]:
        raise ValueError(f"einsum {spec!r}: x's last axes {inner} do not match w's first {w.shape[:contract]}")
    y = _matmul(x.reshape(*lead, math.prod(inner)), w.reshape(math.prod(inner), math.prod(outer)))
    return y.reshape(*lead, *outer)


def _contracted(spec: str) -> int | None:
    """How many trailing axes of x contract with w's leading axes in `spec`, or None if it is not that form."""
    inputs, _, out = spec.replace(" ", "").partition("->")
    xs, _, ws = inputs.partition(",")
    shared = [a for a in xs if a in ws]
    c = len(shared)
    if not c or xs[len(xs) - c :] != ws[:c] or out != xs[: len(xs) - c] + ws[c:]:
        return None
    if len(set(xs + ws)) != len(xs + ws) - c:  # a label repeated within x or within w
        return None
    return c


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
