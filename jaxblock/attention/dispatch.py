"""Which attention kernel runs, and why: one rule per kernel, pure Python (usable for reporting).

Every kernel of this package computes the same function (docs/model.md, "Attention kernels"): the
same masks, and exactly 0 for a query that sees no key. Adding a kernel is its file plus one rule here.
"""

from __future__ import annotations

from jaxblock.attention.platform import target_platform
from jaxblock.config import BlockConfig


def choose_implementation(
    config: BlockConfig,
    *,
    train: bool,
    backend: str | None = None,
    extra_mask: bool = False,
    length: int | None = None,
) -> tuple[str, str]:
    """(implementation, reason) for this config and call; pure Python, usable for reporting.

    extra_mask: an attn_mask, segment_ids or a per-layer window is present (cuDNN's fused kernel takes only
    sequence lengths and causal). length: L of the call; on a CPU, 'auto' picks the chunked
    kernel from 4 key blocks (L >= 4 * attn_chunk_size) on, where it measured faster than XLA's
    (1.26x at L=2048 and 1.38x at L=4096, with a third and a fifth of the memory: python -m bench --only length).
    """
    backend = backend or target_platform()
    dropout_on = train and config.attn_dropout > 0
    if config.attention != "auto":
        if config.attention in ("xla", "cudnn", "chunked") and dropout_on:
            return "unfused", f"attention='{config.attention}' has no attention-weight dropout; unfused ran"
        if config.attention == "cudnn":
            why = _cudnn_blocker(config, backend, extra_mask)
            if why:
                return "xla", f"cuDNN requested but {why}; XLA ran"
        return config.attention, f"attention='{config.attention}' requested"
    if dropout_on:
        if backend == "cpu":
            return "dense", "attention-weight dropout is active in training; on a CPU the dense kernel applies it"
        return "unfused", "attention-weight dropout is active in training (fused kernels have none)"
    why = _cudnn_blocker(config, backend, extra_mask)
    if why is None:
        return "cudnn", "NVIDIA GPU, half precision, padding/causal mask only"
    if backend == "cpu":
        if length is not None and length >= 4 * config.attn_chunk_size:
            return "chunked", (
                f"{why}; L={length} >= 4 key blocks of {config.attn_chunk_size}: chunked attention, "
                "memory linear in L, no [L, L] scores"
            )
        return "dense", f"{why}; on a CPU the dense kernel (hand-written backward) beats XLA's"
    return "xla", why


def _cudnn_blocker(config: BlockConfig, backend: str, extra_mask: bool) -> str | None:
    if backend != "gpu":
        return f"backend is {backend}, not an NVIDIA GPU"
    if config.dtype not in ("bfloat16", "float16"):
        return f"dtype {config.dtype} (cuDNN flash attention needs bfloat16/float16)"
    if extra_mask:
        return "an attn_mask, segment_ids or attention window is present (cuDNN takes only lengths and causal)"
    if config.head_dim % 8 or config.head_dim > 256:
        return f"head width {config.head_dim} (cuDNN needs a multiple of 8, at most 256)"
    return None
