"""The norms and the FFN's activation, recomputed in the backward pass from their inputs on a GPU.

    y = recomputed(f, gradients)(x, ...)   # f's value; on a GPU, f's backward re-runs f from (x, ...)

Why: JAX's autodiff keeps every intermediate of a formula that its backward reads. For a LayerNorm over a
bfloat16 x [N, L, D] those are float32: x - mean, its square's inputs, x̂ (three float32 copies of x, six
times x's bytes); for the FFN's exact GELU the erf's derivative and two partial products [N, L, F], and the
activation itself for linear2's weight gradient. The backward needs none of them that it cannot get from
the inputs in one elementwise pass: the norm's x (its scale and bias are parameters) and the FFN's
pre-activation [N, L, F]. Under `jax.checkpoint` the step keeps only those, and recomputes the rest where the
backward reads it. XLA's GPU compiler otherwise keeps them (BERT-base at L 512, 32 rows a chip on h100-8, no
remat: 6.59 GiB of temporaries with autodiff's residuals, 6.18 with these); the TPU compiler fuses them into the
backward's passes itself (docs/accelerators.md, "What a layer keeps for its backward"; `python -m train compile`
measures it).

Chosen by the platform the step is traced for (jaxblock/attention/platform.py `target_platform`), as the other
kernels are: on a GPU the recomputation (an elementwise pass costs little beside the matmuls, and the memory is
what limits the batch). On a TPU autodiff's residuals: the TPU compiler already keeps the same bytes without it,
and the recomputation's barriers cost an FSDP step 26 more all-reduces of the norms' gradients (BERT-base: 34
against 8). On a CPU autodiff's residuals as before (host memory is plentiful; erf is dear on a CPU).
`gradients="plain"` is JAX's autodiff of the formulas on every platform. The values are f's on every platform;
tests/jaxblock/kernels/test_recompute.py holds the gradients to plain autodiff and counts what is kept. run.json
records the choice and its reason (`kernel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

from jaxblock.attention.platform import target_platform
from jaxblock.kernels.projection import Gradients

F = TypeVar("F", bound=Callable[..., jax.Array])


def kernel(gradients: Gradients = "auto") -> tuple[str, str]:
    """(kernel, reason) of the norms' and the FFN activation's backward, as run.json records it."""
    if gradients == "plain":
        return "saved", "model.block.gradients=plain: JAX's autodiff of the formulas on every platform"
    platform = target_platform()
    if platform == "gpu":
        return "recomputed", ("GPU: the norms and the FFN's activation re-run from their inputs in the backward "
                              "(jax.checkpoint), so a layer keeps x and the pre-activation, not float32 copies and "
                              "[N, L, F] partial products")
    if platform == "tpu":
        return "saved", "TPU: the compiler fuses the formulas' intermediates into the backward itself"
    return "saved", "CPU: autodiff keeps the formulas' intermediates (host memory is plentiful; erf is dear)"


def recomputed(f: F, gradients: Gradients = "auto") -> F:
    """f, or f under `jax.checkpoint` (its backward re-runs it from its arguments) where `kernel` says so."""
    if kernel(gradients)[0] == "recomputed":
        return jax.checkpoint(f)  # type: ignore[return-value]
    return f
