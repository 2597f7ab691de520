"""XLA's and cuDNN's fused attention (`jax.nn.dot_product_attention`), with the package's no-key rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxblock import masks


def fused_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, valid_tokens: jax.Array, impl: str,
    *, causal: bool, plain: bool,
) -> jax.Array:
    """ctx [N, L, H, K]. impl 'cudnn' with a plain (padding/causal) mask passes sequence lengths to cuDNN's
    kernel; otherwise XLA's kernel takes the [N, 1, L, L] mask."""
    if impl == "cudnn" and plain:
        lengths = masks.valid_tokens_to_lengths(valid_tokens)
        ctx = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation="cudnn",
        )
    else:
        ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    # A query that sees no key gets exactly 0 (the fused softmax would average all keys).
    seen = masks.sees_a_key(mask, valid_tokens, causal=causal, plain=plain)
    return jnp.where(seen[:, :, None, None], ctx, jnp.zeros((), ctx.dtype))
