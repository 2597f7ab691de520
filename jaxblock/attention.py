"""Multi-head self-attention with padding masks, causal, GQA, RoPE and a choice of kernel.

Shapes: x [N, L, D]; q [N, L, H, K]; k, v [N, L, G, K] with G key/value heads (G divides H,
R = H / G query heads share one k/v head); output [N, L, D]. Inside the einsums Q and M index query
and key positions (both of length L) and J a key block of the chunked kernel.

Parameters (one submodule each, so the tree maps onto PyTorch's in_proj/out_proj):
query kernel [D, H, K], key/value kernels [D, G, K], out kernel [H, K, D]; biases [H, K], [G, K], [D].

Every path gives a query with no visible key an attention-weighted sum of exactly 0 (the output is
then the out-projection bias), with finite values and gradients.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.config import BlockConfig
from jaxblock.cpu_weight_gradient import project
from jaxblock.dense_attention import dense_attention
from jaxblock.initializers import Weights, bias_init, kernel_init
from jaxblock.positions import apply_rope, rope_frequencies

_NEG = float(jnp.finfo(jnp.float32).min)


def choose_implementation(
    config: BlockConfig,
    *,
    train: bool,
    backend: str | None = None,
    extra_mask: bool = False,
    length: int | None = None,
) -> tuple[str, str]:
    """(implementation, reason) for this config and call; pure Python, usable for reporting.

    extra_mask: an attn_mask, segment_ids or a per-layer window is present (cuDNN's fused kernel takes only
    sequence lengths and causal). length: L of the call; on a CPU, 'auto' picks the chunked
    kernel from 4 key blocks (L >= 4 * attn_chunk_size) on, where it measured faster than XLA's
    (1.26x at L=2048 and 1.38x at L=4096, with a third and a fifth of the memory: python -m bench --only length).
    """
    backend = backend or jax.default_backend()
    dropout_on = train and config.attn_dropout > 0
    if config.attention != "auto":
        if config.attention in ("xla", "cudnn", "chunked") and dropout_on:
            return "unfused", f"attention='{config.attention}' has no attention-weight dropout; unfused ran"
        if config.attention == "cudnn":
            why = _cudnn_blocker(config, backend, extra_mask)
            if why:
                return "xla", f"cuDNN requested but {why}; XLA ran"
        return config.attention, f"attention='{config.attention}' requested"
    if dropout_on:
        if backend == "cpu":
            return "dense", "attention-weight dropout is active in training; on a CPU the dense kernel applies it"
        return "unfused", "attention-weight dropout is active in training (fused kernels have none)"
    why = _cudnn_blocker(config, backend, extra_mask)
    if why is None:
        return "cudnn", "NVIDIA GPU, half precision, padding/causal mask only"
    if backend == "cpu":
        if length is not None and length >= 4 * config.attn_chunk_size:
            return "chunked", (
                f"{why}; L={length} >= 4 key blocks of {config.attn_chunk_size}: chunked attention, "
                "memory linear in L, no [L, L] scores"
            )
        return "dense", f"{why}; on a CPU the dense kernel (hand-written backward) beats XLA's"
    return "xla", why


def _cudnn_blocker(config: BlockConfig, backend: str, extra_mask: bool) -> str | None:
    if backend != "gpu":
        return f"backend is {backend}, not an NVIDIA GPU"
    if config.dtype not in ("bfloat16", "float16"):
        return f"dtype {config.dtype} (cuDNN flash attention needs bfloat16/float16)"
    if extra_mask:
        return "an attn_mask, segment_ids or attention window is present (cuDNN takes only lengths and causal)"
    if config.head_dim % 8 or config.head_dim > 256:
        return f"head width {config.head_dim} (cuDNN needs a multiple of 8, at most 256)"
    return None


class SelfAttention(nn.Module):
    """Multi-head self-attention. Call: (x [N, L, D], valid_tokens bool[N, L]) -> [N, L, D]."""

    config: BlockConfig

    def setup(self) -> None:
        cfg = self.config
        d, h, g, k = cfg.model_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        xavier = math.sqrt(6.0 / (d + 3 * d))  # PyTorch's in_proj_weight is one [3D, D] matrix
        zero_bias = bias_init(cfg.init, d, ("heads", "head_dim"), zero=True)
        zero_kv_bias = bias_init(cfg.init, d, ("kv_heads", "head_dim"), zero=True)

        def proj(
            kshape: tuple[int, ...], kinit: Any, bshape: tuple[int, ...], binit: Any, use_bias: bool
        ) -> Weights:
            return Weights(kshape, kinit, bshape, binit, use_bias, cfg.params_dtype)

        self.query = proj(
            (d, h, k), kernel_init(cfg.init, d, 0, (1, 2), ("embed", "heads", "head_dim"), xavier),
            (h, k), zero_bias, cfg.has_qkv_bias,
        )
        self.key = proj(
            (d, g, k), kernel_init(cfg.init, d, 0, (1, 2), ("embed", "kv_heads", "head_dim"), xavier),
            (g, k), zero_kv_bias, cfg.has_qkv_bias,
        )
        self.value = proj(
            (d, g, k), kernel_init(cfg.init, d, 0, (1, 2), ("embed", "kv_heads", "head_dim"), xavier),
            (g, k), zero_kv_bias, cfg.has_qkv_bias,
        )
        self.out = proj(
            (h, k, d), kernel_init(cfg.init, d, (0, 1), 2, ("heads", "head_dim", "embed")),
            (d,), bias_init(cfg.init, d, ("embed",), zero=True), cfg.has_out_bias,
        )
        self.weights_dropout = _WeightsDropout(cfg.attn_dropout)

    def __call__(
        self,
        x: jax.Array,
        valid_tokens: jax.Array,
        *,
        attn_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        window: jax.Array | None = None,
        rope_base: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        """window: int scalar, keys at most this far on either side (-1: all); rope_base: float scalar
        replacing config.rope_base (both per layer, from StackConfig's layer_windows / layer_rope_bases)."""
        cfg = self.config
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, cfg.model_dim)
        masks.check_valid_tokens(valid_tokens, x.shape[:2])
        n, length, _ = x.shape
        dt = cfg.compute_dtype
        x = x.astype(dt)

        q, k, v = self._qkv(x)  # [N, L, H, K], [N, L, G, K], [N, L, G, K]
        # Padded positions may hold anything (even NaN from an out-of-range pad id). Their keys are
        # masked, but weight 0 times a NaN value is NaN, so their values are cleared too.
        v = jnp.where(valid_tokens[:, :, None, None], v, jnp.zeros((), v.dtype))
        if cfg.rope:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(length), (n, length))
            inv = None if cfg.rope_scaling is None else rope_frequencies(cfg.head_dim, cfg.rope_base, cfg.rope_scaling)
            base: Any = cfg.rope_base if rope_base is None else rope_base
            q = apply_rope(q, positions, base, inv)
            k = apply_rope(k, positions, base, inv)

        extra = attn_mask is not None or segment_ids is not None or window is not None
        impl, _ = choose_implementation(cfg, train=train, extra_mask=extra, length=length)
        if impl == "chunked":
            ctx = chunked_attention(
                q, k, v, valid_tokens, causal=cfg.causal, attn_mask=attn_mask,
                segment_ids=segment_ids, chunk_size=cfg.attn_chunk_size, window=window,
            )
        else:
            mask = masks.attention_mask(
                valid_tokens, causal=cfg.causal, attn_mask=attn_mask, segment_ids=segment_ids, window=window
            )  # [N, 1, L, L]
            if impl == "unfused":
                ctx = self._unfused(q, k, v, mask, train)
            elif impl == "dense":
                keep = None
                if train and cfg.attn_dropout > 0:
                    keep = self.weights_dropout.keep((n, cfg.kv_heads, cfg.num_heads // cfg.kv_heads, length, length))
                seen = _seen(mask, valid_tokens, causal=cfg.causal, plain=not extra)
                ctx = dense_attention(q, k, v, mask, seen, keep, cfg.attn_dropout)
            else:
                ctx = self._fused(q, k, v, mask, valid_tokens, impl, plain=not extra)
        # ctx: [N, L, H, K]
        out_k, out_b = self.out()
        y = project(ctx.astype(dt), out_k.astype(dt), 2)  # "NLHK,HKD->NLD" (jaxblock/cpu_weight_gradient.py)
        if out_b is not None:
            y = y + out_b.astype(dt)[None, None, :]
        return y

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        dt = cfg.compute_dtype
        (qk, qb), (kk, kb), (vk, vb) = self.query(), self.key(), self.value()
        h, g = cfg.num_heads, cfg.kv_heads
        if cfg.fused_qkv and g == h:
            w = jnp.concatenate([qk, kk, vk], axis=1).astype(dt)  # [D, 3H, K]
            qkv = project(x, w, 1)  # "NLD,DHK->NLHK": [N, L, 3H, K]
            if qb is not None and kb is not None and vb is not None:
                qkv = qkv + jnp.concatenate([qb, kb, vb], axis=0).astype(dt)[None, None]
            return qkv[:, :, :h], qkv[:, :, h : 2 * h], qkv[:, :, 2 * h :]
        outs: list[jax.Array] = []
        for kern, b in ((qk, qb), (kk, kb), (vk, vb)):
            y = project(x, kern.astype(dt), 1)
            outs.append(y if b is None else y + b.astype(dt)[None, None])
        return outs[0], outs[1], outs[2]

    def _unfused(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        """Explicit softmax; records the weights and applies attention-weight dropout."""
        n, length, h, kdim = q.shape
        g = k.shape[2]
        qg = q.reshape(n, length, g, h // g, kdim)  # [N, L, G, R, K]
        logits = jnp.einsum(
            "NQGRK,NMGK->NGRQM", qg, k, preferred_element_type=jnp.float32
        ) / math.sqrt(kdim)  # [N, G, R, L, L]
        m = mask[:, :, None]  # [N, 1, 1, L, L]
        logits = jnp.where(m, logits, _NEG)
        weights = jnp.where(m, jax.nn.softmax(logits, axis=-1), 0.0)
        self.sow("intermediates", "attention_weights", weights.reshape(n, h, length, length))
        weights = self.weights_dropout(weights, deterministic=not train)
        ctx = jnp.einsum("NGRQM,NMGK->NQGRK", weights.astype(v.dtype), v)
        return ctx.reshape(n, length, h, kdim)

    def _fused(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, valid_tokens: jax.Array,
        impl: str, plain: bool,
    ) -> jax.Array:
        cfg = self.config
        if impl == "cudnn" and plain:
            lengths = masks.valid_tokens_to_lengths(valid_tokens)
            ctx = jax.nn.dot_product_attention(
                q, k, v, is_causal=cfg.causal, query_seq_lengths=lengths,
                key_value_seq_lengths=lengths, implementation="cudnn",
            )
        else:
            ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        # A query that sees no key gets exactly 0 (the fused softmax would average all keys).
        seen = _seen(mask, valid_tokens, causal=cfg.causal, plain=plain)
        return jnp.where(seen[:, :, None, None], ctx, jnp.zeros((), ctx.dtype))


def _seen(mask: jax.Array, valid_tokens: jax.Array, *, causal: bool, plain: bool) -> jax.Array:
    """bool[N, L]: the query sees at least one key. With padding (and causal) only, that is O(N L) from
    valid_tokens, not a reduction of the [N, 1, L, L] mask."""
    if not plain:
        return jnp.any(mask, axis=-1)[:, 0]
    if causal:  # query i sees a key iff some key j <= i is real
        return jax.lax.cummax(valid_tokens.astype(jnp.int32), axis=1) > 0
    return jnp.broadcast_to(jnp.any(valid_tokens, axis=-1, keepdims=True), valid_tokens.shape)


class _WeightsDropout(nn.Dropout):
    """nn.Dropout that can also hand out its keep mask, for kernels that apply dropout inside themselves.

    `keep` draws from the same rng stream, with the same shape, as calling the module on the weights
    would, so the dense kernel drops exactly the weights the unfused path drops."""

    def keep(self, shape: tuple[int, ...]) -> jax.Array:
        return jax.random.bernoulli(self.make_rng(self.rng_collection), 1.0 - self.rate, shape)


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


def _block_mask(m: _KeyMasks, start: jax.Array, c: int, causal: bool) -> jax.Array:
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


def _block(kp: jax.Array, vp: jax.Array, start: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    return (jax.lax.dynamic_slice_in_dim(kp, start, c, axis=1),  # [N, J, G, K]
            jax.lax.dynamic_slice_in_dim(vp, start, c, axis=1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(qg: jax.Array, kp: jax.Array, vp: jax.Array, m: _KeyMasks, causal: bool, c: int) -> jax.Array:
    """qg [N, L, G, R, K], kp/vp [N, Lp, G, K] -> out [N, G, R, L, K]."""
    return _flash_fwd(qg, kp, vp, m, causal, c)[0]


def _flash_fwd(
    qg: jax.Array, kp: jax.Array, vp: jax.Array, m: _KeyMasks, causal: bool, c: int
) -> tuple[jax.Array, tuple[Any, ...]]:
    n, length, g, r, kdim = qg.shape
    scale = 1.0 / math.sqrt(kdim)

    def body(carry: tuple[jax.Array, jax.Array, jax.Array], i: jax.Array) -> tuple[Any, None]:
        m_run, l_run, acc = carry
        k_c, v_c = _block(kp, vp, i * c, c)
        mk = _block_mask(m, i * c, c, causal)
        s = jnp.einsum("NQGRK,NJGK->NGRQJ", qg, k_c, preferred_element_type=jnp.float32) * scale
        s = jnp.where(mk, s, _NEG)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))  # [N, G, R, L]
        p = jnp.where(mk, jnp.exp(s - m_new[..., None]), 0.0)  # [N, G, R, L, J]
        corr = jnp.exp(m_run - m_new)
        pv = jnp.einsum("NGRQJ,NJGK->NGRQK", p.astype(vp.dtype), v_c, preferred_element_type=jnp.float32)
        return (m_new, l_run * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv), None

    init = (
        jnp.full((n, g, r, length), _NEG, jnp.float32),
        jnp.zeros((n, g, r, length), jnp.float32),
        jnp.zeros((n, g, r, length, kdim), jnp.float32),
    )
    (m_fin, l_fin, acc), _ = jax.lax.scan(body, init, jnp.arange(kp.shape[1] // c))
    seen = l_fin > 0  # [N, G, R, L]: the query sees at least one key
    l_safe = jnp.where(seen, l_fin, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0).astype(qg.dtype)
    lse = jnp.where(seen, m_fin + jnp.log(l_safe), 0.0)  # log-sum-exp of each query's scores
    return out, (qg, kp, vp, m, out, lse)


def _flash_bwd(causal: bool, c: int, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    qg, kp, vp, m, out, lse = res
    scale = 1.0 / math.sqrt(qg.shape[-1])
    do = dout.astype(qg.dtype)  # [N, G, R, L, K]
    # d(softmax): dS = P * (dP - rowsum(dO * O)); a query with no visible key has P = 0 throughout.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [N, G, R, L]

    def body(dq: jax.Array, i: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        k_c, v_c = _block(kp, vp, i * c, c)
        mk = _block_mask(m, i * c, c, causal)
        s = jnp.einsum("NQGRK,NJGK->NGRQJ", qg, k_c, preferred_element_type=jnp.float32) * scale
        p = jnp.where(mk, jnp.exp(s - lse[..., None]), 0.0)  # [N, G, R, L, J]
        dv = jnp.einsum("NGRQJ,NGRQK->NJGK", p.astype(vp.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum("NGRQK,NJGK->NGRQJ", do, v_c, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None]) * scale).astype(qg.dtype)
        dq = dq + jnp.einsum("NGRQJ,NJGK->NQGRK", ds, k_c, preferred_element_type=jnp.float32)
        dk = jnp.einsum("NGRQJ,NQGRK->NJGK", ds, qg, preferred_element_type=jnp.float32)
        return dq, (dk.astype(kp.dtype), dv.astype(vp.dtype))

    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(qg.shape, jnp.float32), jnp.arange(kp.shape[1] // c))
    # Per-block key gradients [Lp/J, N, J, G, K] -> [N, Lp, G, K]
    dk = jnp.moveaxis(dk, 0, 1).reshape(kp.shape)
    dv = jnp.moveaxis(dv, 0, 1).reshape(vp.shape)
    no_grad = jax.tree.map(lambda _: None, m)  # masks are not differentiable
    return dq.astype(qg.dtype), dk, dv, no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)
