"""Analytic FLOP counts for the encoder stack (what "achieved FLOP/s" and MFU are measured against).

Only matrix products are counted, at 2 FLOPs per multiply-add (an [m, k] x [k, n] product is 2·m·k·n);
norms, softmax, activations and the optimizer are not, so the fraction of peak is a lower bound on how
busy the machine is. Per layer, for a batch of N rows of length L (width D, H heads of width K = D/H,
G key/value heads, FFN width F):

    projections  2·N·L·D·(2·H·K + 2·G·K)     q and out: D x H·K each; k and v: D x G·K each
    FFN          2·N·L·D·F·(2 or 3)          linear1 and linear2 (and the gate for SwiGLU/GEGLU)
    attention    4·N·L²·H·K                  scores q·kᵀ and the weighted sum of v, each 2·N·H·L²·K

With G = H and F = 4D this is the familiar forward = 2·N·L·(4D² + 2DF) + 4·N·L²·D per layer. Every
query is scored against every key (padded and causally hidden keys included), because that is what
the dense kernels execute. A training step costs 3x the forward (backward = 2x forward: one product
for the input gradient and one for the weight gradient per forward product); `remat='full'` executes
one more forward (counted in `executed_train_flops`, not in the model FLOPs that MFU uses).
"""

from __future__ import annotations

from jaxblock.config import BlockConfig, StackConfig


def layer_forward_flops(block: BlockConfig, n: int, length: int) -> int:
    """Matmul FLOPs of one block's forward pass on [N, L, D]."""
    d, f, h, g, k = block.model_dim, block.ffn_dim, block.num_heads, block.kv_heads, block.head_dim
    tokens = n * length
    projections = 2 * tokens * d * (2 * h * k + 2 * g * k)
    ffn = 2 * tokens * d * f * (3 if block.is_glu else 2)
    attention = 4 * n * length * length * h * k
    return projections + ffn + attention


def forward_flops(stack: StackConfig, n: int, length: int) -> int:
    """Matmul FLOPs of the layer stack's forward pass (inference)."""
    return stack.num_layers * layer_forward_flops(stack.block, n, length)


def train_flops(stack: StackConfig, n: int, length: int) -> int:
    """Model FLOPs of one training step: forward + backward (2x forward). The MFU numerator."""
    return 3 * forward_flops(stack, n, length)


def executed_train_flops(stack: StackConfig, n: int, length: int) -> int:
    """FLOPs the hardware executes: full rematerialization recomputes each block's forward once more.

    remat='dots' saves every matmul output, so it recomputes only elementwise work (no extra FLOPs).
    """
    extra = forward_flops(stack, n, length) if stack.remat == "full" else 0
    return train_flops(stack, n, length) + extra
