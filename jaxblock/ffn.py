"""Position-wise feed-forward network: D -> F -> D, the same weights at every position.

Plain:  y = linear2(drop(act(linear1(x))))           act in relu | gelu (exact erf) | gelu_tanh
GLU:    y = linear2(drop(act(gate(x)) * linear1(x)))  swiglu: act = SiLU; geglu: act = exact GELU

Only the hidden activation is [N, L, F]; input and output are [N, L, D]. Each position is
transformed independently (an einsum over D or F only, never over L).
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock.config import BlockConfig
from jaxblock.initializers import Weights, bias_init, kernel_init
from jaxblock.kernels import projection, recompute
from jaxblock.kernels.dropout import Dropout, dropout

_SQRT_HALF = 0.7071067811865476


def gelu_exact(x: jax.Array) -> jax.Array:
    """0.5·x·(1 + erf(x/√2)): PyTorch's formula (nn.GELU()). It agrees with jax.nn.gelu(approximate=False),
    which evaluates erfc instead, to ~1e-6."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(_SQRT_HALF, x.dtype)))


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": gelu_exact,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "swiglu": jax.nn.silu,
    "geglu": gelu_exact,
}


class FeedForward(nn.Module):
    """(x [N, L, D]) -> [N, L, D]; hidden [N, L, F] with dropout `ffn_dropout` when training."""

    config: BlockConfig

    def setup(self) -> None:
        cfg = self.config
        d, f = cfg.model_dim, cfg.ffn_dim

        def up() -> Weights:
            return Weights(
                (d, f), kernel_init(cfg.init, d, 0, 1, ("embed", "mlp")),
                (f,), bias_init(cfg.init, d, ("mlp",)), cfg.use_bias, cfg.params_dtype
            )

        self.linear1 = up()
        if cfg.is_glu:
            self.gate = up()
        self.linear2 = Weights(
            (f, d), kernel_init(cfg.init, f, 0, 1, ("mlp", "embed")),
            (d,), bias_init(cfg.init, f, ("embed",)), cfg.use_bias, cfg.params_dtype,
        )
        self.hidden_dropout = Dropout(cfg.ffn_dropout, gradients=cfg.gradients)

    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        cfg = self.config
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, cfg.model_dim)
        dt = cfg.compute_dtype
        x = x.astype(dt)
        act = _ACTIVATIONS[cfg.activation]
        up = self._dense("NLD,DF->NLF", x, *self.linear1())  # [N, L, F]
        gate = self._dense("NLD,DF->NLF", x, *self.gate()) if cfg.is_glu else None
        # The hidden layer's dropout takes its rng here, as calling the Dropout module on h would.
        rng = self.hidden_dropout.rng() if train and cfg.ffn_dropout > 0.0 else None

        def out(up: jax.Array, gate: jax.Array | None, rng: jax.Array | None, w2: jax.Array,
                b2: jax.Array | None) -> jax.Array:
            h = act(up) if gate is None else act(gate) * up
            h = nn.with_logical_constraint(h, ("batch", "length", "act_mlp"))
            if rng is not None:  # the Dropout module's mask: the same rng, probability and shape
                h = dropout(h, rng, cfg.ffn_dropout)
            return self._dense("NLF,FD->NLD", h, w2, b2)

        # On a GPU its backward re-runs act and the keep mask from the pre-activation and the rng
        # (jaxblock/kernels/recompute.py) instead of keeping act's intermediates, the mask and the hidden layer.
        return recompute.recomputed(out, cfg.gradients)(up, gate, rng, *self.linear2())

    def _dense(self, spec: str, x: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
        dt = self.config.compute_dtype
        y = projection.einsum(spec, x, kernel.astype(dt), gradients=self.config.gradients)
        return y if bias is None else y + bias.astype(dt)[None, None, :]
