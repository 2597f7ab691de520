"""Multi-head self-attention with padding masks, causal, GQA, RoPE and a choice of kernel.

Shapes: x [N, L, D]; q [N, L, H, K]; k, v [N, L, G, K] with G key/value heads (G divides H,
R = H / G query heads share one k/v head); output [N, L, D].

Parameters (one submodule each, so the tree maps onto PyTorch's in_proj/out_proj):
query kernel [D, H, K], key/value kernels [D, G, K], out kernel [H, K, D]; biases [H, K], [G, K], [D].

Every path gives a query with no visible key an attention-weighted sum of exactly 0 (the output is
then the out-projection bias), with finite values and gradients.
"""

from __future__ import annotations

import math
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.config import BlockConfig
from jaxblock.initializers import Weights, bias_init, kernel_init
from jaxblock.positions import apply_rope

_NEG = float(jnp.finfo(jnp.float32).min)


def choose_implementation(
    config: BlockConfig, *, train: bool, backend: str | None = None, extra_mask: bool = False
) -> tuple[str, str]:
    """(implementation, reason) for this config and call; pure Python, usable for reporting.

    extra_mask: an attn_mask or segment_ids is present (cuDNN's fused kernel takes only
    sequence lengths and causal).
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
        return "unfused", "attention-weight dropout is active in training (fused kernels have none)"
    why = _cudnn_blocker(config, backend, extra_mask)
    if why is None:
        return "cudnn", "NVIDIA GPU, half precision, padding/causal mask only"
    return "xla", why


def _cudnn_blocker(config: BlockConfig, backend: str, extra_mask: bool) -> str | None:
    if backend != "gpu":
        return f"backend is {backend}, not an NVIDIA GPU"
    if config.dtype not in ("bfloat16", "float16"):
        return f"dtype {config.dtype} (cuDNN flash attention needs bfloat16/float16)"
    if extra_mask:
        return "an attn_mask or segment_ids is present (cuDNN takes only lengths and causal)"
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

        def proj(kshape: tuple[int, ...], kinit: Any, bshape: tuple[int, ...], binit: Any) -> Weights:
            return Weights(kshape, kinit, bshape, binit, cfg.use_bias, cfg.params_dtype)

        self.query = proj(
            (d, h, k), kernel_init(cfg.init, d, 0, (1, 2), ("embed", "heads", "head_dim"), xavier),
            (h, k), zero_bias,
        )
        self.key = proj(
            (d, g, k), kernel_init(cfg.init, d, 0, (1, 2), ("embed", "kv_heads", "head_dim"), xavier),
            (g, k), zero_kv_bias,
        )
        self.value = proj(
            (d, g, k), kernel_init(cfg.init, d, 0, (1, 2), ("embed", "kv_heads", "head_dim"), xavier),
            (g, k), zero_kv_bias,
        )
        self.out = proj(
            (h, k, d), kernel_init(cfg.init, d, (0, 1), 2, ("heads", "head_dim", "embed")),
            (d,), bias_init(cfg.init, d, ("embed",), zero=True),
        )
        self.weights_dropout = nn.Dropout(cfg.attn_dropout)

    def __call__(
        self,
        x: jax.Array,
        valid_tokens: jax.Array,
        *,
        attn_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        cfg = self.config
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, cfg.model_dim)
        masks.check_valid_tokens(valid_tokens, x.shape[:2])
        n, length, _ = x.shape
        dt = cfg.compute_dtype
        x = x.astype(dt)

        q, k, v = self._qkv(x)  # [N, L, H, K], [N, L, G, K], [N, L, G, K]
        if cfg.rope:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(length), (n, length))
            q = apply_rope(q, positions, cfg.rope_base)
            k = apply_rope(k, positions, cfg.rope_base)

        impl, _ = choose_implementation(
            cfg, train=train, extra_mask=attn_mask is not None or segment_ids is not None
        )
        if impl == "chunked":
            ctx = chunked_attention(
                q, k, v, valid_tokens, causal=cfg.causal, attn_mask=attn_mask,
                segment_ids=segment_ids, chunk_size=cfg.attn_chunk_size,
            )
        else:
            mask = masks.attention_mask(
                valid_tokens, causal=cfg.causal, attn_mask=attn_mask, segment_ids=segment_ids
            )  # [N, 1, L, L]
            if impl == "unfused":
                ctx = self._unfused(q, k, v, mask, train)
            else:
                ctx = self._fused(q, k, v, mask, valid_tokens, impl, plain=attn_mask is None and segment_ids is None)
        # ctx: [N, L, H, K]
        out_k, out_b = self.out()
        y = jnp.einsum("NLHK,HKD->NLD", ctx.astype(dt), out_k.astype(dt))
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
            qkv = jnp.einsum("NLD,DHK->NLHK", x, w)  # [N, L, 3H, K]
            if qb is not None and kb is not None and vb is not None:
                qkv = qkv + jnp.concatenate([qb, kb, vb], axis=0).astype(dt)[None, None]
            return qkv[:, :, :h], qkv[:, :, h : 2 * h], qkv[:, :, 2 * h :]
        outs: list[jax.Array] = []
        for kern, b in ((qk, qb), (kk, kb), (vk, vb)):
            y = jnp.einsum("NLD,DHK->NLHK", x, kern.astype(dt))
            outs.append(y if b is None else y + b.astype(dt)[None, None])
        return outs[0], outs[1], outs[2]

    def _unfused(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        """Explicit softmax; records the weights and applies attention-weight dropout."""
        n, length, h, kdim = q.shape
        g = k.shape[2]
        qg = q.reshape(n, length, g, h // g, kdim)  # [N, L, G, R, K]
        logits = jnp.einsum(
            "NQGRK,NSGK->NGRQS", qg, k, preferred_element_type=jnp.float32
        ) / math.sqrt(kdim)  # [N, G, R, L, L]
        m = mask[:, :, None]  # [N, 1, 1, L, L]
        logits = jnp.where(m, logits, _NEG)
        weights = jnp.where(m, jax.nn.softmax(logits, axis=-1), 0.0)
        self.sow("intermediates", "attention_weights", weights.reshape(n, h, length, length))
        weights = self.weights_dropout(weights, deterministic=not train)
        ctx = jnp.einsum("NGRQS,NSGK->NQGRK", weights.astype(v.dtype), v)
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
        seen = jnp.any(mask, axis=-1)[:, 0, :, None, None]  # [N, L, 1, 1]
        return jnp.where(seen, ctx, jnp.zeros((), ctx.dtype))


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
) -> jax.Array:
    """Memory-efficient attention: online softmax over key blocks of `chunk_size`.

    Never materializes [L, L] scores: each step holds [N, G, R, L, C]; the step body is
    rematerialized so the backward pass stores only the running (max, sum, accumulator).
    Same masks and the same exact-zero rule for queries with no visible key.
    """
    n, length, h, kdim = q.shape
    g = k.shape[2]
    r = h // g
    c = min(chunk_size, length)
    pad = (-length) % c
    nchunks = (length + pad) // c
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    validp = jnp.pad(valid_tokens, ((0, 0), (0, pad)))
    seg = segment_ids if segment_ids is not None else jnp.zeros((n, length), jnp.int32)
    segp = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    am = attn_mask if attn_mask is not None else jnp.ones((length, length), jnp.bool_)
    am = am if am.ndim == 3 else am[None]
    amp = jnp.pad(am, ((0, 0), (0, 0), (0, pad)))  # [1 or N, L, Lp]

    qg = q.reshape(n, length, g, r, kdim)  # [N, L, G, R, K]
    scale = 1.0 / math.sqrt(kdim)
    qpos = jnp.arange(length)

    @jax.checkpoint
    def body(carry: tuple[jax.Array, jax.Array, jax.Array], i: jax.Array) -> tuple[Any, None]:
        m_run, l_run, acc = carry
        start = i * c
        k_c = jax.lax.dynamic_slice_in_dim(kp, start, c, axis=1)  # [N, C, G, K]
        v_c = jax.lax.dynamic_slice_in_dim(vp, start, c, axis=1)
        ok = jax.lax.dynamic_slice_in_dim(validp, start, c, axis=1)[:, None, :]  # [N, 1, C]
        kseg = jax.lax.dynamic_slice_in_dim(segp, start, c, axis=1)
        ok = ok & (seg[:, :, None] == kseg[:, None, :])  # [N, L, C]
        ok = ok & jax.lax.dynamic_slice_in_dim(amp, start, c, axis=2)  # [1 or N, L, C]
        if causal:
            ok = ok & (qpos[:, None] >= (start + jnp.arange(c))[None, :])[None]
        mk = ok[:, None, None]  # [N, 1, 1, L, C]
        s = jnp.einsum("NQGRK,NCGK->NGRQC", qg, k_c, preferred_element_type=jnp.float32) * scale
        s = jnp.where(mk, s, _NEG)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))  # [N, G, R, L]
        p = jnp.exp(s - m_new[..., None]) * mk
        corr = jnp.exp(m_run - m_new)
        l_new = l_run * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("NGRQC,NCGK->NGRQK", p.astype(v.dtype), v_c, preferred_element_type=jnp.float32)
        acc = acc * corr[..., None] + pv
        return (m_new, l_new, acc), None

    init = (
        jnp.full((n, g, r, length), _NEG, jnp.float32),
        jnp.zeros((n, g, r, length), jnp.float32),
        jnp.zeros((n, g, r, length, kdim), jnp.float32),
    )
    (_, l_fin, acc), _ = jax.lax.scan(body, init, jnp.arange(nchunks))
    out = jnp.where(l_fin[..., None] > 0, acc / jnp.where(l_fin > 0, l_fin, 1.0)[..., None], 0.0)
    # [N, G, R, L, K] -> [N, L, H, K]
    return out.transpose(0, 3, 1, 2, 4).reshape(n, length, h, kdim).astype(q.dtype)
