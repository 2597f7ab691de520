"""EncoderBlock: self-attention and FFN, each in a residual branch, in the Pre-LN or Post-LN placement.

Pre-LN:   U = X + Drop(MHA(LN1(X)))        Y = U + Drop(FFN(LN2(U)))
Post-LN:  U = LN1(X + Drop(MHA(X)))        Y = LN2(U + Drop(FFN(U)))

X, U, Y are [N, L, D]. Two distinct norm instances: attn_norm (LN1) and ffn_norm (LN2). Recorded intermediates
(collection 'intermediates'): norm1, attn_branch, after_attn, norm2, ffn_branch, after_ffn, where
`after_*` is the residual sum and `norm*` is that norm's output. The same wiring as data (order, which
submodule computes each value, from what) is `jaxblock.wiring`; tests/jaxblock/test_block.py keeps the two equal.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.attention import SelfAttention
from jaxblock.config import BlockConfig
from jaxblock.ffn import FeedForward
from jaxblock.kernels.dropout import Dropout
from jaxblock.norms import make_norm
from jaxblock.wiring import WIRINGS

# The values each block sows into "intermediates", in execution order for each placement.
RECORDED_SITES = {placement: wiring.order for placement, wiring in WIRINGS.items()}
# The logical axes of the residual stream [N, L, D] between blocks: a mesh splits rows and sequence, never D
# (parameters' D axis is "embed"; activations' is "act_embed"). Outside a mesh and its rules, no constraint.
TOKENS = ("batch", "length", "act_embed")


class EncoderBlock(nn.Module):
    """(x [N, L, D], valid_tokens bool[N, L]) -> [N, L, D]. `train=True` turns dropout on."""

    config: BlockConfig
    window_choices: tuple[int, ...] = ()  # the stack's per-layer windows (SelfAttention.window_choices)

    def setup(self) -> None:
        cfg = self.config
        # Distinct instances; named for their branch because `norm1`/`norm2` name the recorded outputs.
        self.attn_norm = make_norm(cfg)
        if cfg.ablate != "attention":
            self.self_attn = SelfAttention(cfg, window_choices=self.window_choices)
        self.ffn_norm = make_norm(cfg)
        if cfg.ablate != "ffn":
            self.ffn = FeedForward(cfg)
        self.attn_residual_dropout = Dropout(cfg.residual_dropout, gradients=cfg.gradients)
        self.ffn_residual_dropout = Dropout(cfg.residual_dropout, gradients=cfg.gradients)

    def __call__(
        self,
        x: jax.Array,
        valid_tokens: jax.Array,
        *,
        attn_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        per_layer: dict[str, jax.Array] | None = None,
        train: bool = False,
    ) -> jax.Array:
        """per_layer: this layer's row of LayersConfig.per_layer (window, rope_base, attn_norm scalars)."""
        cfg = self.config
        layer = per_layer or {}
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, cfg.model_dim)
        masks.check_valid_tokens(valid_tokens, x.shape[:2])
        # A padded token holding a non-finite value becomes 0: attention and pooling keep padding out of real
        # outputs, but a NaN/Inf there would still reach every weight gradient (0 * NaN in the backward matmuls).
        x = _finite_padding(x, valid_tokens, cfg.compute_dtype)
        x = nn.with_logical_constraint(x, TOKENS)

        def attn(h: jax.Array) -> jax.Array:
            if cfg.ablate == "attention":
                return self._record("attn_branch", jnp.zeros_like(h))
            a = self.self_attn(
                h, valid_tokens, attn_mask=attn_mask, segment_ids=segment_ids,
                positions=positions, window=layer.get("window"), rope_base=layer.get("rope_base"), train=train,
            )
            return self._record("attn_branch", self.attn_residual_dropout(a, deterministic=not train))

        def ffn(h: jax.Array) -> jax.Array:
            if cfg.ablate == "ffn":
                return self._record("ffn_branch", jnp.zeros_like(h))
            f = self.ffn(h, train=train)
            return self._record("ffn_branch", self.ffn_residual_dropout(f, deterministic=not train))

        if cfg.norm == "pre":
            h = self.attn_norm(x)
            if "attn_norm" in layer:  # a layer without the norm before attention reads x itself
                h = jnp.where(layer["attn_norm"], h, x.astype(h.dtype))
            u = self._record("after_attn", x + attn(self._record("norm1", h)))
            y = self._record("after_ffn", u + ffn(self._record("norm2", self.ffn_norm(u))))
        else:
            u = self._record("norm1", self.attn_norm(self._record("after_attn", x + attn(x))))
            y = self._record("norm2", self.ffn_norm(self._record("after_ffn", u + ffn(u))))

        chex.assert_equal_shape([x, y])
        return nn.with_logical_constraint(y, TOKENS)

    def _record(self, name: str, value: jax.Array) -> jax.Array:
        """Sow `value` as the recorded site `name` and pass it on (the diagnostics read these sites)."""
        self.sow("intermediates", name, value)
        return value


def _finite_padding(x: jax.Array, valid_tokens: jax.Array, dtype: Any) -> jax.Array:
    """x [N, L, D] in `dtype`, each padded token that holds a non-finite value set to 0 (all its D values).

    The choice is made per token, a bool [N, L], so the backward (the gradient passes where the token is
    kept) reads that mask and not x: an elementwise test of x would keep x, or the float32 value it was cast
    from, alive for the backward in every layer."""
    clear = ~valid_tokens & ~jnp.all(jnp.isfinite(x), axis=-1)  # bool [N, L]
    return jnp.where(clear[..., None], jnp.zeros((), x.dtype), x).astype(dtype)
