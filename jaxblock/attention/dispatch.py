"""Which attention kernel runs, and why: one rule per kernel, pure Python (usable for reporting).

Every kernel of this package computes the same function (docs/model.md, "Attention kernels"): the
same masks, and exactly 0 for a query that sees no key. Adding a kernel is its file plus one rule here.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxblock.attention.context import context_rule
from jaxblock.attention.platform import platform_name, target_platform
from jaxblock.config import BlockConfig, StackConfig


def choose_implementation(
    config: BlockConfig,
    *,
    train: bool,
    backend: str | None = None,
    extra_mask: bool = False,
    segments: bool = False,
    window: bool = False,
    attn_mask: bool = False,
    length: int | None = None,
) -> tuple[str, str]:
    """(implementation, reason) for this config and call; pure Python, usable for reporting.

    backend: 'cpu', 'gpu' or 'tpu' (None: `platform.target_platform()`, the platform being lowered for).
    segments / window / attn_mask: the call has packed rows, a per-layer window, an arbitrary bool mask;
    extra_mask: some extra mask of unstated kind (treated as an attn_mask, the most restrictive).
    length: L of the call; on a CPU, 'auto' picks the chunked kernel from 4 key blocks (L >= 4 *
    attention.chunk_size) on, where it measured faster than XLA's (1.26x at L=2048 and 1.38x at L=4096, with a
    third and a fifth of the memory: python -m bench --only length).
    """
    backend = platform_name(backend) if backend else target_platform()
    attn_mask = attn_mask or extra_mask
    masked = _MaskKinds(segments, window, attn_mask)
    dropout_on = train and config.attention.dropout > 0
    if config.attention.kernel != "auto":
        return _requested(config, backend, masked, dropout_on)
    if dropout_on:
        if backend == "cpu":
            return "dense", "attention-weight dropout is active in training; on a CPU the dense kernel applies it"
        return "unfused", (
            "attention-weight dropout is active in training and the fused kernels have none: set "
            "model.block.attention.dropout=0 for the fused kernel (the accelerator configs do; docs/accelerators.md)"
        )
    context = context_rule(length)  # the sequence split over a mesh axis (jaxblock/attention/context.py)
    if context is not None:
        return context
    if backend == "tpu":
        if attn_mask:
            return "xla", "TPU, but an arbitrary attn_mask is present (splash takes static masks and segment ids)"
        return "splash", "TPU: splash attention (padding and packing as segment ids, causal/window as static masks)"
    why = _cudnn_blocker(config, backend, masked)
    if why is None:
        return "cudnn", "NVIDIA GPU, half precision, padding/causal mask only"
    if backend == "gpu":
        if segments and not window and not attn_mask:
            return "pallas_gpu", f"{why}; packed rows: JAX's Pallas GPU kernel takes segment ids"
        return "xla", why
    if length is not None and length >= 4 * config.attention.chunk_size:
        return "chunked", (
            f"{why}; L={length} >= 4 key blocks of {config.attention.chunk_size}: chunked attention, "
            "memory linear in L, no [L, L] scores"
        )
    return "dense", f"{why}; on a CPU the dense kernel (hand-written backward) beats XLA's"


def layer_kernels(
    config: StackConfig, *, train: bool, length: int, segments: bool = False, attn_mask: bool = False,
    backend: str | None = None,
) -> list[tuple[str, str]]:
    """(implementation, reason) for each of the stack's B layers, as SelfAttention will choose them for
    a call of length L. Unscanned, a global layer among windowed ones has no window; scanned, every layer
    gets its window as a traced value, so all count as windowed."""
    windows = config.layers.per_layer.get("window")
    return [
        choose_implementation(config.block, train=train, backend=backend, segments=segments,
                              window=windows is not None and (config.scan_layers or windows[i] >= 0),
                              attn_mask=attn_mask, length=length)
        for i in range(config.num_layers)
    ]


class _MaskKinds(NamedTuple):
    segments: bool
    window: bool
    attn_mask: bool


def _requested(config: BlockConfig, backend: str, masked: _MaskKinds, dropout_on: bool) -> tuple[str, str]:
    name = config.attention.kernel
    if name in ("xla", "cudnn", "chunked", "splash", "pallas_gpu") and dropout_on:
        return "unfused", f"attention.kernel='{name}' has no attention-weight dropout; unfused ran"
    if name == "cudnn":
        why = _cudnn_blocker(config, backend, masked)
        if why:
            return "xla", f"cuDNN requested but {why}; XLA ran"
    if name == "splash":
        if masked.attn_mask:
            return "xla", "splash requested but an arbitrary attn_mask is present (splash takes static masks); XLA ran"
        if backend != "tpu":
            return "splash", f"attention.kernel='splash' requested; backend is {backend}: Pallas interpret mode (slow)"
    if name == "pallas_gpu":
        if masked.window or masked.attn_mask:
            return "xla", (
                "pallas_gpu requested but a window or attn_mask is present (it takes segment ids and causal); XLA ran"
            )
        if backend != "gpu":
            return "pallas_gpu", (
                f"attention.kernel='pallas_gpu' requested; backend is {backend}: Pallas interpret mode (slow)"
            )
    return name, f"attention.kernel='{name}' requested"


def _cudnn_blocker(config: BlockConfig, backend: str, masked: _MaskKinds) -> str | None:
    if backend != "gpu":
        return f"backend is {backend}, not an NVIDIA GPU"
    if config.dtype not in ("bfloat16", "float16"):
        return f"dtype {config.dtype} (cuDNN flash attention needs bfloat16/float16)"
    if any(masked):
        return "an attn_mask, segment_ids or attention window is present (cuDNN takes only lengths and causal)"
    if config.head_dim % 8 or config.head_dim > 256:
        return f"head width {config.head_dim} (cuDNN needs a multiple of 8, at most 256)"
    return None
