"""The one mask convention, and its converters.

Inside the library every mask says True = "may attend" / "is real":

- `valid_tokens: bool[N, L]`: True at real tokens; real tokens first, padding at the end of a row.
- `causal` (config): query i sees keys j <= i.
- `attn_mask: bool[L, L] | bool[N, L, L]`: True where query (row) may attend to key (column).
- `segment_ids: int[N, L]`: packed rows; a query sees only keys of its own segment.

PyTorch's masks (True = ignore, or additive float) are converted here and only here.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

# The score of a key a query may not see: the lowest float32, finite (an exp() of it minus any real score is
# exactly 0), so a row with no visible key stays finite everywhere.
NEG = float(jnp.finfo(jnp.float32).min)


def check_valid_tokens(valid_tokens: jax.Array, batch_shape: tuple[int, ...]) -> None:
    """Trace-time check: valid_tokens must be bool[N, L] matching x's leading axes."""
    if valid_tokens.dtype != jnp.bool_:
        raise TypeError(
            f"valid_tokens must be bool (True = real token), got {valid_tokens.dtype}: "
            "pass `tokens != pad_id` or `.astype(bool)`"
        )
    if tuple(valid_tokens.shape) != tuple(batch_shape):
        raise ValueError(
            f"valid_tokens has shape {tuple(valid_tokens.shape)} but x is {tuple(batch_shape)} + [D]: "
            "pass one bool per token, shape [N, L]"
        )


def attention_mask(
    valid_tokens: jax.Array,
    *,
    causal: bool = False,
    attn_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    window: jax.Array | None = None,
) -> jax.Array:
    """Combine every mask into bool[N, 1, L, L] (query rows, key columns), True = may attend.

    window: int scalar (may be traced): a query sees keys at most `window` positions away (-1: no limit)."""
    n, length = valid_tokens.shape
    mask = jnp.broadcast_to(valid_tokens[:, None, None, :], (n, 1, length, length))
    if causal:
        mask = mask & jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]
    if attn_mask is not None:
        if attn_mask.dtype != jnp.bool_:
            raise TypeError(
                f"attn_mask must be bool (True = may attend), got {attn_mask.dtype}: "
                "convert additive float masks with masks.from_torch_attn_mask"
            )
        if attn_mask.ndim == 2:
            chex.assert_shape(attn_mask, (length, length))
            mask = mask & attn_mask[None, None]
        else:
            chex.assert_shape(attn_mask, (n, length, length))
            mask = mask & attn_mask[:, None]
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (n, length))
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    if window is not None:
        idx = jnp.arange(length)
        mask = mask & window_mask(idx, idx, window)[None, None]
    return mask


def window_mask(queries: jax.Array, keys: jax.Array, window: jax.Array) -> jax.Array:
    """bool[Q, M]: |query index - key index| <= window, or everything when window < 0 (a global layer).

    Indices, not positions: in packed rows a segment's tokens are contiguous, so the distance is the same."""
    near = jnp.abs(queries[:, None] - keys[None, :]) <= window
    return near | (jnp.asarray(window) < 0)


def lengths_to_valid_tokens(lengths: Any, length: int) -> jax.Array:
    """int[N] real-token counts -> bool[N, L] (real tokens first)."""
    return jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]  # [N, L]


def valid_tokens_to_lengths(valid_tokens: jax.Array) -> jax.Array:
    return jnp.sum(valid_tokens, axis=-1, dtype=jnp.int32)


def is_left_aligned(valid_tokens: Any) -> bool:
    """True when every row has its real tokens first and padding only at the end (host-side check)."""
    v = np.asarray(valid_tokens, bool)
    return bool(np.all(v[:, :-1] | ~v[:, 1:]))


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int[N, L] position of each token within its own segment (restarts at 0 per segment)."""
    n, length = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(length), (n, length))
    starts = jnp.concatenate(
        [jnp.ones((n, 1), jnp.bool_), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - start_idx


# --- PyTorch boundary -------------------------------------------------------------------------


def from_torch_key_padding_mask(key_padding_mask: Any) -> np.ndarray:
    """PyTorch key_padding_mask (bool True = ignore, or additive float -inf = ignore) -> valid_tokens."""
    m = np.asarray(key_padding_mask)
    if m.dtype == np.bool_:
        return ~m
    return _additive_to_bool(m, "key_padding_mask")


def to_torch_key_padding_mask(valid_tokens: Any) -> np.ndarray:
    """valid_tokens (True = real) -> PyTorch key_padding_mask (True = ignore)."""
    return ~np.asarray(valid_tokens, bool)


def from_torch_attn_mask(src_mask: Any, num_heads: int | None = None) -> np.ndarray:
    """PyTorch src_mask [L, L] or [N*H, L, L] (bool True = ignore, or additive float) -> True = attend.

    With `num_heads`, a per-head [N*H, L, L] mask becomes our [N, L, L]; its heads must agree,
    because one mask serves every head here.
    """
    m = np.asarray(src_mask)
    allowed = ~m if m.dtype == np.bool_ else _additive_to_bool(m, "src_mask")
    if num_heads is None or allowed.ndim != 3:
        return allowed
    nh, length, _ = allowed.shape
    if nh % num_heads:
        raise ValueError(
            f"src_mask has {nh} masks on its first axis, not a multiple of num_heads={num_heads}: "
            "pass [L, L] or [N*H, L, L]"
        )
    per_head = allowed.reshape(nh // num_heads, num_heads, length, length)  # [N, H, L, L]
    if not np.all(per_head == per_head[:, :1]):
        raise ValueError(
            "src_mask differs across heads: jaxblock applies one mask to every head, "
            "pass an [L, L] or per-example mask repeated over heads"
        )
    return per_head[:, 0]  # [N, L, L]


def to_torch_attn_mask(attn_mask: Any) -> np.ndarray:
    """attn_mask (True = may attend) -> PyTorch boolean src_mask (True = ignore)."""
    return ~np.asarray(attn_mask, bool)


def _additive_to_bool(m: np.ndarray, name: str) -> np.ndarray:
    blocked = np.isneginf(m)
    if not np.all(blocked | (m == 0)):
        raise ValueError(
            f"{name} has additive values other than 0 and -inf: only masking is supported, "
            "pass a boolean mask or move the bias into the model"
        )
    return ~blocked


def sees_a_key(mask: jax.Array, valid_tokens: jax.Array, *, causal: bool, plain: bool) -> jax.Array:
    """bool[N, L]: the query sees at least one key. With padding (and causal) only, that is O(N L) from
    valid_tokens, not a reduction of the [N, 1, L, L] mask."""
    if not plain:
        return jnp.any(mask, axis=-1)[:, 0]
    if causal:  # query i sees a key iff some key j <= i is real
        return jax.lax.cummax(valid_tokens.astype(jnp.int32), axis=1) > 0
    return jnp.broadcast_to(jnp.any(valid_tokens, axis=-1, keepdims=True), valid_tokens.shape)


def static_int(value: Any) -> int | None:
    """The value as a Python int when it is known while tracing (a constant), None when it is traced."""
    try:
        return int(value)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None
