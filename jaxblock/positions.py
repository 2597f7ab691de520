"""Positions: sinusoidal and learned absolute tables, and rotary (RoPE) on q/k.

Layouts:
- sinusoidal [L, D]: feature 2i is sin(p / 10000^(2i/D)), feature 2i+1 is cos of the same angle
  (Vaswani et al.); fixed, not a parameter; added to the embedding.
- learned [max_len, D]: a parameter `pos_embedding` (axes (None, 'embed')); rows [0, L) are added.
- rotary: the head's K features are split in two halves (x1 = [:K/2], x2 = [K/2:]), rotated as
  (x1 cos - x2 sin, x2 cos + x1 sin) with angle p / base^(2i/K) (the GPT-NeoX / Llama layout).
  Scores q.k then depend only on the offset between the two positions. Scaled variants (linear,
  llama3) only change the frequencies (rope_frequencies).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.config import RopeScaling


def sinusoidal_table(length: int, dim: int) -> jax.Array:
    """float32[L, D] fixed sinusoidal positions."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = pos * inv[None, :]  # [L, ceil(D/2)]
    table = np.zeros((length, dim), np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : dim // 2])
    return jnp.asarray(table, jnp.float32)


def rope_frequencies(head_dim: int, base: float, scaling: RopeScaling) -> np.ndarray:
    """float32[K/2] scaled rotary frequencies, as transformers computes them for rope_type 'linear'/'llama3'."""
    inv = 1.0 / (np.float32(base) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    if scaling.type == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array, positions: jax.Array, base: float = 10000.0, inv_freq: np.ndarray | None = None
) -> jax.Array:
    """Rotate x: [N, L, H, K] by positions: int[N, L]; computed in float32, returned in x.dtype.

    inv_freq: float32[K/2] frequencies replacing base^(-2i/K) (scaled RoPE, see rope_frequencies)."""
    k = x.shape[-1]
    half = k // 2
    if inv_freq is None:
        inv = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / k))  # [K/2]
    else:
        inv = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv[None, None, :]  # [N, L, K/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [N, L, 1, K/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
