"""The norms, the FFN's activation and dropout, recomputed in the backward pass from their inputs on a GPU.

    y = recomputed(f, gradients)(x, ...)   # f's value; on a GPU, f's backward re-runs f from (x, ...)

Why: JAX's autodiff keeps every intermediate of a formula that its backward reads. For a LayerNorm over a
bfloat16 x [N, L, D] those are float32: x - mean, its square's inputs, x̂ (three float32 copies of x, six
times x's bytes); for the FFN's exact GELU the erf's derivative and two partial products [N, L, F], and the
activation itself for linear2's weight gradient. The backward needs none of them that it cannot get from
the inputs in one elementwise pass: the norm's x (its scale and bias are parameters) and the FFN's
pre-activation [N, L, F]. Dropout's backward needs only its keep mask, a bool per element, which its rng
redraws (jaxblock/kernels/dropout.py `Dropout`; the FFN's hidden dropout draws it inside the FFN's
function). Under `jax.checkpoint` the step keeps only those, and recomputes the rest where the backward reads
it. XLA's GPU compiler otherwise keeps them; the TPU compiler fuses them into the backward's passes itself
(docs/accelerators.md, "What a layer keeps for its backward", has the figures; `python -m train compile`
measures them).

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
        return "recomputed", ("GPU: the norms, the FFN's activation and the dropout masks re-run from their inputs "
                              "in the backward (jax.checkpoint), so a layer keeps x, the pre-activation and the rng, "
                              "not float32 copies, [N, L, F] partial products and bool masks")
    if platform == "tpu":
        return "saved", "TPU: the compiler fuses the formulas' intermediates into the backward itself"
    return "saved", "CPU: autodiff keeps the formulas' intermediates (host memory is plentiful; erf is dear)"


def recomputed(f: F, gradients: Gradients = "auto") -> F:
    """f, or f under `jax.checkpoint` (its backward re-runs it from its arguments) where `kernel` says so."""
    if kernel(gradients)[0] == "recomputed":
        return jax.checkpoint(f)  # type: ignore[return-value]
    return f
