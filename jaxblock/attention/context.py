"""Context-parallel attention: the sequence split over a mesh axis, each device holding L / C of it.

Shapes: q [N, L, H, K]; k, v [N, L, G, K] in the global view (R = H / G query heads per k/v head). Inside
the `shard_map` each device holds Q = L / C queries, keys and values (C: the context shards); J is a key
block of the online softmax (`attention.chunk_size`, or the largest divisor of the key range below it).

Two strategies, one online softmax (the chunked kernel's, with the queries' global positions):

- `all_gather`: each device all-gathers K and V ([N, L, G, K], O(L) per device) and runs over them in key
  blocks; the backward reduce-scatters dK and dV. One collective each way, the simplest and on a fast
  interconnect the quickest.
- `ring`: K and V blocks travel around the ring of C devices (`ppermute`, C - 1 hops), each device folding
  the block it holds into its queries' running softmax; memory O(L / C) per device. The backward is written
  by hand: dQ stays, and dK, dV travel with their block and arrive back at its owner after C hops.

Masks: the keys' side of every mask covers the whole sequence. `valid_tokens` and `segment_ids` ([N, L],
small) enter every device whole, an `attn_mask` by its query rows; causal and window masks compare global
indices (a device's queries start at its shard index times Q). Positions (RoPE) are applied before, in the
global view. A query that sees no key gets exactly 0, as in every kernel of the package.

The mesh comes from the ambient abstract mesh and Flax's logical-axis rules (`platform.mesh_layout`): the
logical axis 'length' names the context axis; 'batch' and 'heads'/'kv_heads' shard too where they divide.
The strategy is `context_strategy(...)`'s (set by `train/` from `parallel.context_strategy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxblock import masks
from jaxblock.attention import online_softmax
from jaxblock.attention.platform import MeshLayout, mesh_layout

STRATEGIES = ("all_gather", "ring")
_STRATEGY: contextvars.ContextVar[str] = contextvars.ContextVar("jaxblock_context_strategy", default="all_gather")


@contextlib.contextmanager
def context_strategy(name: str) -> Iterator[str]:
    """Use strategy `name` ('all_gather' or 'ring') for the context-parallel attention traced inside."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown context strategy {name!r}: use one of {', '.join(STRATEGIES)}")
    token = _STRATEGY.set(name)
    try:
        yield name
    finally:
        _STRATEGY.reset(token)


def current_strategy() -> str:
    return _STRATEGY.get()


def context_shards(layout: MeshLayout | None = None) -> int:
    """C: the devices one sequence is split over (1 without an ambient mesh that shards 'length')."""
    layout = layout if layout is not None else mesh_layout()
    return 1 if layout is None else layout.size(layout.length)


class _Static(NamedTuple):
    causal: bool
    chunk: int
    axes: tuple[str, ...]  # the mesh axes of 'length'
    shards: int  # C
    has_attn: bool
    has_window: bool


class _Masks(NamedTuple):
    """What decides whether one of this device's queries may see key j (j a global index)."""

    valid: jax.Array  # bool[N, L]: the whole sequence
    seg: jax.Array  # int[N, L]: the keys' segments, whole sequence
    seg_q: jax.Array  # int[N, Q]: this device's queries' segments
    attn: jax.Array  # bool[1 or N, Q, L]: this device's rows of attn_mask (unused without one)
    window: jax.Array  # int scalar (unused without a window)
    q0: jax.Array  # int scalar: the global index of this device's first query


