"""LayerNorm's standardization, x̂ = (x - mean) / sqrt(var + eps) over the last axis, with its backward written
out for a CPU.

    x̂ = standardize(x, eps)                      # the formula's value; on a CPU, this kernel's backward
    x̂ = standardize(x, eps, gradients="plain")   # the formula, differentiated by JAX, on every platform

Why: dx = (g - mean(g) - x̂ · mean(g · x̂)) / sqrt(var + eps) is two row reductions and one pass over [N, L, D].
XLA's CPU backend, given JAX's autodiff of the forward, split that backward into more passes. The values are
the same formula (float32 rounding differs, ~1e-7); tests/jaxblock/kernels/test_layer_norm.py holds the two
equal, values and gradients.

Chosen by the platform the step is traced for (jaxblock/attention/platform.py `target_platform`), as the attention
kernels are: on a CPU this one, elsewhere the formula (an accelerator's compiler fuses its backward itself).
`python -m bench.e2e` measures what it buys end to end (bench/records/e2e-main-*.md); run.json records the
choice and its reason (`kernel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxblock.attention.platform import target_platform
from jaxblock.kernels.projection import Gradients


def kernel(gradients: Gradients = "auto") -> tuple[str, str]:
    """(kernel, reason) of LayerNorm's backward for the platform being traced for, as run.json records it."""
    if gradients == "plain":
        return "autodiff", "model.block.gradients=plain: JAX's autodiff of the formula on every platform"
    if target_platform() == "cpu":
        return "written_backward", ("CPU: the backward written out as two row reductions and one pass (XLA's CPU "
                                    "backend split JAX's autodiff of it into more passes)")
    return "autodiff", "off the CPU: JAX's autodiff of the formula (the compiler fuses it)"


def formula(x: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over the last axis."""
    return _with_rstd(x, eps)[0]


def _with_rstd(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """The formula's value and 1 / sqrt(var + eps) [..., 1]."""
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + eps)
    return centred * rstd, rstd


def standardize(x: jax.Array, eps: float, gradients: Gradients = "auto") -> jax.Array:
    """`formula(x, eps)`, differentiated by the kernel chosen for the platform being traced for."""
    if kernel(gradients)[0] == "written_backward":
        return _written(x, eps)
    return formula(x, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _written(x: jax.Array, eps: float) -> jax.Array:
    return _written_fwd(x, eps)[0]


def _written_fwd(x: jax.Array, eps: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    xhat, rstd = _with_rstd(x, eps)
    return xhat, (xhat, rstd)


def _written_bwd(eps: float, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array]:
    xhat, rstd = res
    mean_g = jnp.mean(g, axis=-1, keepdims=True)
    mean_gx = jnp.mean(g * xhat, axis=-1, keepdims=True)
    return ((g - mean_g - xhat * mean_gx) * rstd,)


_written.defvjp(_written_fwd, _written_bwd)
