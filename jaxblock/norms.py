"""LayerNorm and RMSNorm over the last axis (D), per token.

Statistics come from each token's own D features only: never from the batch or the sequence, so
batch size and padded positions cannot change a real token's output. Statistics are computed in
float32 whatever the compute dtype; eps sits inside the square root.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock.config import BlockConfig
from jaxblock.cpu_switch import CpuSwitch, compiled_when_eager
from jaxblock.initializers import param


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias, over the last axis."""

    config: BlockConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        chex.assert_axis_dimension(x, -1, cfg.model_dim)
        return _layer_norm(x, *_affine_params(self, cfg), eps=cfg.norm_eps, dtype=cfg.compute_dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale (+ bias when use_bias); no mean subtraction."""

    config: BlockConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        chex.assert_axis_dimension(x, -1, cfg.model_dim)
        return _rms_norm(x, *_affine_params(self, cfg), eps=cfg.norm_eps, dtype=cfg.compute_dtype)


_SWITCH = CpuSwitch()
# (enabled) -> context manager: force LayerNorm's written-out backward on or off while tracing (off: plain
# autodiff, which forward-mode differentiation such as jax.jvp needs).
custom_backward = _SWITCH.forced


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _standardize(x: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over the last axis, with the backward written out (CPU only).

    dx = (g - mean(g) - x̂ · mean(g · x̂)) / sqrt(var + eps): two row reductions and one pass, where XLA's
    autodiff of the forward, on its CPU backend, split the backward into more passes over [N, L, D]
    (1.03-1.04x on the Pre-LN training steps, docs/performance-cpu.md). Values are the same formula."""
    return _standardize_fwd(x, eps)[0]


def _standardize_fwd(x: jax.Array, eps: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + eps)
    xhat = centred * rstd
    return xhat, (xhat, rstd)


def _standardize_bwd(eps: float, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array]:
    xhat, rstd = res
    mean_g = jnp.mean(g, axis=-1, keepdims=True)
    mean_gx = jnp.mean(g * xhat, axis=-1, keepdims=True)
    return ((g - mean_g - xhat * mean_gx) * rstd,)


_standardize.defvjp(_standardize_fwd, _standardize_bwd)


@compiled_when_eager("eps", "dtype")
def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, dtype: Any) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = _standardize(x32, eps) if _SWITCH.applies() else _standardize_fwd(x32, eps)[0]
    return _affine(y, scale, bias).astype(dtype)


@compiled_when_eager("eps", "dtype")
def _rms_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, dtype: Any) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return _affine(y, scale, bias).astype(dtype)


def _affine_params(module: nn.Module, cfg: BlockConfig) -> tuple[jax.Array, jax.Array | None]:
    """The norm's scale [D] and, when cfg.use_bias, bias [D] (else None)."""
    scale = param(
        module,
        "scale", nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        (cfg.model_dim,), cfg.params_dtype,
    )
    if not cfg.use_bias:
        return scale, None
    bias = param(
        module,
        "bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        (cfg.model_dim,), cfg.params_dtype,
    )
    return scale, bias


def _affine(y: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """y [..., D] float32 times scale (+ bias), in float32."""
    lead = (1,) * (y.ndim - 1)  # explicit broadcast: tests forbid implicit rank promotion
    y = y * scale.astype(jnp.float32).reshape(*lead, -1)
    return y if bias is None else y + bias.astype(jnp.float32).reshape(*lead, -1)


def make_norm(config: BlockConfig, name: str | None = None) -> nn.Module:
    """The norm the config asks for (name it outside setup; inside, the attribute names it)."""
    cls = RMSNorm if config.norm_type == "rmsnorm" else LayerNorm
    return cls(config, name=name) if name else cls(config)
