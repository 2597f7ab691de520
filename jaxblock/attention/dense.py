"""Attention with the [L, L] scores in memory and a hand-written backward pass: the CPU kernel.

Forward, per key/value head (q [N, L, H, K]; k, v [N, L, G, K]; R = H / G query heads per k/v head):

    S = (Q / sqrt(K)) K^T + B    B: 0 where a query may see a key, float32's lowest value where not
    P = softmax(S) * seen        seen: 1 for a query that sees at least one key, else 0
    P' = P * keep / (1 - rate)   attention-weight dropout (training only; keep: bool, the shape of P)
    O = P' V                     (so 0 for a query that sees no key)

Backward, with the softmax gradient in its row-sum form:

    dV = P'^T dO      dP = (dO V^T) * keep / (1 - rate)      delta = rowsum(dO * O)
    dS = P * (dP - delta)      dQ = dS K / sqrt(K)      dK = dS^T Q / sqrt(K)

A query that sees no key has P = 0 (a constant), so its O, delta and dS are 0: the same values and
gradients as zeroing its output afterwards, without a select over [N, L, H, K] in each direction.
The textbook form is `delta = rowsum(P * dP)`; `rowsum(dO * O)` is the same number (O = P' V) from an
[L, K] product instead of an [L, L] one, and the identity holds with dropout too.

Why a kernel of our own: autodiff of the plain softmax reduces over [L, L] twice more and, on XLA's
CPU backend, lays the batched matmuls out with transposed operands; a boolean select as the mask
(instead of the additive B) kept the scores out of the matmul's fusion. At the benchmark shapes this
forward plus backward took ~0.55x (N16 L128 H4) and ~0.4x (N8 L256 H8) of the time of XLA's
`dot_product_attention` (docs/performance.md: how it is measured).

Layout: heads are laid out [N, G, R*L, K] (the R query heads of one k/v head stacked along the
rows), so every product is one plain batched matmul over (N, G); q, k, v and the output are
transposed once each, outside the custom VJP (each transpose is one copy in XLA's program: ~10 ms of the
D256 training step; projecting straight into this layout measured slower).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.kernels.dropout import dropped


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    seen: jax.Array,
    keep: jax.Array | None = None,
    rate: float = 0.0,
) -> jax.Array:
    """Multi-head attention -> ctx [N, L, H, K].

    q [N, L, H, K]; k, v [N, L, G, K]; mask bool[N or 1, 1, L, L], True = the query (row) may see the
    key (column); seen bool[N, L]: the query sees at least one key (its output is 0 otherwise);
    keep bool[N, G, R, L, L] or None: the attention weights dropout keeps, each scaled by 1 / (1 - rate).
    """
    n, length, h, kdim = q.shape
    g = k.shape[2]
    r = h // g
    q = q * jnp.asarray(1.0 / math.sqrt(kdim), q.dtype)
    qh = q.reshape(n, length, g, r, kdim).transpose(0, 2, 3, 1, 4).reshape(n, g, r * length, kdim)
    kh = k.transpose(0, 2, 1, 3)  # [N, G, L, K]
    vh = v.transpose(0, 2, 1, 3)
    bias = jnp.where(mask, 0.0, masks.NEG)  # [N or 1, 1, L, L] float32
    rows = seen.astype(jnp.float32)[:, None, :, None]  # [N, 1, L, 1]
    if r > 1:  # the same rows for each of the R stacked query heads
        bias = jnp.broadcast_to(bias[:, :, None], (bias.shape[0], 1, r, length, length))
        bias = bias.reshape(bias.shape[0], 1, r * length, length)
        rows = jnp.tile(rows, (1, 1, r, 1))
    keep4 = None if keep is None else keep.reshape(n, g, r * length, length)
    out = _core(qh, kh, vh, bias, rows, keep4, float(rate))  # [N, G, R*L, K]
    return out.reshape(n, g, r, length, kdim).transpose(0, 3, 1, 2, 4).reshape(n, length, h, kdim)


def _weights(qh: jax.Array, kh: jax.Array, bias: jax.Array, rows: jax.Array) -> jax.Array:
    """P [N, G, R*L, L] float32: softmax over the keys of the (pre-scaled) scores plus the mask bias,
    times `rows` (1 where the query sees a key, 0 where it sees none)."""
    s = jnp.einsum("NGQK,NGMK->NGQM", qh, kh, preferred_element_type=jnp.float32) + bias
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True) * rows


def _dropped(p: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """Dropout with a given mask, as flax.linen.Dropout computes it: kept / (1 - rate), dropped 0."""
    return p if keep is None else dropped(p, keep, rate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _core(qh: jax.Array, kh: jax.Array, vh: jax.Array, bias: jax.Array, rows: jax.Array,
          keep: jax.Array | None, rate: float) -> jax.Array:
    """qh [N, G, R*L, K] (scaled), kh/vh [N, G, L, K], bias [N or 1, 1, R*L, L], rows [N, 1, R*L, 1]
    -> [N, G, R*L, K]."""
    return _core_fwd(qh, kh, vh, bias, rows, keep, rate)[0]


def _core_fwd(
    qh: jax.Array, kh: jax.Array, vh: jax.Array, bias: jax.Array, rows: jax.Array, keep: jax.Array | None,
    rate: float,
) -> tuple[jax.Array, tuple[Any, ...]]:
    p = _weights(qh, kh, bias, rows)
    pv = _dropped(p, keep, rate).astype(vh.dtype)
    out = jnp.einsum("NGQM,NGMK->NGQK", pv, vh, preferred_element_type=jnp.float32).astype(qh.dtype)
    return out, (qh, kh, vh, p, keep, out)


def _core_bwd(rate: float, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    qh, kh, vh, p, keep, out = res
    dt = qh.dtype
    do = dout.astype(dt)
    pv = _dropped(p, keep, rate).astype(dt)
    # dV and dK are computed transposed ([.., K, L]) and swapped back: that form puts the [L, K] operand
    # first, which XLA's CPU backend runs ~1.5x faster than dS^T Q at L = 256, and the swap folds into
    # the head transpose outside the kernel.
    dv = jnp.einsum("NGQK,NGQM->NGKM", do, pv, preferred_element_type=jnp.float32).swapaxes(-1, -2)
    dp = _dropped(jnp.einsum("NGQK,NGMK->NGQM", do, vh, preferred_element_type=jnp.float32), keep, rate)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)  # [N, G, R*L, 1]
    ds = (p * (dp - delta)).astype(dt)
    dq = jnp.einsum("NGQM,NGMK->NGQK", ds, kh, preferred_element_type=jnp.float32)
    dk = jnp.einsum("NGQK,NGQM->NGKM", qh, ds, preferred_element_type=jnp.float32).swapaxes(-1, -2)
    return dq.astype(dt), dk.astype(kh.dtype), dv.astype(vh.dtype), None, None, None


_core.defvjp(_core_fwd, _core_bwd)
