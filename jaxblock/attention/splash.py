"""Splash attention (JAX's Pallas TPU kernel) with the package's masks and its no-key rule.

The kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) takes a static mask (full, causal, local
window, one per query head) and per-token segment ids, and skips key blocks the static mask rules out.
Every mask the model makes maps onto it:

- padding and packing become segment ids: a query keeps its segment s (2s), a real key its segment (2s),
  a padded key the odd id 1 that no real query holds, so padded keys are never seen and padded queries
  see the real keys of their segment, exactly as the dense mask says;
- causal is `CausalMask`, a per-layer window `LocalMask((w, w))` (causal and window: `LocalMask((w, 0))`);
  a traced per-layer window (a scanned stack) picks among the stack's static windows with `lax.switch`;
- GQA runs the MQA form of the kernel once per key/value head, over its R query heads;
- L is padded to a multiple of the block (128 at least, the TPU lane width); the padding is keys no query
  sees and queries that are cut off after the call.

A query that sees no key (a padded row, or a padded query outside every window) would get splash's
undefined softmax. Such a query is given the odd id too, so it sees the padded key at its own position
(inside every window and causal mask) whose value is 0, and its output is then set to exactly 0: finite
values and gradients, the same zeros as every other kernel.

Under an ambient mesh (`platform.mesh_layout`) the kernel runs inside `jax.shard_map`: rows split over
the batch axes, heads over the tensor axes when they divide both H and G (else heads stay whole).
Off a TPU the kernel runs only in Pallas interpret mode (tests, parity checks): slow, but the same code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from jaxblock import masks
from jaxblock.attention.platform import mesh_layout, target_platform

LANES = 128  # TPU lane width: splash's block sizes are multiples of it
RESIDUALS = "splash_residuals"  # the kernel's output and log-sum-exp, saved for its backward
_BLOCKS = (512, 256, 128)


def padded_length(length: int) -> int:
    """L rounded up to a multiple of the TPU lane width (the kernel's smallest block)."""
    return -(-length // LANES) * LANES


def block_size(length: int) -> int:
    """The largest of 512, 256, 128 that divides the padded length (MaxText's and Levanter's default 512)."""
    lp = padded_length(length)
    return next(b for b in _BLOCKS if lp % b == 0)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid_tokens: jax.Array,
    *,
    causal: bool,
    segment_ids: jax.Array | None = None,
    window: jax.Array | int | None = None,
    window_choices: tuple[int, ...] = (),
    interpret: bool | None = None,
) -> jax.Array:
    """ctx [N, L, H, K] from q [N, L, H, K], k, v [N, L, G, K] (v already 0 at padded keys).

    window: keys at most this far on either side (-1 or None: all), a Python int or a traced scalar that
    is one of `window_choices`. interpret: Pallas interpret mode; None means 'unless the target is a TPU'."""
    interpret = target_platform() != "tpu" if interpret is None else interpret
    n, length, h, kdim = q.shape
    g = k.shape[2]
    seg = jnp.zeros((n, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    mask = masks.attention_mask(valid_tokens, causal=causal, segment_ids=segment_ids,
                                window=None if window is None else jnp.asarray(window, jnp.int32))
    seen = jnp.any(mask[:, 0], axis=-1)  # [N, L]: fused into one reduction, never stored as [L, L]
    q_ids = jnp.where(seen, 2 * seg, 1)
    kv_ids = jnp.where(valid_tokens, 2 * seg, 1)

    lp = padded_length(length)
    pad = lp - length
    q = q * jnp.asarray(1.0 / math.sqrt(kdim), q.dtype)
    qp, kp, vp = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    q_ids = jnp.pad(q_ids, ((0, 0), (0, pad)), constant_values=1)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, pad)), constant_values=1)

    static = None if window is None else masks.static_int(window)
    if static is not None or window is None:
        run = _runner(lp, h // g, causal, -1 if static is None else static, bool(interpret), release=True)
        out = _sharded(run, qp, kp, vp, q_ids, kv_ids)
    else:
        choices = tuple(sorted(set(window_choices)))
        if not choices:
            raise ValueError("a traced attention window needs the stack's window_choices for splash attention")
        branches = [
            functools.partial(_sharded, _runner(lp, h // g, causal, w, bool(interpret), release=False)) for w in choices
        ]
        index = jnp.searchsorted(jnp.asarray(choices, jnp.int32), jnp.asarray(window, jnp.int32))
        out = jax.lax.switch(jnp.clip(index, 0, len(choices) - 1), branches, qp, kp, vp, q_ids, kv_ids)
    out = out[:, :length]
    return jnp.where(seen[:, :, None, None], out, jnp.zeros((), out.dtype))


@functools.lru_cache(maxsize=64)
def _runner(lp: int, r: int, causal: bool, window: int, interpret: bool, release: bool) -> Callable[..., jax.Array]:
    """A function (q [n, Lp, H, K], k, v [n, Lp, G, K], q_ids, kv_ids [n, Lp]) -> [n, Lp, H, K] for one shard.

    release: the backward's residuals made next to the kernel (`_residuals_at_the_kernel`); inside `lax.switch`
    (a scanned stack's traced window) the kernel's residuals are instead saved by name through jax.checkpoint,
    as custom_vjp's residual pytree from jax.vjp does not lower inside a switch branch of a scan here."""
    shape = (lp, lp)
    if window >= 0:
        head_mask: splash_mask.Mask = splash_mask.LocalMask(shape, (window, 0 if causal else window), offset=0)
    elif causal:
        head_mask = splash_mask.CausalMask(shape)
    else:
        head_mask = splash_mask.FullMask(shape)
    block = block_size(lp)
    sizes = splash_kernel.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )

    def run(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
        # Built where it is traced: the mask tables become constants of this shard's program.
        kernel = splash_kernel.make_splash_mqa_single_device(
            mask=splash_mask.MultiHeadMask([head_mask] * r), block_sizes=sizes, interpret=interpret,
            residual_checkpoint_name=RESIDUALS,
        )
        n, _, h, kdim = q.shape
        g = k.shape[2]
        qg = q.reshape(n, lp, g, r, kdim).transpose(0, 2, 3, 1, 4)  # [n, G, R, Lp, K]
        kg = k.transpose(0, 2, 1, 3)  # [n, G, Lp, K]
        vg = v.transpose(0, 2, 1, 3)

        def call(qh: jax.Array, kh: jax.Array, vh: jax.Array, qi: jax.Array, ki: jax.Array) -> jax.Array:
            return kernel(qh, kh, vh, segment_ids=splash_kernel.SegmentIds(q=qi, kv=ki))

        if release:
            one = _residuals_at_the_kernel(call)
        else:
            one = jax.checkpoint(call, policy=jax.checkpoint_policies.save_only_these_names(RESIDUALS))
        per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))  # over G
        out = jax.vmap(per_head)(qg, kg, vg, q_ids, kv_ids)  # [n, G, R, Lp, K]
        return out.transpose(0, 3, 1, 2, 4).reshape(n, lp, h, kdim)

    return run


def _residuals_at_the_kernel(call: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The kernel `call(q, k, v, q_ids, kv_ids)`, differentiated by splash's own backward, with what that backward
    reads (q, k, v, the output and each query's log-sum-exp [R, Lp]) made in the forward, next to the kernel.

    The kernel writes the log-sum-exp lane-wide, [R, Lp, 128] float32, and keeps column 0. XLA may move that
    slice to the backward and keep the lane-wide array from the forward until then, 128 times the size, in
    every layer: the TPU compiler did so in an FSDP step, whose weight gathers reorder the forward. One
    optimization barrier over the output and the sliced log-sum-exp makes the output wait for the slice, so
    the forward holds only that (a barrier over every residual, the kernel's mask tables included, stopped
    libtpu 0.0.42.1 with a failed check in its memory-space assignment for BERT-base at L 128, v5e-8); a
    second one, over the residuals and the output's gradient, keeps the backward from widening them to 128
    lanes again ahead of time (without it a data-parallel step widened several layers' at once, at the top of
    the backward pass).

    q, k, v and the output are [.., Lp, K]: with a head width K that is not a multiple of the TPU's 128 lanes
    (BERT's 64) each row of K fills a 128-lane row, so the kernel's layout holds them in twice their bytes. The
    forward keeps them for the backward as [.., Lp * K / 128, 128] copies (`_Dense`), which fill every lane, and
    the backward makes the kernel's layout again from those (after its barrier, which keeps the compiler from
    folding a copy back into the array it was made from). The copies stay out of the forward's barrier: made
    there, they kept the TPU compiler from recomputing on its own near the chip's limit (BERT-base at L 512,
    FSDP without remat: 167 rows a chip no longer fit). All shown by libtpu's compiler for v5e-8 on a CPU host,
    not run on a chip."""

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
        return call(q, k, v, q_ids, kv_ids)

    def forward(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array,
                kv_ids: jax.Array) -> tuple[jax.Array, Any]:
        # every input a primal, so that the backward (a pytree of the residuals) closes over no traced value
        out, backward = jax.vjp(call, q, k, v, q_ids, kv_ids)
        leaves, tree = jax.tree.flatten(backward)
        lse = [i for i, x in enumerate(leaves) if x.dtype == jnp.float32 and x.shape == q.shape[:-1]]
        narrow = [i for i, x in enumerate(leaves) if any(x is y for y in (q, k, v, out))
                  and x.shape[-1] % LANES and x.shape[-2] * x.shape[-1] % LANES == 0]
        dense = [_Dense.pack(leaves[i]) for i in narrow]  # not in the barrier: see the docstring
        out, kept = jax.lax.optimization_barrier((out, [leaves[i] for i in lse]))
        for i, x in zip(lse + narrow, kept + dense, strict=True):
            leaves[i] = x
        return out, jax.tree.unflatten(tree, leaves)

    def backward(saved: Any, d_out: jax.Array) -> tuple[jax.Array | None, ...]:
        # And the backward widens the log-sum-exp to 128 lanes again only once this layer's gradient exists, and
        # unpacks the _Dense copies only after it.
        saved, d_out = jax.lax.optimization_barrier((saved, d_out))
        saved = jax.tree.map(lambda x: x.unpack() if isinstance(x, _Dense) else x, saved,
                             is_leaf=lambda x: isinstance(x, _Dense))
        return (*saved(d_out)[:3], None, None)  # no cotangent for the segment ids

    attend.defvjp(forward, backward)
    return attend


@jax.tree_util.register_pytree_node_class
class _Dense:
    """An array [.., Lp, K] kept as [.., Lp * K / 128, 128] (every TPU lane used), and its width K."""

    def __init__(self, packed: jax.Array, width: int):
        self.packed, self.width = packed, width

    @classmethod
    def pack(cls, x: jax.Array) -> _Dense:
        return cls(x.reshape(*x.shape[:-2], -1, LANES), x.shape[-1])

    def unpack(self) -> jax.Array:
        return self.packed.reshape(*self.packed.shape[:-2], -1, self.width)

    def tree_flatten(self) -> tuple[tuple[jax.Array], int]:
        return (self.packed,), self.width

    @classmethod
    def tree_unflatten(cls, width: int, children: tuple[jax.Array]) -> _Dense:
        return cls(children[0], width)


def _sharded(run: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
             q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
    """`run` on each shard of the ambient mesh (rows over batch axes, heads over tensor axes), or whole."""
    layout = mesh_layout()
    if layout is None:
        return run(q, k, v, q_ids, kv_ids)
    n, _, h, _ = q.shape
    g = k.shape[2]
    batch = layout.batch if n % layout.size(layout.batch) == 0 else ()
    heads = layout.heads if h % layout.size(layout.heads) == 0 and g % layout.size(layout.heads) == 0 else ()
    # Inside shard_map even when nothing divides (every device then runs the whole call): XLA cannot
    # partition a Mosaic kernel on a mesh of several devices by itself.
    b, t = layout.entry(batch), layout.entry(heads)
    qs, rows = PartitionSpec(b, None, t, None), PartitionSpec(b, None)
    return jax.shard_map(
        run, mesh=layout.mesh, in_specs=(qs, qs, qs, rows, rows), out_specs=qs, check_vma=False,
    )(q, k, v, q_ids, kv_ids)