def context_attention(
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
    layout: MeshLayout | None = None,
    strategy: str | None = None,
) -> jax.Array:
    """ctx [N, L, H, K], the sequence split over the mesh axes of 'length' (global view in and out).

    L must be a multiple of C (the training runner pads batches to one). Same masks and the same
    exact-zero rule for queries with no visible key as every other kernel.
    """
    layout = layout if layout is not None else mesh_layout()
    if layout is None or not layout.length:
        raise ValueError("context_attention needs an ambient mesh whose 'length' axis is sharded")
    strategy = strategy or current_strategy()
    n, length, h, kdim = q.shape
    g = k.shape[2]
    shards = layout.size(layout.length)
    if length % shards:
        raise ValueError(
            f"sequence length {length} does not split over {shards} context shards: pad it to a multiple of {shards}"
        )
    batch = layout.batch if n % layout.size(layout.batch) == 0 else ()
    heads = layout.heads if layout.heads == layout.kv_heads and h % layout.size(layout.heads) == 0 \
        and g % layout.size(layout.heads) == 0 else ()
    e = MeshLayout.entry
    qkv_spec = P(e(batch), e(layout.length), e(heads), None)
    rows_spec = P(e(batch), None)  # the whole sequence: the keys' side of every mask
    seg = segment_ids if segment_ids is not None else jnp.zeros((n, length), jnp.int32)
    if attn_mask is None:
        attn, attn_spec = jnp.zeros((1, length, 1), jnp.bool_), P(None, e(layout.length), None)
    elif attn_mask.ndim == 2:
        attn, attn_spec = attn_mask[None], P(None, e(layout.length), None)
    else:
        attn, attn_spec = attn_mask, P(e(batch), e(layout.length), None)
    win = jnp.asarray(-1 if window is None else window, jnp.int32)
    st = _Static(causal, chunk_size, layout.length, shards, attn_mask is not None, window is not None)

    def local(ql: jax.Array, kl: jax.Array, vl: jax.Array, valid: jax.Array, sg: jax.Array, am: jax.Array,
              wn: jax.Array) -> jax.Array:
        nl, lq, hl, _ = ql.shape
        gl = kl.shape[2]
        q0 = jax.lax.axis_index(st.axes) * lq
        m = _Masks(valid, sg, jax.lax.dynamic_slice_in_dim(sg, q0, lq, axis=1), am, wn, q0)
        qg = ql.reshape(nl, lq, gl, hl // gl, kdim)  # [N, Q, G, R, K]
        if strategy == "ring":
            out = _ring(qg, kl, vl, m, st)
        else:
            kf = jax.lax.all_gather(kl, st.axes, axis=1, tiled=True)  # [N, L, G, K]
            vf = jax.lax.all_gather(vl, st.axes, axis=1, tiled=True)
            out = _gathered(qg, kf, vf, m, st)
        return out.transpose(0, 3, 1, 2, 4).reshape(nl, lq, hl, kdim)  # [N, G, R, Q, K] -> [N, Q, H, K]

    run = jax.shard_map(
        local, mesh=layout.mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, rows_spec, rows_spec, attn_spec, P()),
        out_specs=qkv_spec, check_vma=False,
    )
    return run(q, k, v, valid_tokens, seg, attn, win)


# --- the online softmax over one key range ---------------------------------------------------------------


def _chunk(keys: int, chunk: int) -> int:
    """The key-block size J: the largest divisor of `keys` that is at most `chunk`."""
    return max(d for d in range(1, min(chunk, keys) + 1) if keys % d == 0)


def _mask(m: _Masks, k0: jax.Array, j: int, *, st: _Static) -> jax.Array:
    """bool[N, 1, 1, Q, J]: which of this device's queries may see keys [k0, k0 + J) (global indices)."""
    lq = m.seg_q.shape[1]
    ok = jax.lax.dynamic_slice_in_dim(m.valid, k0, j, axis=1)[:, None, :]  # [N, 1, J]
    ok = ok & (m.seg_q[:, :, None] == jax.lax.dynamic_slice_in_dim(m.seg, k0, j, axis=1)[:, None, :])
    if st.has_attn:
        ok = ok & jax.lax.dynamic_slice_in_dim(m.attn, k0, j, axis=2)  # [1 or N, Q, J]
    qi, kj = m.q0 + jnp.arange(lq), k0 + jnp.arange(j)
    if st.causal:
        ok = ok & (qi[:, None] >= kj[None, :])[None]
    if st.has_window:
        ok = ok & masks.window_mask(qi, kj, m.window)[None]
    return ok[:, None, None]  # [N, Q, J] -> [N, 1, 1, Q, J]


def _fold(carry: online_softmax.Carry, qg: jax.Array, kb: jax.Array, vb: jax.Array, m: _Masks, k0: jax.Array,
          st: _Static) -> online_softmax.Carry:
    """Fold keys [k0, k0 + kb.shape[1]) (global indices) into this device's queries' running softmax."""
    mask_at = functools.partial(_mask, m, st=st)
    return online_softmax.fold(carry, qg, kb, vb, mask_at, k0, _chunk(kb.shape[1], st.chunk))


