"""The online softmax over key blocks (flash attention's recurrence), forward and backward: the one loop the
chunked kernel (chunked.py) and the context-parallel kernel (context.py) both run.

Shapes: the queries qg [N, Q, G, R, K] (R query heads per key/value head), a key range kb, vb [N, M, G, K]
whose first key has the global index k0, folded J keys at a time (J divides M). `mask_at(start, J)` says which
(query, key) pairs of keys [start, start + J) may attend: bool[N, 1, 1, Q, J].

Forward, per block: scores S = Q K^T / sqrt(K), masked to NEG; a running max m, a running sum l of exp(S - m)
and an accumulator of exp(S - m) V, each rescaled by exp(m_old - m_new) when the max moves. `finish` divides
the accumulator by l (0 for a query that saw no key) and gives each query's log-sum-exp, the backward's
residual: it recomputes each block's P = exp(S - lse) instead of keeping [Q, M] scores.

Backward, with delta = rowsum(dO * O): dV = P^T dO, dP = dO V^T, dS = P (dP - delta) / sqrt(K), dQ = dS K,
dK = dS^T Q. A query with no visible key has P = 0 throughout, so its gradients are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxblock.masks import NEG

Carry = tuple[jax.Array, jax.Array, jax.Array]  # running max, running sum [N, G, R, Q]; acc [N, G, R, Q, K]
MaskAt = Callable[[jax.Array, int], jax.Array]  # (first key's global index, J) -> bool[N, 1, 1, Q, J]


def start(qg: jax.Array) -> Carry:
    n, q, g, r, kdim = qg.shape
    return (jnp.full((n, g, r, q), NEG, jnp.float32), jnp.zeros((n, g, r, q), jnp.float32),
            jnp.zeros((n, g, r, q, kdim), jnp.float32))


def fold(carry: Carry, qg: jax.Array, kb: jax.Array, vb: jax.Array, mask_at: MaskAt, k0: Any, j: int) -> Carry:
    """Fold keys [k0, k0 + M) into the running softmax, J keys at a time."""
    scale = 1.0 / math.sqrt(qg.shape[-1])

    def body(carry: Carry, i: jax.Array) -> tuple[Carry, None]:
        m_run, l_run, acc = carry
        kc = jax.lax.dynamic_slice_in_dim(kb, i * j, j, axis=1)  # [N, J, G, K]
        vc = jax.lax.dynamic_slice_in_dim(vb, i * j, j, axis=1)
        mk = mask_at(k0 + i * j, j)
        s = jnp.einsum("NQGRK,NJGK->NGRQJ", qg, kc, preferred_element_type=jnp.float32) * scale
        s = jnp.where(mk, s, NEG)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))  # [N, G, R, Q]
        p = jnp.where(mk, jnp.exp(s - m_new[..., None]), 0.0)  # [N, G, R, Q, J]
        corr = jnp.exp(m_run - m_new)
        pv = jnp.einsum("NGRQJ,NJGK->NGRQK", p.astype(vb.dtype), vc, preferred_element_type=jnp.float32)
        return (m_new, l_run * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv), None

    carry, _ = jax.lax.scan(body, carry, jnp.arange(kb.shape[1] // j))
    return carry


def finish(carry: Carry, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """out [N, G, R, Q, K] (0 for a query that saw no key) and each query's log-sum-exp [N, G, R, Q]."""
    m_fin, l_fin, acc = carry
    seen = l_fin > 0
    l_safe = jnp.where(seen, l_fin, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0).astype(dtype)
    return out, jnp.where(seen, m_fin + jnp.log(l_safe), 0.0)


def row_term(dout: jax.Array, out: jax.Array) -> jax.Array:
    """delta = rowsum(dO * O) [N, G, R, Q]: the softmax gradient's row term (0 for a query that saw no key)."""
    return jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)


def grads(qg: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, kb: jax.Array, vb: jax.Array,
          mask_at: MaskAt, k0: Any, j: int, key_dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """These queries' share of the gradients for keys [k0, k0 + M): dQ [N, Q, G, R, K] float32, dK and dV
    [N, M, G, K] in `key_dtype` (each block's are computed once, so casting them block by block is exact)."""
    scale = 1.0 / math.sqrt(qg.shape[-1])

    def body(dq: jax.Array, i: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        kc = jax.lax.dynamic_slice_in_dim(kb, i * j, j, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(vb, i * j, j, axis=1)
        mk = mask_at(k0 + i * j, j)
        s = jnp.einsum("NQGRK,NJGK->NGRQJ", qg, kc, preferred_element_type=jnp.float32) * scale
        p = jnp.where(mk, jnp.exp(s - lse[..., None]), 0.0)  # [N, G, R, Q, J]
        dv = jnp.einsum("NGRQJ,NGRQK->NJGK", p.astype(vb.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum("NGRQK,NJGK->NGRQJ", do, vc, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None]) * scale).astype(qg.dtype)
        dq = dq + jnp.einsum("NGRQJ,NJGK->NQGRK", ds, kc, preferred_element_type=jnp.float32)
        dk = jnp.einsum("NGRQJ,NQGRK->NJGK", ds, qg, preferred_element_type=jnp.float32)
        return dq, (dk.astype(key_dtype), dv.astype(key_dtype))

    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(qg.shape, jnp.float32), jnp.arange(kb.shape[1] // j))
    # Per-block key gradients [M/J, N, J, G, K] -> [N, M, G, K]
    dk = jnp.moveaxis(dk, 0, 1).reshape(kb.shape[0], -1, *kb.shape[2:])
    dv = jnp.moveaxis(dv, 0, 1).reshape(vb.shape[0], -1, *vb.shape[2:])
    return dq, dk, dv
