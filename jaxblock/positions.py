"""Positions: sinusoidal and learned absolute tables, and rotary (RoPE) on q/k.

Layouts:
- sinusoidal [L, D]: feature 2i is sin(p / 10000^(2i/D)), feature 2i+1 is cos of the same angle
  (Vaswani et al.); fixed, not a parameter; added to the embedding.
- learned [max_len, D]: a parameter `pos_embedding` (axes (None, 'embed')); rows [0, L) are added.
- rotary: the head's K features are split in two halves (x1 = [:K/2], x2 = [K/2:]), rotated as
  (x1 cos - x2 sin, x2 cos + x1 sin) with angle p / base^(2i/K) (the GPT-NeoX / Llama layout).
  Scores q.k then depend only on the offset between the two positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sinusoidal_table(length: int, dim: int) -> jax.Array:
    """float32[L, D] fixed sinusoidal positions."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = pos * inv[None, :]  # [L, ceil(D/2)]
    table = np.zeros((length, dim), np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : dim // 2])
    return jnp.asarray(table, jnp.float32)


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotate x: [N, L, H, K] by positions: int[N, L]; computed in float32, returned in x.dtype."""
    k = x.shape[-1]
    half = k // 2
    inv = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / k))  # [K/2]
    angles = positions.astype(jnp.float32)[..., None] * inv[None, None, :]  # [N, L, K/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [N, L, 1, K/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
