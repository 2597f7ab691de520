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
        # A row of length 0 (a padding row of the batch) goes in as length 1: cuDNN's backward leaves the dK and
        # dV of a length-0 sequence unwritten (bench.kernel_parity's "no-key rows" on a GPU). Its one query then
        # sees its first key, and the `where` below makes its output 0, so every gradient of that row is 0.
        lengths = jnp.maximum(masks.valid_tokens_to_lengths(valid_tokens), 1)
        ctx = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation="cudnn",
        )
    else:
        ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    # A query that sees no key gets exactly 0 (the fused softmax would average all keys).
    seen = masks.sees_a_key(mask, valid_tokens, causal=causal, plain=plain)
    return jnp.where(seen[:, :, None, None], ctx, jnp.zeros((), ctx.dtype))