def _backward(qg: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, kb: jax.Array, vb: jax.Array,
              m: _Masks, k0: jax.Array, st: _Static) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This device's queries' share of the gradients for keys [k0, k0 + kb.shape[1]), float32."""
    mask_at = functools.partial(_mask, m, st=st)
    return online_softmax.grads(qg, do, lse, delta, kb, vb, mask_at, k0, _chunk(kb.shape[1], st.chunk))


# --- all_gather: the whole sequence's keys on every device ----------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gathered(qg: jax.Array, kf: jax.Array, vf: jax.Array, m: _Masks, st: _Static) -> jax.Array:
    """qg [N, Q, G, R, K], kf/vf [N, L, G, K] -> out [N, G, R, Q, K]."""
    return _gathered_fwd(qg, kf, vf, m, st)[0]


def _gathered_fwd(qg: jax.Array, kf: jax.Array, vf: jax.Array, m: _Masks, st: _Static
                  ) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lse = online_softmax.finish(_fold(online_softmax.start(qg), qg, kf, vf, m, jnp.int32(0), st), qg.dtype)
    return out, (qg, kf, vf, m, out, lse)


def _gathered_bwd(st: _Static, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    qg, kf, vf, m, out, lse = res
    dq, dk, dv = _backward(qg, dout.astype(qg.dtype), lse, online_softmax.row_term(dout, out), kf, vf, m,
                           jnp.int32(0), st)
    return dq.astype(qg.dtype), dk.astype(kf.dtype), dv.astype(vf.dtype), jax.tree.map(lambda _: None, m)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


# --- ring: key/value blocks passed around the devices ---------------------------------------------------


def _source_start(st: _Static, hops: jax.Array, block: int) -> jax.Array:
    """The global index of the first key of the block a device holds after `hops` passes: each pass moves
    every block one device on, so device i then holds device (i - hops)'s block."""
    return ((jax.lax.axis_index(st.axes) - hops) % st.shards) * block


def _pass_on(st: _Static, *xs: jax.Array) -> list[jax.Array]:
    perm = [(i, (i + 1) % st.shards) for i in range(st.shards)]
    return [jax.lax.ppermute(x, st.axes, perm) for x in xs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(qg: jax.Array, kl: jax.Array, vl: jax.Array, m: _Masks, st: _Static) -> jax.Array:
    """qg [N, Q, G, R, K], kl/vl [N, Q, G, K] (this device's block) -> out [N, G, R, Q, K]."""
    return _ring_fwd(qg, kl, vl, m, st)[0]


def _ring_fwd(qg: jax.Array, kl: jax.Array, vl: jax.Array, m: _Masks, st: _Static
              ) -> tuple[jax.Array, tuple[Any, ...]]:
    block = kl.shape[1]
    carry = _fold(online_softmax.start(qg), qg, kl, vl, m, _source_start(st, jnp.int32(0), block), st)

    def hop(state: tuple[online_softmax.Carry, jax.Array, jax.Array], s: jax.Array) -> tuple[Any, None]:
        carry, kb, vb = state
        kb, vb = _pass_on(st, kb, vb)
        return (_fold(carry, qg, kb, vb, m, _source_start(st, s, block), st), kb, vb), None

    (carry, _, _), _ = jax.lax.scan(hop, (carry, kl, vl), jnp.arange(1, st.shards))
    out, lse = online_softmax.finish(carry, qg.dtype)
    return out, (qg, kl, vl, m, out, lse)


def _ring_bwd(st: _Static, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    qg, kl, vl, m, out, lse = res
    block = kl.shape[1]
    do = dout.astype(qg.dtype)
    delta = online_softmax.row_term(dout, out)

    def visit(dq: jax.Array, kb: jax.Array, vb: jax.Array, dkb: jax.Array, dvb: jax.Array, s: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        dqs, dks, dvs = _backward(qg, do, lse, delta, kb, vb, m, _source_start(st, s, block), st)
        return dq + dqs, dkb + dks, dvb + dvs

    Hop = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]

    def hop(state: Hop, s: jax.Array) -> tuple[Hop, None]:
        dq, kb, vb, dkb, dvb = state
        dq, dkb, dvb = visit(dq, kb, vb, dkb, dvb, s)
        kb, vb, dkb, dvb = _pass_on(st, kb, vb, dkb, dvb)  # a block's gradients travel with it
        return (dq, kb, vb, dkb, dvb), None

    zeros = jnp.zeros(kl.shape, jnp.float32)
    state, _ = jax.lax.scan(hop, (jnp.zeros(qg.shape, jnp.float32), kl, vl, zeros, zeros),
                            jnp.arange(st.shards - 1))
    dq, kb, vb, dkb, dvb = state
    dq, dkb, dvb = visit(dq, kb, vb, dkb, dvb, jnp.int32(st.shards - 1))
    dk, dv = _pass_on(st, dkb, dvb)  # the C-th pass brings each block's gradients home
    return dq.astype(qg.dtype), dk.astype(kl.dtype), dv.astype(vl.dtype), jax.tree.map(lambda _: None, m)


_ring.defvjp(_ring_fwd, _ring_bwd)


def context_rule(length: int | None) -> tuple[str, str] | None:
    """The dispatch rule: ('context', reason) when the ambient mesh splits 'length' and L divides over it."""
    layout = mesh_layout()
    if layout is None or not layout.length:
        return None
    shards = layout.size(layout.length)
    if length is not None and length % shards:
        return None
    how = {"all_gather": "K/V all-gathered, O(L) per device",
           "ring": "K/V blocks passed around the ring, O(L / C) per device"}[current_strategy()]
    return "context", f"the sequence is split over mesh axes {layout.length} ({shards} shards): {how}"
