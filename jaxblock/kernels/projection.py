"""The projections' einsum, y = x W (x [N, L, *I], W [*I, *O]), with its backward written for the platform.

    y = einsum("NLD,DF->NLF", x, w)                      # jnp.einsum's value; on a CPU or a GPU, this kernel's backward
    y = einsum("NLD,DF->NLF", x, w, gradients="plain")   # jnp.einsum itself on every platform

On a CPU. The weight gradient dW = x^T dy is a product over the N·L tokens. XLA's CPU backend hands dots to
XNNPACK, which takes no transposed operand, so one of x [T, I] and dy [T, O] is first copied transposed, and XLA
picks which one by its layout rules, not by size: in the FFN's up-projection it copied dy [T, F] rather than the
four times smaller x [T, D]. Here the backward transposes the smaller of the two, behind an optimization barrier
so XLA cannot fold the transpose back into the dot, and when dy is the smaller it keeps the small [O, I] result's
transpose out of the dot too. dx = dy W^T is JAX's own. The values are the same sums in another order (float32
rounding, ~1e-7 relative). `python -m bench.e2e` measures what it buys end to end (bench/records/e2e-main-*.md).

On a GPU. dW and dx are JAX's own products, returned through one optimization barrier: the backward of the layer
below cannot start (it needs dx) before this layer's weight gradients exist. Without it XLA's GPU scheduler put
the weight-gradient dots of every layer after the last layer's backward, so each layer's [N, L, F] activation
and gradient stayed live until the end of the step: BERT-base at L 512, 32 rows a chip, no remat, compiled for
h100-8 by XLA's GPU compiler on a CPU host (not run on a device), held the layers' FFN gradients at once
(`python -m train compile --dump` shows them in the peak's breakdown). dx and dW are the products JAX's
autodiff forms (the test holds them equal within float32 rounding).

On a TPU `jnp.einsum`: the TPU compiler orders the weight gradients itself (docs/accelerators.md, "What a layer
keeps for its backward"). Chosen by the platform the step is traced for (jaxblock/attention/platform.py
`target_platform`), as the attention kernels are; tests/jaxblock/kernels/test_projection.py holds both backwards
to the plain einsum; run.json records the choice and its reason (`kernel`).
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
    platform = target_platform()
    if platform == "cpu":
        return "smaller_operand_transposed", (
            "CPU: the weight gradient transposes the smaller of x and dy (XNNPACK takes no transposed operand, "
            "and XLA picks the copy by layout, not size)"
        )
    if platform == "gpu":
        return "weight_gradient_in_layer", (
            "GPU: each projection's weight gradient is computed with its dx (one optimization barrier), so the "
            "scheduler cannot hold every layer's activations and gradients for weight gradients at the end"
        )
    return "einsum", "TPU: JAX's autodiff of the einsum (the compiler orders the weight gradients itself)"


def einsum(spec: str, x: jax.Array, w: jax.Array, *, gradients: Gradients = "auto") -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a projection: x's trailing axes contract with w's leading ones, in order
    ("NLD,DF->NLF", "NLD,DHK->NLHK", "NLHK,HKD->NLD"). Any other spec is jnp.einsum on every platform."""
    contract = _contracted(spec)
    chosen = kernel(gradients)[0]
    if contract is None or chosen == "einsum":
        return jnp.einsum(spec, x, w)
    lead, inner, outer = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :], w.shape[contract:]
    if inner != w.shape[:contract]:
        raise ValueError(f"einsum {spec!r}: x's last axes {inner} do not match w's first {w.shape[:contract]}")
    matmul = _matmul if chosen == "smaller_operand_transposed" else _matmul_in_layer
    y = matmul(x.reshape(*lead, math.prod(inner)), w.reshape(math.prod(inner), math.prod(outer)))
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


@jax.custom_vjp
def _matmul_in_layer(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] @ w [I, O], its backward's dx and dW released together (the GPU's kernel)."""
    return _product(x, w)


def _matmul_in_layer_bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    dx = jnp.einsum("...O,IO->...I", dy, w)
    dw = jnp.einsum("...I,...O->IO", x, dy)
    dx, dw = jax.lax.optimization_barrier((dx, dw))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul_in_layer.defvjp(_matmul_fwd, _matmul_in_layer_bwd)
