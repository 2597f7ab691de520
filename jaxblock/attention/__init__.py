"""Multi-head self-attention and its kernels, one family in one package.

- `module.py`: `SelfAttention`, the Flax module (projections, RoPE, the unfused path with its recorded
  weights and dropout); it asks `dispatch.py` which kernel runs.
- `dispatch.py`: `choose_implementation`, one rule per kernel, each with its reason.
- one file per kernel, all computing the same function (same masks, exactly 0 for a query that sees
  no key): `dense.py` (CPU, hand-written backward), `chunked.py` (online softmax over key blocks),
  `xla.py` (XLA's and cuDNN's `dot_product_attention`).
"""

from jaxblock.attention.chunked import chunked_attention
from jaxblock.attention.dense import dense_attention
from jaxblock.attention.dispatch import choose_implementation
from jaxblock.attention.module import SelfAttention

__all__ = ["SelfAttention", "choose_implementation", "chunked_attention", "dense_attention"]
