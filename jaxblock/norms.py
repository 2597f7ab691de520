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
from jaxblock.kernels import layer_norm


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias, over the last axis."""

    config: BlockConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        chex.assert_axis_dimension(x, -1, cfg.model_dim)
        # (x - mean) / sqrt(var + eps) in float32 (jaxblock/kernels/layer_norm.py `formula`), differentiated by the
        # kernel chosen for the platform
        y = layer_norm.standardize(x.astype(jnp.float32), cfg.norm_eps, cfg.gradients)
        return _affine(self, cfg, y)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale (+ bias when use_bias); no mean subtraction."""

    config: BlockConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        chex.assert_axis_dimension(x, -1, cfg.model_dim)
        x32 = x.astype(jnp.float32)
        ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return _affine(self, cfg, x32 * jax.lax.rsqrt(ms + cfg.norm_eps))


def _affine(module: nn.Module, cfg: BlockConfig, y: jax.Array) -> jax.Array:
    """y [..., D] float32 times the norm's scale [D] (plus its bias [D] when cfg.use_bias), in the compute dtype."""
    ones = logical(nn.initializers.ones_init(), ("embed",))
    scale = module.param("scale", ones, (cfg.model_dim,), cfg.params_dtype)
    lead = (1,) * (y.ndim - 1)  # explicit broadcast: tests forbid implicit rank promotion
    y = y * scale.astype(jnp.float32).reshape(*lead, -1)
    if cfg.use_bias:
        zeros = logical(nn.initializers.zeros_init(), ("embed",))
        bias = module.param("bias", zeros, (cfg.model_dim,), cfg.params_dtype)
        y = y + bias.astype(jnp.float32).reshape(*lead, -1)
    return y.astype(cfg.compute_dtype)


def make_norm(config: BlockConfig, name: str | None = None) -> nn.Module:
    """The norm the config asks for (name it outside setup; inside, the attribute names it)."""
    cls = RMSNorm if config.norm_type == "rmsnorm" else LayerNorm
    return cls(config, name=name) if name else cls(config)
