"""jaxblock/attention/xla.py: what it hands cuDNN (which runs only on a GPU: the call is intercepted here)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import masks
from jaxblock.attention import xla


def test_a_padding_row_reaches_cudnn_as_length_1_and_comes_back_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN's backward leaves dK/dV of a length-0 sequence unwritten (bench/records/h200-2026-12-04.md, "no-key
    # rows"); the row must reach it as length 1 and its output, so its gradient, must be 0.
    seen: dict[str, Any] = {}

    def fake(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        seen.update(kw)
        return q + 1.0  # nonzero everywhere: the zero must come from the no-key rule

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    valid = jnp.asarray(np.arange(6)[None, :] < np.asarray([6, 3, 0])[:, None])
    q = jnp.ones((3, 6, 2, 4), jnp.bfloat16)
    out = xla.fused_attention(q, q, q, masks.attention_mask(valid), valid, "cudnn", causal=False, plain=True)
    assert seen["implementation"] == "cudnn"
    np.testing.assert_array_equal(np.asarray(seen["key_value_seq_lengths"]), [6, 3, 1])
    np.testing.assert_array_equal(np.asarray(seen["query_seq_lengths"]), [6, 3, 1])
    assert not np.any(np.asarray(out[2], np.float32))
    assert np.all(np.asarray(out[0], np.float32) == 2.0)
