"""LayerNorm and RMSNorm: last axis, per token, eps inside the square root, float32 statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import BlockConfig, LayerNorm, RMSNorm, unbox


def _cfg(d: int, **kw) -> BlockConfig:
    return BlockConfig(model_dim=d, num_heads=1, ffn_dim=d, **kw)


def _apply(cls, cfg, x, params=None):
    if params is None:
        params = unbox(cls(cfg).init(jax.random.key(0), x))["params"]
    return np.asarray(cls(cfg).apply({"params": params}, x)), params


def test_layernorm_hand_example_without_affine():
    # [1, 0.5]: mean 0.75, deviations +-0.25, variance 0.0625, std 0.25 -> [1, -1].
    cfg = _cfg(2, use_bias=False, norm_eps=1e-12)
    y, params = _apply(LayerNorm, cfg, jnp.array([[[1.0, 0.5]]]))
    assert set(params) == {"scale"}  # use_bias=False removes the norm's bias, as PyTorch's bias=False
    np.testing.assert_allclose(y, [[[1.0, -1.0]]], atol=1e-5)


def test_layernorm_is_per_token_never_batch_or_sequence_statistics():
    cfg = _cfg(4)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 4)) * 3.0 + 1.0, jnp.float32)
    y, params = _apply(LayerNorm, cfg, x)
    x_np = np.asarray(x, np.float64)
    ref = (x_np - x_np.mean(-1, keepdims=True)) / np.sqrt(x_np.var(-1, keepdims=True) + cfg.norm_eps)
    np.testing.assert_allclose(y, ref, atol=1e-5)
    # Changing other tokens (and the batch size) leaves a token's output unchanged.
    x2 = x.at[:, 1:].set(100.0)
    y2, _ = _apply(LayerNorm, cfg, x2, params)
    np.testing.assert_array_equal(y2[:, 0], y[:, 0])
    y_one, _ = _apply(LayerNorm, cfg, x[:1, :2], params)
    np.testing.assert_allclose(y_one, y[:1, :2], atol=1e-6)


def test_layernorm_affine_is_per_feature():
    cfg = _cfg(3)
    x = jnp.array([[[1.0, 2.0, 4.0]]])
    params = {"scale": jnp.array([1.0, 2.0, -1.0]), "bias": jnp.array([0.5, 0.0, 1.0])}
    y, _ = _apply(LayerNorm, cfg, x, params)
    z = (np.array([1.0, 2.0, 4.0]) - 7 / 3) / np.sqrt(np.var([1.0, 2.0, 4.0]) + 1e-5)
    np.testing.assert_allclose(y[0, 0], z * [1.0, 2.0, -1.0] + [0.5, 0.0, 1.0], atol=1e-5)


def test_eps_sits_inside_the_square_root():
    # x = [0.1, -0.1]: variance 0.01. Inside: 0.1 / sqrt(0.01 + 0.01) = 0.7071; outside it would be 0.909.
    cfg = _cfg(2, use_bias=False, norm_eps=1e-2)
    y, _ = _apply(LayerNorm, cfg, jnp.array([[[0.1, -0.1]]]))
    np.testing.assert_allclose(y[0, 0], [1 / np.sqrt(2), -1 / np.sqrt(2)], atol=1e-6)
    # A constant token has zero variance: eps keeps the output finite (exactly 0).
    y0, _ = _apply(LayerNorm, cfg, jnp.full((1, 1, 2), 3.0))
    np.testing.assert_array_equal(y0, np.zeros((1, 1, 2)))


def test_rmsnorm_scales_by_root_mean_square_without_subtracting_the_mean():
    cfg = _cfg(2, norm_type="rmsnorm", use_bias=False, norm_eps=1e-12)
    y, params = _apply(RMSNorm, cfg, jnp.array([[[3.0, 4.0]]]))
    assert set(params) == {"scale"}
    np.testing.assert_allclose(y[0, 0], np.array([3.0, 4.0]) / np.sqrt(12.5), atol=1e-6)
    # The mean survives (LayerNorm would give [-1, 1] for any [a, a + 1]).
    y2, _ = _apply(RMSNorm, cfg, jnp.array([[[10.0, 11.0]]]), params)
    assert y2[0, 0, 0] > 0.9 and y2[0, 0, 1] > 0.9


def test_rmsnorm_bias_only_when_use_bias():
    cfg = _cfg(4, norm_type="rmsnorm")
    _, params = _apply(RMSNorm, cfg, jnp.ones((1, 1, 4)))
    assert set(params) == {"scale", "bias"}


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_statistics_in_float32_output_in_compute_dtype(cls):
    cfg = _cfg(8, dtype="bfloat16")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 8)) * 50.0 + 1000.0, jnp.bfloat16)
    variables = unbox(cls(cfg).init(jax.random.key(0), x))
    assert variables["params"]["scale"].dtype == jnp.float32  # params stay float32
    y = cls(cfg).apply(variables, x)
    assert y.dtype == jnp.bfloat16
    ref = cls(cfg.model_copy(update={"dtype": "float32"})).apply(variables, x.astype(jnp.float32))
    # bf16 has 8 mantissa bits: one rounding of an O(1) result is <= 2^-8 relative.
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=2e-2)


def test_wrong_width_is_rejected():
    with pytest.raises(AssertionError):
        LayerNorm(_cfg(4)).init(jax.random.key(0), jnp.ones((1, 2, 5)))


def test_layernorm_gradients_match_autodiff_of_the_formula():
    # On a CPU the backward is written out (jaxblock/norms.py _standardize); it must be the formula's gradient,
    # here from JAX's own autodiff of the plain formula.
    cfg = _cfg(6, norm_eps=1e-5)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 6)) * 3.0 + 1.0, jnp.float32)
    upstream = jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32)
    _, params = _apply(LayerNorm, cfg, x)
    params = jax.tree.map(lambda p: p + jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)

    def loss(p, x):
        return jnp.sum(LayerNorm(cfg).apply({"params": p}, x) * upstream)

    def formula(p, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
        return jnp.sum(((x - mean) / jnp.sqrt(var + 1e-5) * p["scale"][None, None] + p["bias"][None, None]) * upstream)

    (gp, gx), (wp, wx) = (jax.jit(jax.grad(f, argnums=(0, 1)))(params, x) for f in (loss, formula))
    np.testing.assert_allclose(np.asarray(gx), np.asarray(wx), rtol=1e-5, atol=1e-5)
    for name in ("scale", "bias"):
        np.testing.assert_allclose(np.asarray(gp[name]), np.asarray(wp[name]), rtol=1e-5, atol=1e-5)
