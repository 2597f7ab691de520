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

import math
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.attention.chunked import chunked_attention
from jaxblock.attention.context import context_attention
from jaxblock.attention.dense import dense_attention
from jaxblock.attention.dispatch import choose_implementation
from jaxblock.attention.gpu import pallas_gpu_attention
from jaxblock.attention.splash import splash_attention
from jaxblock.attention.xla import fused_attention
from jaxblock.config import BlockConfig
from jaxblock.initializers import Weights, bias_init, kernel_init
from jaxblock.kernels import projection
from jaxblock.kernels.dropout import Dropout
from jaxblock.positions import apply_rope, rope_frequencies


class SelfAttention(nn.Module):
    """Multi-head self-attention. Call: (x [N, L, D], valid_tokens bool[N, L]) -> [N, L, D]."""

    config: BlockConfig
    # The stack's distinct per-layer windows (LayersConfig.window_choices): kernels that need a static window
    # (splash) pick among them when the window arrives traced (a scanned stack).
    window_choices: tuple[int, ...] = ()

    def setup(self) -> None:
        cfg, att = self.config, self.config.attention
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
        # `keep` gives the dense kernel the unfused path's mask
        self.weights_dropout = Dropout(att.dropout, gradients=cfg.gradients)

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
        replacing config.attention.rope_base (both per layer, from StackConfig's layers.window / layers.rope_base)."""
        cfg, att = self.config, self.config.attention
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, cfg.model_dim)
        masks.check_valid_tokens(valid_tokens, x.shape[:2])
        n, length, _ = x.shape
        dt = cfg.compute_dtype
        x = x.astype(dt)

        q, k, v = self._qkv(x)  # [N, L, H, K], [N, L, G, K], [N, L, G, K]
        q = nn.with_logical_constraint(q, ("batch", "length", "act_heads", None))
        k = nn.with_logical_constraint(k, ("batch", "length", "act_kv_heads", None))
        v = nn.with_logical_constraint(v, ("batch", "length", "act_kv_heads", None))
        # Padded positions may hold anything (even NaN from an out-of-range pad id). Their keys are
        # masked, but weight 0 times a NaN value is NaN, so their values are cleared too.
        v = jnp.where(valid_tokens[:, :, None, None], v, jnp.zeros((), v.dtype))
        if att.rope:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(length), (n, length))
            inv = None if att.rope_scaling is None else rope_frequencies(cfg.head_dim, att.rope_base, att.rope_scaling)
            base: Any = att.rope_base if rope_base is None else rope_base
            q = apply_rope(q, positions, base, inv)
            k = apply_rope(k, positions, base, inv)

        known = None if window is None else masks.static_int(window)
        if known is not None and known < 0:
            window = None  # a global layer of a stack with windows (unscanned: its window is known here)
        extra = attn_mask is not None or segment_ids is not None or window is not None
        impl, _ = choose_implementation(
            cfg, train=train, segments=segment_ids is not None, window=window is not None,
            attn_mask=attn_mask is not None, length=length,
        )
        if impl == "context":
            ctx = context_attention(
                q, k, v, valid_tokens, causal=att.causal, attn_mask=attn_mask,
                segment_ids=segment_ids, chunk_size=att.chunk_size, window=window,
            )
        elif impl == "splash":
            ctx = splash_attention(
                q, k, v, valid_tokens, causal=att.causal, segment_ids=segment_ids, window=window,
                window_choices=self.window_choices,
            )
        elif impl == "pallas_gpu":
            ctx = pallas_gpu_attention(q, k, v, valid_tokens, causal=att.causal, segment_ids=segment_ids)
        elif impl == "chunked":
            ctx = chunked_attention(
                q, k, v, valid_tokens, causal=att.causal, attn_mask=attn_mask,
                segment_ids=segment_ids, chunk_size=att.chunk_size, window=window,
            )
        else:
            mask = masks.attention_mask(
                valid_tokens, causal=att.causal, attn_mask=attn_mask, segment_ids=segment_ids, window=window
            )  # [N, 1, L, L]
            if impl == "unfused":
                ctx = self._unfused(q, k, v, mask, train)
            elif impl == "dense":
                keep = None
                if train and att.dropout > 0:
                    keep = self.weights_dropout.keep((n, cfg.kv_heads, cfg.num_heads // cfg.kv_heads, length, length))
                seen = masks.sees_a_key(mask, valid_tokens, causal=att.causal, plain=not extra)
                ctx = dense_attention(q, k, v, mask, seen, keep, att.dropout)
            else:
                ctx = fused_attention(q, k, v, mask, valid_tokens, impl, causal=att.causal, plain=not extra)
        ctx = nn.with_logical_constraint(ctx, ("batch", "length", "act_heads", None))  # [N, L, H, K]
        out_k, out_b = self.out()
        y = projection.einsum("NLHK,HKD->NLD", ctx.astype(dt), out_k.astype(dt), gradients=cfg.gradients)
        if out_b is not None:
            y = y + out_b.astype(dt)[None, None, :]
        return y

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        dt = cfg.compute_dtype
        (qk, qb), (kk, kb), (vk, vb) = self.query(), self.key(), self.value()
        h, g = cfg.num_heads, cfg.kv_heads
        if cfg.attention.fused_qkv and g == h:
            # Stacked on an axis of their own, not concatenated along H: heads split over a mesh stay split the
            # same way in q, k and v, and taking each one out of the product moves nothing between devices.
            w = jnp.stack([qk, kk, vk], axis=1).astype(dt)  # [D, 3, H, K]
            qkv = projection.einsum("NLD,DTHK->NLTHK", x, w, gradients=cfg.gradients)  # [N, L, 3, H, K]
            if qb is not None and kb is not None and vb is not None:
                qkv = qkv + jnp.stack([qb, kb, vb], axis=0).astype(dt)[None, None]
            return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        outs: list[jax.Array] = []
        for kern, b in ((qk, qb), (kk, kb), (vk, vb)):
            y = projection.einsum("NLD,DGK->NLGK", x, kern.astype(dt), gradients=cfg.gradients)
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
        logits = jnp.where(m, logits, masks.NEG)
        weights = jnp.where(m, jax.nn.softmax(logits, axis=-1), 0.0)
        self.sow("intermediates", "attention_weights", weights.reshape(n, h, length, length))
        weights = self.weights_dropout(weights, deterministic=not train)
        ctx = jnp.einsum("NGRQM,NMGK->NQGRK", weights.astype(v.dtype), v)
        return ctx.reshape(n, length, h, kdim)

