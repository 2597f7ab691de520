"""JAX's Pallas GPU attention (a Triton kernel) for packed rows, with the package's masks and no-key rule.

cuDNN's fused kernel (`xla.py`, impl 'cudnn') takes only sequence lengths and causal; packed rows (segment
ids) come here. The kernel (`jax.experimental.pallas.ops.gpu.attention.mha`) takes one segment-id array
for queries and keys and causal, and nothing else:

- padding becomes the segment id 1 (real tokens get 2s, even): a padded key is seen by no real query;
- GQA repeats each key/value head R times (the kernel wants H heads on k and v); the repeat's gradient
  sums back onto the G heads;
- L is padded to a multiple of the kernel's 128-row block;
- windows and arbitrary attn_masks are not expressible: the dispatch sends those to XLA, with the reason.

Where its function differs from the dense kernel: a padded query sees the padded keys (value 0) instead
of its segment's real keys, so its output is 0 rather than the dense kernel's; real positions are equal,
and a padded position never reaches a real one or a loss. Its q and k are 0 too, so whatever the padded
positions held (even NaN) a padded query's scores are 0 and its output exactly 0, in the kernel itself: the
output needs no mask after it, and the step keeps one copy of it for the backward, not a masked second one
(checked in Pallas interpret mode: tests/jaxblock/attention/test_accelerator_kernels.py).
Every query sees at least its own key (real or padded), so no row is left without a key.

Why this kernel and not tokamax: it ships inside jax (no new dependencies; tokamax pins typeguard 2.x and
brings qwix), handles exactly the masks the model makes besides windows, and lowers for CUDA on a CPU
host. It is deprecated after jax 0.11, where tokamax's Triton kernel takes its place (`pyproject.toml`
keeps jax below 0.11). Off a GPU it runs only in Pallas interpret mode.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
from jax.sharding import PartitionSpec

from jaxblock.attention.platform import mesh_layout, target_platform

BLOCK = 128  # the kernel's default query/key block


def pallas_gpu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid_tokens: jax.Array,
    *,
    causal: bool,
    segment_ids: jax.Array | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """ctx [N, L, H, K] from q [N, L, H, K], k, v [N, L, G, K] (v already 0 at padded keys)."""
    interpret = target_platform() != "gpu" if interpret is None else interpret
    n, length, h, kdim = q.shape
    g = k.shape[2]
    seg = jnp.zeros((n, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    ids = jnp.where(valid_tokens, 2 * seg, 1)
    q, k = (jnp.where(valid_tokens[:, :, None, None], a, jnp.zeros((), a.dtype)) for a in (q, k))
    pad = (-length) % BLOCK
    if g != h:
        k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    qp, kp, vp = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=1)

    def run(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array) -> jax.Array:
        return pallas_gpu.mha(q, k, v, ids, sm_scale=1.0 / math.sqrt(kdim), causal=causal,
                              interpret=bool(interpret))

    layout = mesh_layout()
    batch = () if layout is None or n % layout.size(layout.batch) else layout.batch
    heads = () if layout is None or h % layout.size(layout.heads) else layout.heads
    if layout is not None and (batch or heads):
        spec, rows = PartitionSpec(layout.entry(batch), None, layout.entry(heads), None), PartitionSpec(
            layout.entry(batch), None)
        out = jax.shard_map(run, mesh=layout.mesh, in_specs=(spec, spec, spec, rows), out_specs=spec,
                            check_vma=False)(qp, kp, vp, ids)
    else:
        out = run(qp, kp, vp, ids)
    return out[:, :length]  # 0 at padded queries (above)
