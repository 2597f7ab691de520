"""LayerNorm and RMSNorm over the last axis (D), per token.

Statistics come from each token's own D features only: never from the batch or the sequence, so
batch size and padded positions cannot change a real token's output. Statistics are computed in
float32 whatever the compute dtype; eps sits inside the square root.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock.config import BlockConfig
from jaxblock.initializers import logical
from jaxblock.kernels import layer_norm, recompute


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias, over the last axis."""

    config: BlockConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        chex.assert_axis_dimension(x, -1, cfg.model_dim)
        scale, bias = _params(self, cfg)

        def norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
            # (x - mean) / sqrt(var + eps) in float32 (jaxblock/kernels/layer_norm.py `formula`), differentiated by
            # the kernel chosen for the platform
            y = layer_norm.standardize(x.astype(jnp.float32), cfg.norm_eps, cfg.gradients)
            return _affine(cfg, y, scale, bias)

        # On a GPU its backward re-runs it from x (jaxblock/kernels/recompute.py).
        return recompute.recomputed(norm, cfg.gradients)(x, scale, bias)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale (+ bias when use_bias); no mean subtraction."""

    config: BlockConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        chex.assert_axis_dimension(x, -1, cfg.model_dim)
        scale, bias = _params(self, cfg)

        def norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
            x32 = x.astype(jnp.float32)
            ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
            return _affine(cfg, x32 * jax.lax.rsqrt(ms + cfg.norm_eps), scale, bias)

        return recompute.recomputed(norm, cfg.gradients)(x, scale, bias)


def _params(module: nn.Module, cfg: BlockConfig) -> tuple[jax.Array, jax.Array | None]:
    """The norm's scale [D] (ones) and, when cfg.use_bias, its bias [D] (zeros)."""
    ones = logical(nn.initializers.ones_init(), ("embed",))
    scale = module.param("scale", ones, (cfg.model_dim,), cfg.params_dtype)
    if not cfg.use_bias:
        return scale, None
    zeros = logical(nn.initializers.zeros_init(), ("embed",))
    return scale, module.param("bias", zeros, (cfg.model_dim,), cfg.params_dtype)


def _affine(cfg: BlockConfig, y: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """y [..., D] float32 times scale [D] (plus bias [D]), in the compute dtype."""
    lead = (1,) * (y.ndim - 1)  # explicit broadcast: tests forbid implicit rank promotion
    y = y * scale.astype(jnp.float32).reshape(*lead, -1)
    if bias is not None:
        y = y + bias.astype(jnp.float32).reshape(*lead, -1)
    return y.astype(cfg.compute_dtype)


def make_norm(config: BlockConfig, name: str | None = None) -> nn.Module:
    """The norm the config asks for (name it outside setup; inside, the attribute names it)."""
    cls = RMSNorm if config.norm_type == "rmsnorm" else LayerNorm
    return cls(config, name=name) if name else cls(config)
