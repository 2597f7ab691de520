"""Chunked (memory-efficient) attention: the online softmax over key blocks (online_softmax.py), flash style.

Shapes as in the package: q [N, L, H, K]; k, v [N, L, G, K]; J a key block (`attention.chunk_size`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.attention import online_softmax


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid_tokens: jax.Array,
    *,
    causal: bool,
    attn_mask: jax.Array | None,
    segment_ids: jax.Array | None,
    chunk_size: int,
    window: jax.Array | None = None,
) -> jax.Array:
    """Memory-efficient attention: online softmax over key blocks of `chunk_size` (J).

    Never materializes [L, L] scores: the forward holds [N, G, R, L, J] per key block and keeps only
    the output and the per-query log-sum-exp; the backward (flash-attention style, a custom VJP)
    recomputes each block's probabilities from them. Memory therefore grows linearly in L.
    Same masks and the same exact-zero rule for queries with no visible key.
    """
    n, length, h, kdim = q.shape
    g = k.shape[2]
    c = min(chunk_size, length)
    pad = (-length) % c
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))  # [N, Lp, G, K]
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    seg = segment_ids if segment_ids is not None else jnp.zeros((n, length), jnp.int32)
    amp = None
    if attn_mask is not None:
        am = attn_mask if attn_mask.ndim == 3 else attn_mask[None]
        amp = jnp.pad(am, ((0, 0), (0, 0), (0, pad)))  # [1 or N, L, Lp]
    keys = _KeyMasks(
        jnp.pad(valid_tokens, ((0, 0), (0, pad))), seg, jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1), amp,
        None if window is None else jnp.asarray(window, jnp.int32),
    )
    out = _flash(q.reshape(n, length, g, h // g, kdim), kp, vp, keys, causal, c)  # [N, G, R, L, K]
    return out.transpose(0, 3, 1, 2, 4).reshape(n, length, h, kdim)


class _KeyMasks(NamedTuple):
    """What decides whether query i may see key j, with keys padded to Lp (a multiple of J)."""

    valid: jax.Array  # bool[N, Lp]
    seg: jax.Array  # int[N, L]: the queries' segments
    seg_keys: jax.Array  # int[N, Lp]: the keys' segments (-1 on the block padding)
    attn_mask: jax.Array | None  # bool[1 or N, L, Lp]
    window: jax.Array | None = None  # int scalar: keys at most this far from the query (-1: all)


def _block_mask(m: _KeyMasks, start: jax.Array, c: int, *, causal: bool) -> jax.Array:
    """bool[N, 1, 1, L, J]: the (query, key) pairs of key block [start, start + J) that may attend."""
    length = m.seg.shape[1]
    ok = jax.lax.dynamic_slice_in_dim(m.valid, start, c, axis=1)[:, None, :]  # [N, 1, J]
    ok = ok & (m.seg[:, :, None] == jax.lax.dynamic_slice_in_dim(m.seg_keys, start, c, axis=1)[:, None, :])
    if m.attn_mask is not None:
        ok = ok & jax.lax.dynamic_slice_in_dim(m.attn_mask, start, c, axis=2)  # [1 or N, L, J]
    if causal:
        ok = ok & (jnp.arange(length)[:, None] >= (start + jnp.arange(c))[None, :])[None]
    if m.window is not None:
        ok = ok & masks.window_mask(jnp.arange(length), start + jnp.arange(c), m.window)[None]
    return ok[:, None, None]  # [N, L, J] -> [N, 1, 1, L, J]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(qg: jax.Array, kp: jax.Array, vp: jax.Array, m: _KeyMasks, causal: bool, c: int) -> jax.Array:
    """qg [N, L, G, R, K], kp/vp [N, Lp, G, K] -> out [N, G, R, L, K]."""
    return _flash_fwd(qg, kp, vp, m, causal, c)[0]


def _flash_fwd(
    qg: jax.Array, kp: jax.Array, vp: jax.Array, m: _KeyMasks, causal: bool, c: int
) -> tuple[jax.Array, tuple[Any, ...]]:
    mask_at = functools.partial(_block_mask, m, causal=causal)
    out, lse = online_softmax.finish(online_softmax.fold(online_softmax.start(qg), qg, kp, vp, mask_at, 0, c),
                                     qg.dtype)
    return out, (qg, kp, vp, m, out, lse)


def _flash_bwd(causal: bool, c: int, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    qg, kp, vp, m, out, lse = res
    mask_at = functools.partial(_block_mask, m, causal=causal)
    dq, dk, dv = online_softmax.grads(qg, dout.astype(qg.dtype), lse, online_softmax.row_term(dout, out), kp, vp,
                                      mask_at, 0, c, key_dtype=kp.dtype)
    no_grad = jax.tree.map(lambda _: None, m)  # masks are not differentiable
    return dq.astype(qg.dtype), dk, dv, no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)
